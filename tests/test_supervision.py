"""Stopping, worker identity and crash accounting of `fastjobs run`, as real processes.

Every handler execution inserts a row into `runs` (see tests/procs.py), so
"exactly once" is a count. Processes are signalled and killed by pid (or
process group); the tests wait on rows, stderr and /proc, never on a fixed
sleep, with deadlines below the rescuer's (15 s by default) wherever the
behaviour under test must not need it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App
from fastjobs.maintenance import HEARTBEAT_INTERVAL
from fastjobs.scoreboard import Labels, Scoreboard
from fastjobs.stats import WORKER

from . import procs
from .procs import count, runs, wait_for


def job(db: psycopg.Connection[Any], job_id: int) -> tuple[str, int, int, str | None, bool]:
    """(state, attempt, crashes, attempted_by, has errors) of one job."""
    row = db.execute(
        "SELECT state::text, attempt, crashes, attempted_by, errors IS NOT NULL"
        " FROM fastjobs_jobs_all WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None, f"job {job_id} is gone"
    return row[0], row[1], row[2], row[3], row[4]


def running_by(db: psycopg.Connection[Any], pid: int) -> list[int]:
    """Ids of the running jobs claimed by the worker process `pid`."""
    rows = db.execute(
        "SELECT id FROM fastjobs_jobs_all WHERE state = 'running' AND split_part(attempted_by, ':', 2) = %s"
        " ORDER BY id",
        (str(pid),),
    ).fetchall()
    return [r[0] for r in rows]


def worker_row(db: psycopg.Connection[Any], pid: int) -> str | None:
    row = db.execute("SELECT id FROM fastjobs_workers WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row[0])


# --- 1. a stop signal, however it arrives ---------------------------------------------------


@pytest.mark.parametrize(
    ("to", "sig", "times"),
    [
        pytest.param("master", signal.SIGTERM, 1, id="master-SIGTERM"),
        pytest.param("master", signal.SIGINT, 1, id="master-SIGINT"),
        pytest.param("master", signal.SIGTERM, 3, id="master-SIGTERM-x3"),
        pytest.param("group", signal.SIGTERM, 1, id="group-SIGTERM"),
        pytest.param("group", signal.SIGINT, 1, id="group-SIGINT"),
        pytest.param("group", signal.SIGTERM, 3, id="group-SIGTERM-x3"),
        pytest.param("group", signal.SIGINT, 3, id="group-SIGINT-x3"),
    ],
)
def test_a_stop_signal_is_one_graceful_stop_however_it_arrives(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any], to: str, sig: int, times: int
) -> None:
    """To the master alone or to its whole process group (Ctrl-C, systemd, `kill -PGID`), once or
    repeated at once: every job runs, none twice."""
    total = 400
    app.enqueue_many("record", ({"n": n, "sleep": 0.01} for n in range(total)))
    master = masters.start("--processes", "2", "--grace", "20")
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") >= 40, "40 executions")
    for time_ in range(times):
        if to == "master":
            os.kill(master.pid, sig)
        else:
            os.killpg(master.pid, sig)
        if time_ == 0 and times > 1:
            # Repeats sent at once would merge into one pending signal: these come after the
            # master took the first, within the window in which it is the same stop.
            master.wait_stderr("stopping")
    assert master.wait(15) == 0, master.stderr()
    assert "stopping now" not in master.stderr()
    ran = runs(db)
    assert ran and max(ran.values()) == 1, f"a job ran twice: {master.stderr()}"
    left = db.execute("SELECT state::text, attempt, count(*) FROM fastjobs_jobs_all GROUP BY 1, 2").fetchall()
    assert [row for row in left if row[:2] != ("available", 0)] == [], left

    again = masters.start("--processes", "2")
    wait_for(lambda: not count(db, "SELECT count(*) FROM fastjobs_jobs_all"), "the rest to drain", timeout=15)
    assert again.stop() == 0, again.stderr()
    assert runs(db) == Counter(range(total))


# --- 2. worker identity ---------------------------------------------------------------------


def test_a_foreign_worker_with_the_same_host_and_pid_keeps_its_running_job(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Containers sharing a hostname reuse pids: only the dead worker's exact id is released."""
    master = masters.start("--processes", "1")
    victim = master.wait_child("fastjobs: worker 1 ")
    own = wait_for(lambda: worker_row(db, victim), "the worker's row")
    host, pid, token = own.split(":")
    foreign = f"{host}:{pid}:{'f' * len(token)}"
    assert foreign != own
    db.execute(
        "INSERT INTO fastjobs_workers (id, host, pid, queues) VALUES (%s, %s, %s, '{elsewhere}')",
        (foreign, host, victim),
    )
    # Two jobs of a queue the master does not serve, claimed by hand: one by the foreign
    # worker, one by ours (as a claimed job it had not started).
    theirs = app.enqueue("record", {"n": 1}, queue="elsewhere")
    ours = app.enqueue("record", {"n": 2}, queue="elsewhere")
    for job_id, by in ((theirs, foreign), (ours, own)):
        db.execute(
            "UPDATE fastjobs_jobs_all SET state = 'running', attempt = 1, attempted_at = now(),"
            " attempted_by = %s WHERE id = %s",
            (by, job_id),
        )
    with psycopg.connect(app.dsn, autocommit=True) as listener:
        listener.execute("LISTEN fastjobs")
        os.kill(victim, signal.SIGKILL)
        # The release wakes the workers of that queue instead of leaving the job to their poll.
        woken = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert woken == ["elsewhere"]
    wait_for(lambda: job(db, ours)[0] == "available", "our unstarted job to be released", timeout=5)
    assert job(db, ours)[:3] == ("available", 0, 0)
    assert job(db, theirs)[:4] == ("running", 1, 0, foreign)
    assert master.stop() == 0, master.stderr()


