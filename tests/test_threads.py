"""Sync handlers on threads (`--queues name:N`), through `fastjobs run` as real processes.

Each execution of the handlers below inserts a row into `spans` from its own
thread's connection: the job's id and attempt as `current_job()` saw them,
the thread, and how many jobs its process was running when it started. So
concurrency is counted, not timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from fastjobs import App, pool

from . import procs
from .helpers import by_state, drain
from .procs import count, wait_for

MODULE = "fjthreads"

JOBS = '''
"""Handlers for the thread pool tests: each execution is one row of `spans`."""

import os
import signal
import threading
import time

import psycopg

import fastjobs

app = fastjobs.App()
_local = threading.local()
_lock = threading.Lock()
_active = [0]


def _span(n, active, note=None):
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = psycopg.connect(os.environ["FJ_TEST_RUNS_DSN"], autocommit=True)
    job = fastjobs.current_job()
    conn.execute(
        "INSERT INTO spans (n, pid, thread, job_id, attempt, active, note)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (n, os.getpid(), threading.get_ident(), job.id, job.attempt, active, note),
    )


def _started():
    with _lock:
        _active[0] += 1
        return _active[0]


def _ended():
    with _lock:
        _active[0] -= 1


@app.job("io")
def io(n, sleep=0.05):
    """An I/O-bound job: time.sleep releases the GIL, as a socket read does."""
    active = _started()
    try:
        _span(n, active)
        time.sleep(sleep)
    finally:
        _ended()


@app.job("spin", timeout=0.5, max_attempts=1)
def spin(n):
    """Runs past its timeout in Python code (short sleeps), where the timeout reaches it."""
    _span(n, _started())
    try:
        while True:
            time.sleep(0.01)
    finally:
        _ended()


@app.job("blocked", timeout=0.5, max_attempts=3)
def blocked(n):
    """Runs past its timeout inside one C call that no exception interrupts (a lock's wait)."""
    _span(n, _started())
    threading.Event().wait()


@app.job("until_cancelled", max_attempts=1)
def until_cancelled(n):
    _span(n, _started())
    try:
        job = fastjobs.current_job()
        while not job.cancelled:
            time.sleep(0.01)
        _span(n, 0, "saw cancelled")
    finally:
        _ended()


@app.job("exits")
def exits(n):
    """Stops its worker, as a handler in the main thread can: SystemExit."""
    _span(n, _started())
    _ended()
    time.sleep(0.3)  # the others of its wave are running by now
    raise SystemExit(3)


@app.job("stopper")
def stopper(n):
    """Stops its master (SIGTERM, relayed to the workers) while the rest of its wave waits."""
    _span(n, _started())
    try:
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(0.5)  # the stop has reached the worker's main thread by now
        _span(n, 0, "signalled")
        time.sleep(0.5)
    finally:
        _ended()
'''


@pytest.fixture
def threads(masters: procs.Masters, db: psycopg.Connection[Any]) -> procs.Masters:
    (masters.cwd / f"{MODULE}.py").write_text(JOBS)
    db.execute(
        "CREATE TABLE spans (n int, pid int, thread bigint, job_id bigint, attempt int, active int,"
        " note text, at timestamptz DEFAULT clock_timestamp())"
    )
    return masters


def spans(db: psycopg.Connection[Any], where: str = "note IS NULL") -> list[tuple[Any, ...]]:
    """(n, pid, thread, job_id, attempt, active) of each execution's start."""
    return db.execute(f"SELECT n, pid, thread, job_id, attempt, active FROM spans WHERE {where}").fetchall()


def job_state(db: psycopg.Connection[Any], job_id: int) -> tuple[str, int, str | None]:
    row = db.execute(
        "SELECT state::text, attempt, errors->-1->>'error' FROM fastjobs_jobs_all WHERE id = %s", (job_id,)
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


@pytest.mark.parametrize(("queues", "per_process"), [("default:20", 10), ("default:1", 1), ("default", 1)])
def test_a_queues_concurrency_runs_that_many_sync_jobs_at_once(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any], queues: str, per_process: int
) -> None:
    """`--processes 2 --queues default:20`: 10 sync jobs at once in each worker, 20 in all, never
    more; `default:1` and a bare `default` (no concurrency asked) run them one at a time; and
    each thread's `current_job()` is its own job."""
    # default:1 is one worker running one job at a time: 50 jobs (5 s of sleeps) show a second at
    # once as well as 200 would. The others keep 200, which keep both workers busy while the
    # second starts (each must run some).
    total = 50 if queues == "default:1" else 200
    ids = {app.enqueue("io", {"n": n, "sleep": 0.1}): n for n in range(total)}
    master = threads.start("--processes", "2", "--queues", queues, module=MODULE)
    wait_for(lambda: not count(db, "SELECT count(*) FROM fastjobs_jobs_all"), "the jobs to drain", timeout=60)
    assert master.stop() == 0, master.stderr()
    rows = spans(db)
    assert Counter(n for n, *_ in rows) == Counter(range(total))  # each exactly once
    assert all(ids[job_id] == n and attempt == 1 for n, _, _, job_id, attempt, _ in rows), rows
    peaks: dict[int, int] = {}
    for _, pid, _, _, _, active in rows:
        peaks[pid] = max(peaks.get(pid, 0), active)
    # Two workers share default:20 (10 each); default:1 goes to one worker; a bare name gets no threads.
    processes = 2 if queues != "default:1" else 1
    assert sorted(peaks.values()) == [per_process] * processes, peaks
    threads_used = {(pid, thread) for _, pid, thread, *_ in rows}
    assert len(threads_used) == per_process * processes


def test_a_threaded_job_past_its_timeout_fails_and_the_others_run_on(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """JobTimeout reaches a pool thread's handler (an asynchronous exception from the main
    thread); the worker, its other threads and the jobs after it carry on."""
    spins = [app.enqueue("spin", {"n": n}, max_attempts=1) for n in range(3)]
    ios = [app.enqueue("io", {"n": 10 + n, "sleep": 0.01}) for n in range(20)]
    master = threads.start("--processes", "1", "--queues", "default:4", module=MODULE)
    worker = master.wait_child("fastjobs: worker 1 ")
    wait_for(
        lambda: (
            count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'running'") == 0
            and count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'available'") == 0
        ),
        "every job to end",
    )
    for job_id in spins:
        state, attempt, error = job_state(db, job_id)
        assert (state, attempt) == ("discarded", 1), (state, attempt, error)
        assert error == "JobTimeout: job ran longer than its timeout of 0.5s"
    assert not count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = ANY(%s)", ios)  # completed
    # Spins ran at once, on threads of their own, and the worker never restarted.
    rows = spans(db, "n < 10")
    assert max(row[5] for row in rows) >= 2, rows
    assert master.titled("fastjobs: worker 1 ") == [worker]
    assert master.stop() == 0, master.stderr()


def test_cancelling_a_running_threaded_job_reaches_its_thread_alone(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    ids = [app.enqueue("until_cancelled", {"n": n}) for n in range(3)]
    master = threads.start("--processes", "1", "--queues", "default:3", module=MODULE)
    wait_for(lambda: len(spans(db)) == 3, "the three jobs to run at once")
    first, *others = ids
    assert app.cancel(first) == "cancelling"
    # Its outcome is written with its batch's, once the others end too.
    wait_for(lambda: spans(db, "note = 'saw cancelled'"), "the first to see its cancellation")
    assert [job_state(db, job_id)[0] for job_id in ids] == ["running"] * 3
    assert [row[3] for row in spans(db, "note = 'saw cancelled'")] == [first]
    for job_id in others:
        app.cancel(job_id)
    wait_for(lambda: {job_state(db, job_id)[0] for job_id in ids} == {"cancelled"}, "all cancelled")
    assert sorted(row[3] for row in spans(db, "note = 'saw cancelled'")) == sorted(ids)
    assert master.stop() == 0, master.stderr()


def test_a_graceful_stop_lets_the_running_threaded_jobs_finish_and_gives_back_the_rest(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Quick jobs grow the batches; the stopper stops the master while its wave still holds slower
    jobs not started: none of those starts after the stop, none runs twice, none loses an attempt."""
    app.enqueue_many("io", ({"n": n, "sleep": 0.002} for n in range(300)))
    stopper = app.enqueue("stopper", {"n": 300})
    app.enqueue_many("io", ({"n": n, "sleep": 0.2} for n in range(301, 400)))
    master = threads.start("--processes", "1", "--queues", "default:4", "--grace", "20", module=MODULE)
    assert master.wait(30) == 0, master.stderr()
    assert "stopping now" not in master.stderr()
    [(signalled,)] = db.execute("SELECT at FROM spans WHERE note = 'signalled'").fetchall()
    late = db.execute("SELECT n FROM spans WHERE note IS NULL AND at > %s", (signalled,)).fetchall()
    assert late == []  # nothing started once the stop had arrived
    assert not count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = %s", stopper)  # it finished
    left = db.execute("SELECT state::text, attempt, count(*) FROM fastjobs_jobs_all GROUP BY 1, 2").fetchall()
    assert [row for row in left if row[:2] != ("available", 0)] == [], left
    assert left and left[0][2] >= 10  # jobs were given back (the stopper's wave and the claim ahead)

    again = threads.start("--processes", "1", "--queues", "default:4", module=MODULE)
    wait_for(lambda: not count(db, "SELECT count(*) FROM fastjobs_jobs_all"), "the rest to drain")
    assert again.stop() == 0, again.stderr()
    rows = spans(db)
    assert Counter(n for n, *_ in rows) == Counter(range(400))
    assert {attempt for *_, attempt, _ in rows} == {1}


def test_a_worker_killed_mid_wave_counts_an_attempt_for_exactly_its_running_jobs(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    ids = {app.enqueue("io", {"n": n, "sleep": 60}): n for n in range(12)}
    master = threads.start("--processes", "1", "--queues", "default:4", "--grace", "1", module=MODULE)
    victim = master.wait_child("fastjobs: worker 1 ")
    wait_for(lambda: len(spans(db)) == 4, "a wave of four to start")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not procs.alive(victim), "the worker to die")
    started = {job_id for _, pid, _, job_id, *_ in spans(db) if pid == victim}
    assert len(started) == 4

    def running_by_victim() -> set[int]:
        rows = db.execute(
            "SELECT id FROM fastjobs_jobs_all"
            " WHERE state = 'running' AND split_part(attempted_by, ':', 2) = %s",
            (str(victim),),
        ).fetchall()
        return {row[0] for row in rows}

    # Well below the rescuer's 15 s: the master gave back the rest, the running four wait for it.
    wait_for(lambda: running_by_victim() == started, "only the running jobs to be left to the rescuer", 5)
    for job_id in set(ids) - started:
        state, attempt, _ = job_state(db, job_id)
        assert (state, attempt) in (("available", 0), ("running", 1)), (state, attempt)  # back, or the heir's
    assert master.stop(10) == 0, master.stderr()


def test_systemexit_in_a_threaded_handler_stops_the_worker_as_on_its_main_thread(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """The job that raised it and the others running fail with it (their attempt counted), the
    jobs not started go back uncounted, and the worker is replaced."""
    running = [app.enqueue("io", {"n": n, "sleep": 60}, max_attempts=1) for n in range(2)]
    exits = app.enqueue("exits", {"n": 2}, max_attempts=1)
    rest = [app.enqueue("io", {"n": n, "sleep": 0.01}) for n in range(3, 9)]
    master = threads.start("--processes", "1", "--queues", "default:3", module=MODULE)
    victim = master.wait_child("fastjobs: worker 1 ")
    wait_for(
        lambda: not count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = ANY(%s)", rest),
        "the rest to run, on the heir",
    )
    for job_id in [*running, exits]:
        state, attempt, error = job_state(db, job_id)
        assert (state, attempt, error) == ("discarded", 1, "SystemExit: 3"), (job_id, state, attempt, error)
    rows = spans(db)
    assert sorted(n for n, pid, *_ in rows if pid == victim) == [0, 1, 2]
    assert sorted(n for n, pid, *_ in rows if pid != victim) == list(range(3, 9))
    assert {attempt for *_, attempt, _ in rows} == {1}
    assert master.stop() == 0, master.stderr()


STANDALONE = f"""
import fastjobs
from {MODULE} import app

worker = fastjobs.Worker(app, config=fastjobs.WorkerConfig(threads={{"default": 3}}))
worker.install_signals()
worker.run()
"""


def test_a_standalone_worker_stopped_now_fails_its_running_threaded_jobs_and_gives_back_the_rest(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """The second signal (KeyboardInterrupt in the main thread, waiting on the wave) records the
    three running jobs as failed by it and gives back those claimed but not started."""
    ids = [app.enqueue("io", {"n": n, "sleep": 60}) for n in range(6)]
    (threads.cwd / "standalone.py").write_text(STANDALONE)
    env = dict(os.environ, FASTJOBS_DSN=app.dsn, FJ_TEST_RUNS_DSN=app.dsn)
    with (threads.cwd / "standalone.stderr").open("wb") as err:
        proc = subprocess.Popen([sys.executable, "standalone.py"], cwd=threads.cwd, env=env, stderr=err)
    try:
        wait_for(lambda: len(spans(db)) == 3, "a wave of three to start")
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):  # the first signal waits for the running jobs
            proc.wait(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    started = {job_id for *_, job_id, _, _ in spans(db)}
    for job_id in ids:
        state, attempt, error = job_state(db, job_id)
        if job_id in started:
            assert state in ("available", "retryable") and attempt == 1, (state, attempt)
            assert error is not None and error.startswith("KeyboardInterrupt"), error
        else:
            assert (state, attempt, error) == ("available", 0, None)


def test_a_threaded_job_blocked_in_c_past_its_timeout_gets_its_worker_replaced(
    threads: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """JobTimeout cannot reach a thread blocked in one C call: past as long again the worker
    stops beating, its master replaces it, and the job goes back with a crash counted, instead
    of the worker and its jobs staying `running` for ever."""
    app.enqueue("blocked", {"n": 1})
    master = threads.start(
        "--processes",
        "1",
        "--queues",
        "default:2",
        "--worker-timeout",
        "2",
        "--rescue-after",
        "5",
        "--grace",
        "1",
        module=MODULE,
    )
    first = master.wait_child("fastjobs: worker 1 ")
    wait_for(lambda: spans(db), "the job to start")
    master.wait_child("fastjobs: worker 1 ", exclude=(first,))  # the hung one replaced
    wait_for(lambda: len(spans(db)) >= 2, "the job to run again, on the new worker")
    assert {row[1] for row in spans(db)} != {first}
    assert "ran past its timeout of 0.5s blocked in a C call" in master.stderr()
    assert master.stop() == 0, master.stderr()


def test_a_timeout_sent_as_a_threaded_handler_returns_leaves_its_job_completed(
    app: App, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog can send JobTimeout to a pool thread whose handler has just returned, before the
    thread takes the job off the running list: the handler returned, so its job completed. (The
    thread is held in that window until the timeout is sent: a race otherwise won rarely.)"""

    @app.job(kind="quick", timeout=0.3, max_attempts=1)
    def quick() -> None:
        pass

    ended = pool.Pool._ended
    held: set[int] = set()

    def ended_late(self: pool.Pool, wave: pool.Wave, ident: int, job_id: int) -> None:
        if job_id not in held:
            held.add(job_id)
            deadline = time.monotonic() + 5.0
            while ident not in wave.fired and time.monotonic() < deadline:
                time.sleep(0.01)
        ended(self, wave, ident, job_id)

    monkeypatch.setattr(pool.Pool, "_ended", ended_late)
    app.enqueue("quick")
    worker = drain(app, threads={"default": 2})
    assert held  # the handler ran on the pool
    assert by_state(dsn) == {}
    assert worker.loop is not None and worker.loop.completed == 1