def test_a_pruned_worker_row_comes_back_at_the_next_heartbeat(
    masters: procs.Masters, db: psycopg.Connection[Any]
) -> None:
    master = masters.start("--processes", "1")
    worker = master.wait_child("fastjobs: worker 1 ")
    own = wait_for(lambda: worker_row(db, worker), "the worker's row")
    db.execute("DELETE FROM fastjobs_workers WHERE id = %s", (own,))
    wait_for(
        lambda: worker_row(db, worker) == own,
        "the heartbeat to register again",
        timeout=HEARTBEAT_INTERVAL + 2,
    )
    assert master.stop() == 0, master.stderr()


# --- 3. crash accounting --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["record_timeout", "record_async"])
def test_only_the_slow_jobs_that_started_are_left_to_count_a_crash(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any], kind: str
) -> None:
    """A dead worker's slow jobs (async, timeout=): those running count a crash, the rest go back at once
    uncounted, and one whose cancellation was requested before it started ends cancelled."""
    ids: dict[int, int] = {app.enqueue(kind, {"n": n, "sleep": 60}): n for n in range(6)}
    master = masters.start("--processes", "1", "--queues", "default:2", "--grace", "1")
    victim = master.wait_child("fastjobs: worker 1 ")

    def held_beyond_its_concurrency() -> tuple[list[int], int] | None:
        """The jobs the worker holds once both slots run (for 60 s) and one it holds has not started.

        The worker claims ahead: jobs it holds but has not started. Two held jobs alone
        could be the two it runs, its claim ahead not back yet (seen in CI)."""
        held = running_by(db, victim)
        before = {n for (n,) in db.execute("SELECT n FROM runs")}
        waiting = [job_id for job_id in held if ids[job_id] not in before]
        return (held, waiting[0]) if len(before) >= 2 and waiting else None

    held, cancelled = wait_for(held_beyond_its_concurrency, "2 jobs running and one more held")
    assert app.cancel(cancelled) == "cancelling"
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not procs.alive(victim), "the worker to die")
    started = {n for (n,) in db.execute("SELECT n FROM runs WHERE pid = %s", (victim,))}
    unstarted = [job_id for job_id in held if ids[job_id] not in started]
    assert started and cancelled in unstarted, (started, held)

    def settled() -> bool:
        return set(running_by(db, victim)) == {j for j, n in ids.items() if n in started}

    # Well below the rescuer's 15 s: the master released them.
    wait_for(settled, "only the started jobs to be left to the rescuer", timeout=5)
    assert job(db, cancelled)[0] == "cancelled"
    for job_id in unstarted:
        if job_id == cancelled:
            continue
        state, attempt, crashes, by, _ = job(db, job_id)
        # Back and uncounted, or already claimed again by the heir.
        heirs = (state, attempt) == ("running", 1) and f":{victim}:" not in (by or "")
        assert crashes == 0 and ((state, attempt) == ("available", 0) or heirs), (state, attempt, crashes, by)
    assert master.stop(10) == 0, master.stderr()


POISON = '''
"""A job whose failure PostgreSQL cannot store (jsonb has no NUL): writing it kills the worker."""

from fjjobs import _record, app


@app.job("poison", max_attempts=3, retry=lambda attempt, jitter: 0)
def poison(n):
    _record(n)
    raise RuntimeError("an outcome the batch statement cannot write: \\x00")


@app.job("fail", max_attempts=1)
def fail(n):
    _record(n)
    raise RuntimeError("an ordinary failure")
'''


def test_a_job_whose_outcome_kills_its_worker_is_quarantined_alone(
    masters: procs.Masters, tmp_path: Path, app: App, db: psycopg.Connection[Any]
) -> None:
    """A worker that dies writing outcomes, with no handler running, implicates the poison job alone."""
    (tmp_path / "poisonjobs.py").write_text(POISON)
    # (This process's app does not know the kinds: their max_attempts go along.)
    first = app.enqueue("fail", {"n": 1}, max_attempts=1)
    poison = app.enqueue("poison", {"n": 0}, max_attempts=3)
    other = app.enqueue("fail", {"n": 2}, max_attempts=1)
    app.enqueue_many("record", ({"n": n} for n in range(100, 120)))
    master = masters.start("--processes", "1", "--rescue-after", "5", module="poisonjobs")
    try:
        wait_for(lambda: job(db, poison)[0] == "discarded", "the poison job to be quarantined", timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {job(db, poison)}; stderr:\n{master.stderr()}") from None
    # Quarantined after its crashes (or, should its outcome become writable, discarded after its attempts).
    assert job(db, poison)[2] <= 3
    # Its batch-mates are never charged: the failing ones fail once, the others complete.
    for failing in (first, other):
        assert job(db, failing)[:3] == ("discarded", 1, 0)
    wait_for(
        lambda: not count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE kind = 'record'"), "the rest"
    )
    assert set(runs(db)) >= set(range(100, 120))
    assert master.stop() == 0, master.stderr()


FLAKY = '''
"""A job that fails its first attempt on a worker, then kills that worker on its second."""

import os

import fastjobs
from fjjobs import _record, app


@app.job("flaky", queue="fastq", max_attempts=2, retry=lambda attempt, jitter: 0)
def flaky(n):
    _record(n)
    if fastjobs.current_job().attempt == 1:
        raise RuntimeError("the first attempt fails")
    os._exit(1)


@app.job("mate", queue="fastq")
def mate(n):
    _record(n)
'''


def test_a_job_that_failed_on_a_worker_then_kills_it_is_charged_that_crash(
    masters: procs.Masters, tmp_path: Path, app: App, db: psycopg.Connection[Any]
) -> None:
    """Its first attempt fails (written by this worker), its second kills the worker on the fast
    lane: the master charges that attempt a crash at once (its last: discarded), not a worker later."""
    (tmp_path / "flakyjobs.py").write_text(FLAKY)
    app.declare("mate", queue="fastq")
    app.declare("flaky", queue="fastq")
    # The quick jobs first: a queue takes the fast lane once a batch of it ran quickly.
    app.enqueue_many("mate", ({"n": n} for n in range(100, 110)), queue="fastq")
    flaky = app.enqueue("flaky", {"n": 0}, max_attempts=2, queue="fastq")
    master = masters.start("--processes", "1", "--queues", "fastq", module="flakyjobs")
    try:
        wait_for(lambda: job(db, flaky)[0] == "discarded", "the flaky job to be discarded", timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {job(db, flaky)}; stderr:\n{master.stderr()[:3000]}") from None
    state, attempt, crashes, _, _ = job(db, flaky)
    assert (state, attempt, crashes) == ("discarded", 2, 1)
    # Run twice: its failure, then the run that killed its worker (charged, so not run again).
    assert runs(db)[0] == 2, runs(db)
    assert "on the fast lane: it counts a crash" in master.stderr()
    assert master.stop() == 0, master.stderr()


LONELY = '''
"""A job whose failure is the one outcome of the statement its worker's connection loses."""

import os

import psycopg

import fastjobs
from fjjobs import _record, app

_held = []


@app.job("lonely", max_attempts=1)
def lonely(n):
    dsn = os.environ["FJ_TEST_RUNS_DSN"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = not conn.execute("SELECT count(*) FROM runs WHERE n = %s", (n,)).fetchone()[0]
    _record(n)
    if first:
        # Its row held (until this process exits): the statement writing this failure waits.
        lock = psycopg.connect(dsn)
        lock.execute("SELECT 1 FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (fastjobs.current_job().id,))
        _held.append(lock)
    raise RuntimeError("an ordinary failure")
'''


def test_a_connection_lost_writing_one_failure_charges_that_job_no_crash(
    masters: procs.Masters, tmp_path: Path, app: App, db: psycopg.Connection[Any]
) -> None:
    """The worker's session is terminated while its statement carries one failed job's outcome:
    the worker dies of it, but the outcome did not kill it. The job is given back uncounted,
    runs again and fails as any job does, charged no crash."""
    (tmp_path / "lonelyjobs.py").write_text(LONELY)
    lonely = app.enqueue("lonely", {"n": 0}, max_attempts=1)
    master = masters.start("--processes", "1", "--rescue-after", "5", module="lonelyjobs")

    def writing() -> int | None:
        """The worker's session, while it waits for the handler's lock on the row to write its failure
        (not any lock: the leader's rotation can make a claim wait for a moment)."""
        row = db.execute(
            "SELECT a.pid FROM pg_stat_activity a"
            " JOIN pg_stat_activity h ON h.pid = ANY(pg_blocking_pids(a.pid))"
            " WHERE a.datname = current_database() AND a.query LIKE '%%completed_later%%'"
            " AND h.state = 'idle in transaction' AND h.query LIKE 'SELECT 1 FROM fastjobs_jobs_all%%'"
        ).fetchone()
        return None if row is None else int(row[0])

    session = wait_for(writing, "the worker to write the failure")
    db.execute("SELECT pg_terminate_backend(%s)", (session,))
    try:
        wait_for(lambda: job(db, lonely)[0] == "discarded", "the job to fail again", timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {job(db, lonely)}; stderr:\n{master.stderr()[:3000]}") from None
    state, attempt, crashes, _, _ = job(db, lonely)
    assert (state, attempt, crashes) == ("discarded", 1, 0), master.stderr()
    assert runs(db)[0] == 2
    assert master.stop() == 0, master.stderr()


# --- 5. the master's death and the grace kill -----------------------------------------------


def test_the_workers_of_a_killed_master_give_back_their_jobs_and_exit_within_the_grace(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    long = app.enqueue("record", {"n": 0, "sleep": 60})
    app.enqueue_many("record", ({"n": n, "sleep": 0.01} for n in range(1, 6)))
    grace = 2.0
    master = masters.start("--processes", "1", "--grace", str(grace))
    worker = master.wait_child("fastjobs: worker 1 ")
    wait_for(lambda: runs(db)[0] == 1, "the long job to start")
    wait_for(lambda: len(running_by(db, worker)) >= 2, "the worker to hold a job it has not started")
    os.kill(master.pid, signal.SIGKILL)
    killed = time.monotonic()
    master.wait(5)
    # It stops now when the grace is over (the running job recorded as failed), and exits.
    wait_for(lambda: not procs.alive(worker), "the orphaned worker to exit", timeout=grace + 3)
    assert time.monotonic() - killed >= grace - 0.5  # it gave the running job its grace
    assert runs(db) == Counter({0: 1}), "nothing started after the master died"
    assert count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'running'") == 0
    state, attempt, crashes, _, errors = job(db, long)
    assert state in ("available", "retryable") and attempt == 1 and crashes == 0 and errors
    assert db.execute(
        "SELECT count(*) FROM fastjobs_jobs_all WHERE id <> %s AND (state <> 'available' OR attempt <> 0)",
        (long,),
    ).fetchone() == (0,)


def test_a_grace_kill_gives_back_the_unstarted_jobs_before_the_master_exits(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    long = app.enqueue("record", {"n": 0, "sleep": 60})
    app.enqueue_many("record", ({"n": n, "sleep": 0.01} for n in range(1, 6)))
    master = masters.start("--processes", "1", "--grace", "1")
    worker = master.wait_child("fastjobs: worker 1 ")
    wait_for(lambda: runs(db)[0] == 1, "the long job to start")
    wait_for(lambda: len(running_by(db, worker)) >= 2, "the worker to hold a job it has not started")
    master.signal(signal.SIGTERM)
    assert master.wait(10) == 0, master.stderr()
    assert "grace period over: sending SIGKILL" in master.stderr()
    # By the time the master has exited: the killed job waits for the rescuer, the rest are back.
    assert running_by(db, worker) == [long]
    assert db.execute(
        "SELECT count(*) FROM fastjobs_jobs_all WHERE id <> %s AND (state <> 'available' OR attempt <> 0)",
        (long,),
    ).fetchone() == (0,)


STANDALONE = """
import fastjobs
from fjjobs import app

worker = fastjobs.Worker(app)
worker.install_signals()
worker.run()
"""


@pytest.mark.parametrize("kind", ["record", "record_async"])
def test_a_standalone_worker_stops_gracefully_then_now_on_a_second_signal(
    tmp_path: Path, app: App, db: psycopg.Connection[Any], kind: str
) -> None:
    """Without a master, the first SIGTERM/SIGINT is a graceful stop and a second one stops now."""
    procs.create_runs_table(app.dsn)
    procs.Masters(tmp_path, app.dsn)  # writes the jobs module
    (tmp_path / "standalone.py").write_text(STANDALONE)
    long = app.enqueue(kind, {"n": 0, "sleep": 60})
    env = dict(os.environ, FASTJOBS_DSN=app.dsn, FJ_TEST_RUNS_DSN=app.dsn)
    with (tmp_path / "standalone.stderr").open("wb") as err:
        proc = subprocess.Popen([sys.executable, "standalone.py"], cwd=tmp_path, env=env, stderr=err)
    try:
        wait_for(lambda: runs(db)[0] == 1, "the long job to start")
        proc.send_signal(signal.SIGTERM)
        # Still running its job: the first signal waits for it.
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state, attempt, crashes, _, errors = job(db, long)
    assert state in ("available", "retryable") and attempt == 1 and crashes == 0 and errors


def test_the_card_records_the_slow_jobs_running_and_says_when_it_cannot() -> None:
    """More slow jobs running than the card has room for: no exact report (the master then leaves the
    worker's jobs to the rescuer, as before), until the extra ones end."""
    board = Scoreboard.create(1, capacity=2)
    try:
        card = board[0]
        card.claim(WORKER, 0)
        running = card.slow_jobs()
        for job_id in (11, 12):
            running.add(job_id)
        assert card.crash_report() == ([11, 12], 0)
        running.add(13)
        assert card.crash_report() == (None, 0)
        running.discard(13)
        running.discard(11)
        running.add(14)  # takes the entry 11 left
        assert card.crash_report() == ([14, 12], 0)
        card.running_view()[0] = 7  # the fast path's job counts too
        assert card.crash_report() == ([14, 12, 7], 0)
        for job_id in (12, 14):
            running.discard(job_id)
        # No counts per kind in this card: nothing takes the run times, so none is kept.
        assert running.took == {}
    finally:
        board.close(unlink=True)


def test_the_run_times_of_slow_jobs_are_kept_for_the_counts_of_the_card_alone() -> None:
    board = Scoreboard.create(1, capacity=2, labels=Labels(["k"], [["default"]]))
    try:
        card = board[0]
        card.claim(WORKER, 0)
        running = card.slow_jobs()
        running.add(21)
        running.discard(21)
        assert list(running.took) == [21] and running.took[21] >= 0
    finally:
        board.close(unlink=True)


def test_the_master_supervises_with_one_thread_and_no_socket(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """gunicorn's arbiter: while it supervises (a worker just died and was released, metrics are
    served) the master has one thread and holds no socket: no database connection, no listener."""
    master = masters.start("--processes", "1", "--metrics-port", "0")
    victim = master.wait_child("fastjobs: worker 1 ")
    master.wait_child("fastjobs: metrics")
    os.kill(victim, signal.SIGKILL)
    master.wait_child("fastjobs: worker 1 ", exclude=(victim,))
    app.enqueue("record", {"n": 1})
    wait_for(lambda: runs(db)[1] == 1, "the replacement to run a job")
    assert os.listdir(f"/proc/{master.pid}/task") == [str(master.pid)]
    held = []
    for fd in os.listdir(f"/proc/{master.pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{master.pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            continue
    assert not [target for target in held if target.startswith("socket:")], held
    assert master.stop() == 0, master.stderr()
