"""The fast lane: short sync jobs claimed by row lock in a transaction held over their batch.

One write per job: a completed job is deleted, another outcome updates its
row once, and a job in flight keeps its row 'available' (what jobs list, stats and
the testing kit report is 'running': its row is locked). Jobs that may not hold a
transaction open (async, timeout=, threads, slower than the pace) take the
state lane; a worker that dies rolls back and its master counts the crash.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import fastjobs
from fastjobs import App, Retry, Snooze, control, guard, report
from fastjobs.abc import BATCH_SECONDS, DEEP_CLAIM
from fastjobs.executor import Executor
from fastjobs.impl import core
from fastjobs.worker import Worker, WorkerConfig

from . import procs
from .helpers import batch_loop, by_state, query, warm


@pytest.fixture(autouse=True)
def _warm_kind(app: App) -> None:
    app.job(kind="warm")(lambda: None)


def _outcome_rows(dsn: str) -> list[tuple[Any, ...]]:
    rows = query(
        dsn,
        "SELECT args->>'n' AS n, state::text AS state, attempt, crashes, jsonb_array_length(errors) AS errors"
        " FROM fastjobs_jobs_all ORDER BY (args->>'n')::int",
    )
    return [tuple(r.values()) for r in rows]


def _register_outcomes(app: App) -> None:
    snoozed: set[int] = set()

    @app.job(kind="mixed", max_attempts=2)
    def mixed(n: int) -> None:
        if n % 5 == 1:
            raise RuntimeError("failed")
        if n % 5 == 2:
            raise Retry(3600)
        if n % 5 == 3 and n not in snoozed:
            snoozed.add(n)
            raise Snooze(0)
        if n % 5 == 4:
            raise fastjobs.Cancel("no")


@pytest.mark.parametrize("lane", ["fast", "state"])
def test_outcomes_are_recorded_as_on_the_state_lane(app: App, dsn: str, lane: str) -> None:
    """Completions, failures (retried, then discarded at the last attempt), Retry, Snooze and Cancel
    leave the same rows on both lanes; the fast lane writes every outcome itself."""
    _register_outcomes(app)
    with batch_loop(app, 100, fast_lane=lane == "fast") as loop:
        warm(app, loop)
        app.enqueue_many("mixed", ({"n": n} for n in range(20)))
        query(dsn, "UPDATE fastjobs_jobs_all SET attempt = 1 WHERE (args->>'n')::int = 6")  # its last attempt
        while loop.step():
            pass
        loop.finish()
        assert loop.fast == (24 if lane == "fast" else 0)  # 20 jobs, the 4 snoozed twice
        assert (loop.completed, loop.retried, loop.discarded) == (9, 7, 1)  # the warm-up job too
    assert _outcome_rows(dsn) == [
        ("1", "retryable", 1, 0, 1),
        ("2", "retryable", 1, 0, 1),
        ("4", "cancelled", 1, 0, 1),
        ("6", "discarded", 2, 0, 1),
        ("7", "retryable", 1, 0, 1),
        ("9", "cancelled", 1, 0, 1),
        ("11", "retryable", 1, 0, 1),
        ("12", "retryable", 1, 0, 1),
        ("14", "cancelled", 1, 0, 1),
        ("16", "retryable", 1, 0, 1),
        ("17", "retryable", 1, 0, 1),
        ("19", "cancelled", 1, 0, 1),
    ]


def test_a_job_in_flight_is_locked_and_never_running(app: App, dsn: str) -> None:
    """While its handler runs, the job's row reads 'available', uncounted, and is locked."""
    seen: list[Any] = []

    @app.job(kind="look")
    def look(n: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            seen.append(other.execute("SELECT state::text, attempt FROM fastjobs_jobs_all").fetchone())
            locked = other.execute("SELECT id FROM fastjobs_jobs_all FOR UPDATE SKIP LOCKED").fetchall()
            seen.append(locked)

    with batch_loop(app, 10, fast_lane=True) as loop:
        warm(app, loop)
        look.enqueue(n=1)
        assert loop.step() == 1
        assert loop.fast == 1
    assert seen == [("available", 0), []]
    assert by_state(dsn) == {}


def _states(conn: psycopg.Connection[Any], **filters: Any) -> dict[int, str]:
    """What `fastjobs jobs list` reports, by job id."""
    return {row["id"]: row["state"] for row in control.list_jobs(conn, **filters)}


def _depths(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, float | None]]:
    """What `fastjobs stats` and the metrics report for the default queue, by state."""
    return {d.state: (d.count, d.oldest_seconds) for d in report.queue_depths(conn) if d.queue == "default"}


def test_a_job_in_flight_reads_running_in_jobs_list_and_stats(app: App, dsn: str) -> None:
    """Its row stays 'available' (locked by the batch's transaction), but every read for people
    and metrics says 'running', since about now; once its batch commits it is gone."""
    started, release = threading.Event(), threading.Event()

    @app.job(kind="hold")
    def hold(n: int) -> None:
        started.set()
        release.wait(60)

    # Every claim from the front: the jobs below are moved behind the warm-up's mark.
    with batch_loop(app, 1, fast_lane=True, front_claim_duty=1.0) as loop:
        warm(app, loop)
        held = hold.enqueue(n=1)
        waiting = hold.enqueue(n=2)  # a batch of one: it waits, available
        query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 hour'")
        ran: list[int] = []
        runner = threading.Thread(target=lambda: ran.append(loop.step()))
        suspended = guard.suspended()  # the batch stays open past its deadline (no hand-over)
        suspended.__enter__()
        runner.start()
        try:
            assert started.wait(30)
            with psycopg.connect(dsn, autocommit=True) as conn:
                # The row as written: the fast lane's, available and uncounted.
                assert query(
                    dsn, "SELECT state::text AS state, attempt FROM fastjobs_jobs_all WHERE id = %s", (held,)
                ) == [{"state": "available", "attempt": 0}]
                assert _states(conn) == {held: "running", waiting: "available"}
                assert _states(conn, state="running") == {held: "running"}
                assert _states(conn, state="available") == {waiting: "available"}
                assert control.show(conn, held)["state"] == "running"
                depths = _depths(conn)
                assert {s: count for s, (count, _) in depths.items()} == {"available": 1, "running": 1}
                available_age, running_age = depths["available"][1], depths["running"][1]
                assert available_age is not None and available_age > 3000  # due an hour ago
                assert running_age is not None and running_age < 60  # its batch began moments ago
            listed = procs.cli(dsn, "jobs", "list", "--state", "running", "--json")
            assert listed.returncode == 0, listed.stderr
            assert [(row["id"], row["state"]) for row in json.loads(listed.stdout)] == [(held, "running")]
            human = procs.cli(dsn, "stats")
            assert human.returncode == 0, human.stderr
            assert re.search(r"default\s+running\s+1\s", human.stdout), human.stdout
        finally:
            release.set()
            runner.join(30)
            suspended.__exit__(None, None, None)
        assert ran == [1] and loop.fast == 1
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert _states(conn) == {waiting: "available"}
            assert _states(conn, state="running") == {}
            assert _depths(conn).keys() == {"available"}
            with pytest.raises(fastjobs.errors.JobNotFound):
                control.show(conn, held)
        loop.finish()


def test_a_job_row_another_transaction_locks_reads_running_while_it_holds_it(app: App, dsn: str) -> None:
    """Nothing tells a lock of the user's (SELECT ... FOR UPDATE in a transaction of theirs) from a
    fast batch's, so its job reads 'running' too. Rightly so: no worker can claim it meanwhile
    (both lanes skip locked rows), so it is not waiting for one; once the lock goes it is available
    and runs."""
    ran: list[int] = []

    @app.job(kind="plain")
    def plain(n: int) -> None:
        ran.append(n)

    with batch_loop(app, 10, fast_lane=True) as loop:
        warm(app, loop)
        job_id = plain.enqueue(n=1)
        with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
            holder.execute("SELECT id FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (job_id,))
            assert _states(conn, kind="plain") == {job_id: "running"}
            assert _states(conn, state="available") == {}
            assert loop.step() == 0 and ran == []  # (it wrote the warm-up job's outcome)
            assert {state: count for state, (count, _) in _depths(conn).items()} == {"running": 1}
            holder.rollback()
            assert _states(conn) == {job_id: "available"}
            assert {state: count for state, (count, _) in _depths(conn).items()} == {"available": 1}
        assert loop.step() == 1 and ran == [1]
        loop.finish()
    assert by_state(dsn) == {}


def test_a_slow_job_ends_its_batch_and_sends_its_queue_to_the_state_lane(app: App, dsn: str) -> None:
    """A job believed fast that runs past its batch's deadline (BATCH_SECONDS): while it runs, its
    job becomes a running state-lane job, the batch commits what ran and leaves the rest untouched
    (available, uncounted); its outcome is written by the state lane, which the queue's next
    batches take."""
    states: list[str] = []

    @app.job(kind="sleepy")
    def sleepy(n: int, sleep: float) -> None:
        if sleep:
            time.sleep(sleep)
        with psycopg.connect(dsn, autocommit=True) as other:
            row = other.execute("SELECT state::text FROM fastjobs_jobs_all WHERE args->>'n' = %s", (str(n),))
            states.append(row.fetchone()[0])  # type: ignore[index]

    with batch_loop(app, 6, fast_lane=True) as loop:
        warm(app, loop)
        sleepy.enqueue_many({"n": n, "sleep": 3 * BATCH_SECONDS if n == 1 else 0} for n in range(6))
        began = time.monotonic()
        assert loop.step() == 6
        assert time.monotonic() - began < 6 * BATCH_SECONDS
        # Job 0 committed by the hand-over; job 1 read its own row: handed over while it slept.
        assert loop.fast == 1 and states == ["available", "running"]
        assert query(
            dsn,
            "SELECT state::text, attempt, attempted_by, count(*) FROM fastjobs_jobs_all GROUP BY 1, 2, 3"
            " ORDER BY 1",
        ) == [
            {"state": "available", "attempt": 0, "attempted_by": None, "count": 4},
            # Job 1: its outcome is held for the state lane's next statement.
            {"state": "running", "attempt": 1, "attempted_by": "test-worker", "count": 1},
        ]
        assert loop.step() == 4
        loop.finish()
    assert loop.fast == 1 and states == ["available", "running"] + ["running"] * 4
    assert by_state(dsn) == {}


def test_jobs_a_slow_batch_gave_back_are_claimed_next_though_behind_its_mark(app: App, dsn: str) -> None:
    """The batch's claim set the queue's mark at its latest job; those it gave back lie behind
    it. The demoted queue's next claim is from the front, not after that mark (where they would
    wait for a claim from the front, seconds away when the index is full of dead entries)."""
    ran: list[int] = []

    @app.job(kind="sleepy")
    def sleepy(n: int) -> None:
        ran.append(n)
        if n == 0:
            time.sleep(3 * BATCH_SECONDS)

    # Claims from the front only when there is no mark: every other claim is after it.
    with batch_loop(app, 6, fast_lane=True, front_claim_duty=1e-9) as loop:
        warm = app.enqueue("warm")
        query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 hour' WHERE id = %s", (warm,))
        assert loop.step() == 1 and loop.fast == 0  # the mark: an hour ago
        ids = [sleepy.enqueue(n=n) for n in range(3)]
        for job_id, seconds in zip(ids, (10, 5, 1), strict=True):
            query(
                dsn,
                "UPDATE fastjobs_jobs_all SET run_at = now() - make_interval(secs => %s) WHERE id = %s",
                (seconds, job_id),
            )
        # The mark: a second ago. Job 0 ran past the batch's deadline: handed over to the state lane.
        assert loop.step() == 3 and ran == [0] and loop.fast == 0
        assert loop.step() == 2 and ran == [0, 1, 2]  # the one 5 s back too
        loop.finish()
    assert by_state(dsn) == {}


@pytest.mark.parametrize("kind", ["async", "timeout", "threads"])
def test_jobs_that_may_not_hold_a_transaction_take_the_state_lane(app: App, dsn: str, kind: str) -> None:
    seen: list[str] = []

    def state() -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            seen.append(other.execute("SELECT state::text FROM fastjobs_jobs_all").fetchone()[0])  # type: ignore[index]

    if kind == "async":

        @app.job(kind="j")
        async def j_async(n: int) -> None:
            state()

    elif kind == "timeout":

        @app.job(kind="j", timeout=10)
        def j_timeout(n: int) -> None:
            state()

    else:

        @app.job(kind="j")
        def j_threads(n: int) -> None:
            state()

    app.enqueue("j", {"n": 1})
    threads = {"default": 2} if kind == "threads" else {}
    worker = Worker(app, config=WorkerConfig(threads=threads), exit_when_empty=True)
    worker.run()
    assert seen == ["running"]
    assert worker.loop is not None and worker.loop.fast == 0


def test_a_kind_of_another_queue_found_in_a_fast_batch_goes_back_to_the_state_lane(
    app: App, dsn: str
) -> None:
    """An async job enqueued into a queue whose own kinds are fast is given back untouched, and
    the queue takes the state lane, which runs it."""
    ran: list[str] = []

    @app.job(kind="quick")
    def quick(n: int) -> None:
        ran.append("quick")

    @app.job(kind="later", queue="other")
    async def later(n: int) -> None:
        ran.append("later")

    with batch_loop(app, 10, fast_lane=True, queues=["default"]) as loop:
        warm(app, loop)
        quick.enqueue(n=1)
        app.enqueue("later", {"n": 2}, queue="default")
        quick.enqueue(n=3)
        assert loop.step() == 3
        assert loop.fast == 2 and ran == ["quick", "quick"]
        assert loop.step() == 1
        loop.finish()
    assert sorted(ran) == ["later", "quick", "quick"]
    assert by_state(dsn) == {}


def test_a_stop_mid_batch_commits_what_ran_and_leaves_the_rest(app: App, dsn: str) -> None:
    loop_box: list[Any] = []

    @app.job(kind="stopper")
    def stopper(n: int) -> None:
        if n == 2:
            loop_box[0].stopping = True

    with batch_loop(app, 6, fast_lane=True) as loop:
        warm(app, loop)
        stopper.enqueue_many({"n": n} for n in range(6))
        loop_box.append(loop)
        assert loop.step() == 6
        loop.finish()
        assert loop.fast == 3
    rows = query(
        dsn, "SELECT args->>'n' AS n, state::text AS state, attempt FROM fastjobs_jobs_all ORDER BY id"
    )
    assert rows == [{"n": str(n), "state": "available", "attempt": 0} for n in range(3, 6)]


def test_a_cancel_waits_for_the_batch_and_is_not_lost(app: App, dsn: str) -> None:
    """A cancel of a job in a fast batch waits for the batch's commit (no deadlock); a job the batch
    gave back unstarted is then cancelled, and one it completed is gone."""
    results: dict[int, Any] = {}
    loop_box: list[Any] = []
    ids: list[int] = []

    def cancel(job_id: int) -> None:
        try:
            results[job_id] = app.cancel(job_id)
        except fastjobs.errors.JobNotFound:
            results[job_id] = "gone"

    threads: list[threading.Thread] = []
    blocked: list[dict[int, Any]] = []

    @app.job(kind="c")
    def c(n: int) -> None:
        if n == 0:
            for job_id in ids[1:]:
                threads.append(threading.Thread(target=cancel, args=(job_id,)))
                threads[-1].start()
            time.sleep(BATCH_SECONDS / 2)  # the cancels are blocked on the batch's locks meanwhile
            blocked.append(dict(results))
        if n == 1:
            loop_box[0].stopping = True

    with batch_loop(app, 3, fast_lane=True) as loop:
        warm(app, loop)
        ids.extend(c.enqueue(n=n) for n in range(3))
        loop_box.append(loop)
        began = time.monotonic()
        assert loop.step() == 3
        loop.finish()
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - began < 5
    assert blocked == [{}]
    assert results == {ids[1]: "gone", ids[2]: "cancelled"}
    assert by_state(dsn) == {"cancelled": 1}


def test_a_queue_takes_the_fast_lane_only_after_a_quick_batch(app: App, dsn: str) -> None:
    """Its first batch takes the state lane; a slow one keeps it there (a long sync job polling
    current_job().cancelled can be told), a quick one moves it to the fast lane."""
    states: list[str] = []
    # Connected once: a connection per job took over half BATCH_SECONDS on a loaded machine,
    # and the quick batches were not quick.
    other = psycopg.connect(dsn, autocommit=True)

    @app.job(kind="probe")
    def probe(n: int, sleep: float) -> None:
        time.sleep(sleep)
        states.append(other.execute("SELECT state::text FROM fastjobs_jobs_all").fetchone()[0])  # type: ignore[index]

    with other, batch_loop(app, 1, fast_lane=True) as loop:
        for sleep in (BATCH_SECONDS, 0.0, 0.0, 0.0):
            probe.enqueue(n=1, sleep=sleep)
            assert loop.step() == 1
    assert states == ["running", "running", "available", "available"]
    assert loop.fast == 2


def test_a_queue_the_workers_keep_up_with_leaves_the_fast_lane_until_a_claim_comes_back_full(
    app: App, dsn: str
) -> None:
    """A fast claim that finds nothing (BEGIN, claim, COMMIT: three round trips) sends the queue to
    the state lane (one round trip a claim, the lower pickup latency) until a claim of it comes back
    full, which is a backlog again: the fast lane's one write a job is a gain there."""
    app.job(kind="quick")(lambda: None)
    with batch_loop(app, 4, fast_lane=True, overlap=False) as loop:
        warm(app, loop)
        app.enqueue_many("quick", ({} for _ in range(3)))
        assert loop.step() == 3 and loop.fast == 3  # short but not empty: the lane stays
        assert loop.step() == 0  # an empty fast claim
        app.enqueue_many("quick", ({} for _ in range(3)))
        assert loop.step() == 3 and loop.fast == 3  # the state lane: short claims keep it there
        app.enqueue_many("quick", ({} for _ in range(3)))
        assert loop.step() == 3 and loop.fast == 3
        app.enqueue_many("quick", ({} for _ in range(9)))
        assert loop.step() == 4 and loop.fast == 3  # a full claim, on the state lane...
        assert loop.step() == 4 and loop.fast == 7  # ...sends the next to the fast lane
        assert loop.step() == 1 and loop.fast == 8
    assert by_state(dsn) == {}


def test_a_full_claim_of_a_few_jobs_is_no_backlog(app: App, dsn: str) -> None:
    """At a shallow queue the size decays towards batch_min, and a claim of 2 that finds 2 is full
    with nothing behind it: only a full claim of DEEP_CLAIM jobs (or batch_max, when smaller) sends
    the queue back to the fast lane. Before, 40% of the jobs at 1,000 jobs/s took the fast lane."""
    app.job(kind="quick")(lambda: None)
    with batch_loop(app, 100, fast_lane=True, overlap=False) as loop:
        loop.batch_min = 1
        warm(app, loop)
        assert loop.step() == 0  # an empty fast claim: the state lane
        while loop.size > 1:
            assert loop.step() == 0  # each halves the size
        sizes = []
        while loop.size < DEEP_CLAIM:
            sizes.append(loop.size)
            app.enqueue_many("quick", ({} for _ in range(loop.size)))
            assert loop.step() == sizes[-1] and loop.fast == 0  # full, of fewer than DEEP_CLAIM
        assert sizes == [1, 2, 4, 8]
        app.enqueue_many("quick", ({} for _ in range(DEEP_CLAIM + 3)))
        assert loop.step() == DEEP_CLAIM and loop.fast == 0  # full of DEEP_CLAIM, on the state lane...
        assert loop.step() == 3 and loop.fast == 3  # ...sends the next to the fast lane
    assert by_state(dsn) == {}


def test_an_outcome_postgresql_rejects_rolls_the_batch_back_to_the_state_lane(
    app: App, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's jobs run again (at least once) on the state lane, which isolates the bad outcome:
    nothing is lost, the others complete, the bad job gets fastjobs's own failure record."""
    monkeypatch.setattr(fastjobs.outcomes, "clean", lambda text: text)
    runs: dict[int, int] = {}

    @app.job(kind="nul")
    def nul(n: int) -> None:
        runs[n] = runs.get(n, 0) + 1
        if n == 2:
            raise ValueError("nul \x00 here")

    with batch_loop(app, 10, fast_lane=True) as loop:
        warm(app, loop)
        nul.enqueue_many({"n": n} for n in range(5))
        assert loop.step() == 5
        assert loop.fast == 0 and by_state(dsn) == {"available": 5}  # rolled back
        while loop.step():
            pass
        loop.finish()
    assert runs == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2}
    [row] = query(dsn, "SELECT args->>'n' AS n, state::text AS state, attempt FROM fastjobs_jobs_all")
    assert row == {"n": "2", "state": "retryable", "attempt": 1}


CRASHER = '''
"""A job that kills its worker on the fast lane."""

import os

from fjjobs import _record, app


@app.job("crash", queue="fastq", max_attempts=10)
def crash(n):
    _record(n)
    os._exit(1)


@app.job("mate", queue="fastq")
def mate(n):
    _record(n)
'''


def test_a_job_that_kills_its_worker_on_the_fast_lane_is_quarantined(
    masters: procs.Masters, tmp_path: Path, app: App, db: psycopg.Connection[Any]
) -> None:
    """Its batch rolls back (no attempt counted by the claim): the master counts each crash, and
    after max_crashes (3) the job is discarded; its batch-mates run once each. A replacement worker
    runs the state lane until the queue proves quick again, so a later crash can be the rescuer's to
    count: --rescue-after 5, not the default 15 s."""
    (tmp_path / "crashjobs.py").write_text(CRASHER)
    # (The queue of its own: fjjobs's default queue has async and timeout= kinds, the state lane's.)
    app.declare("mate", queue="fastq")
    app.declare("crash", queue="fastq")
    app.enqueue_many("mate", ({"n": n} for n in range(100, 110)), queue="fastq")
    crash = app.enqueue("crash", {"n": 0}, max_attempts=10, queue="fastq")
    app.enqueue_many("mate", ({"n": n} for n in range(110, 120)), queue="fastq")
    master = masters.start("--processes", "1", "--queues", "fastq", "--rescue-after", "5", module="crashjobs")
    try:
        procs.wait_for(
            lambda: procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'discarded'") == 1,
            "the crashing job to be quarantined",
            timeout=60,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stderr:\n{master.stderr()[:3000]}") from None
    state, attempt, crashes = db.execute(
        "SELECT state::text, attempt, crashes FROM fastjobs_jobs_all WHERE id = %s", (crash,)
    ).fetchone()  # type: ignore[misc]
    assert (state, crashes) == ("discarded", 3) and attempt == 3
    assert "on the fast lane: it counts a crash" in master.stderr()
    procs.wait_for(
        lambda: not procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE kind = 'record'"), "rest"
    )
    assert master.stop() == 0, master.stderr()


@pytest.mark.parametrize("outcome", ["snooze", "retry", "backoff"])
def test_a_delay_counts_from_when_the_job_raised_not_from_its_batch_start(
    app: App, dsn: str, outcome: str
) -> None:
    """Snooze(d), Retry(d) and the retry policy's delay of a job that ran a while in its fast batch
    make it due d after it raised: the batch's transaction began before the job ran."""
    raised: list[Any] = []
    # The database's clock, read by the raising job on a connection opened before the batch: opened
    # in the handler, under CI's load, it took the job past the batch's deadline (handed over, its
    # outcome the state lane's: loop.fast 1).
    other = psycopg.connect(dsn, autocommit=True)

    @app.job(kind="late", max_attempts=5, retry=lambda attempt, jitter: 2.0)
    def late(sleep: float) -> None:
        time.sleep(sleep)  # inside the batch's deadline: the outcome is the fast lane's to write
        if not sleep:
            raised.append(other.execute("SELECT clock_timestamp()").fetchone()[0])  # type: ignore[index]
            if outcome == "snooze":
                raise Snooze(2)
            if outcome == "retry":
                raise Retry(2)
            raise RuntimeError("failed")

    with other, batch_loop(app, 10, fast_lane=True) as loop:
        warm(app, loop)
        app.enqueue("late", {"sleep": BATCH_SECONDS / 4})
        app.enqueue("late", {"sleep": 0})
        assert loop.step() == 2
        assert loop.fast == 2
    (row,) = query(dsn, "SELECT run_at FROM fastjobs_jobs_all WHERE kind = 'late'")
    # Due 2 s after it raised (the statement runs a moment later), not 2 s after the BEGIN.
    assert row["run_at"] - raised[0] >= dt.timedelta(seconds=2)


# A TCP proxy to PostgreSQL in a process of its own (the C loop waits for some replies holding the
# GIL): it holds the server's replies from a "hold" line on its stdin ("held", it answers) until
# "release", and says "asked" once the client sent something while they were held.
PROXY = """
import socket, sys, threading
family, address = (socket.AF_UNIX, sys.argv[1]) if sys.argv[1].startswith("/") else (
    socket.AF_INET, (sys.argv[1], int(sys.argv[2])))
held, released, asked = threading.Event(), threading.Event(), threading.Event()
def pump(source, sink, replies):
    try:
        while data := source.recv(65536):
            if held.is_set() and replies:
                released.wait(10)
            elif held.is_set() and not asked.is_set():
                asked.set()
                print("asked", flush=True)
            sink.sendall(data)
    except OSError:
        pass
def accept(listener):
    while True:
        client, _ = listener.accept()
        server = socket.socket(family, socket.SOCK_STREAM)
        server.connect(address)
        threading.Thread(target=pump, args=(client, server, False), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, True), daemon=True).start()
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
threading.Thread(target=accept, args=(listener,), daemon=True).start()
for line in sys.stdin:
    if line.strip() == "hold":
        held.set()
        print("held", flush=True)
    else:
        released.set()
        held.clear()
"""


class _StopNow(BaseException):
    """What a worker's stop-now signal raises (a KeyboardInterrupt), from its signal handler."""


def test_a_stop_now_signal_during_the_fast_commit_keeps_the_batch(app: App, dsn: str) -> None:
    """A stop-now signal lands while the fast batch's outcomes are in flight: its handler runs once
    that transaction has ended (committed), so finish() finds nothing half-done and the batch's
    jobs do not run again (finish() read the statement's reply as a claim, and the batch rolled
    back)."""

    @app.job(kind="last")
    def last() -> None:
        assert proxy.stdin is not None
        proxy.stdin.write("hold\n")  # the batch's statement and COMMIT wait for their replies from now on
        proxy.stdin.flush()
        assert held.wait(10)

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    host, port = str(params.get("host") or "/tmp"), str(params.get("port") or 5432)
    upstream = [f"{host}/.s.PGSQL.{port}"] if host.startswith("/") else [host, port]
    proxy = subprocess.Popen(
        [sys.executable, "-c", PROXY, *upstream], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proxy.stdin is not None and proxy.stdout is not None
    params.update(host="127.0.0.1", port=proxy.stdout.readline().strip())
    main = threading.get_ident()

    held = threading.Event()

    def stop_now() -> None:
        assert proxy.stdout is not None
        for line in proxy.stdout:
            if line.strip() == "held":
                held.set()
            elif line.strip() == "asked":
                signal.pthread_kill(main, signal.SIGUSR1)
                time.sleep(0.3)  # the signal is in: now the replies come
                assert proxy.stdin is not None
                proxy.stdin.write("release\n")
                proxy.stdin.flush()
                return

    def raise_stop(signum: int, frame: object) -> None:
        raise _StopNow

    stopper = threading.Thread(target=stop_now, daemon=True)
    previous = signal.signal(signal.SIGUSR1, raise_stop)
    conn = psycopg.connect(psycopg.conninfo.make_conninfo("", **params), autocommit=True)
    executor = Executor(100)
    try:
        loop = core.BatchLoop(conn, dict(app.jobs), executor, "test-worker", ["default"], fast_lane=True)
        loop.prepare()
        warm(app, loop)
        app.enqueue("last")
        stopper.start()
        with pytest.raises(_StopNow):
            loop.step()
        assert loop.fast == 1  # the batch's end was read before the signal's handler ran
        loop.finish()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        executor.close()
        conn.close()
        proxy.kill()
        proxy.wait()
        if stopper.is_alive():
            stopper.join(5)
        proxy.stdin.close()
        proxy.stdout.close()
    assert by_state(dsn) == {}  # completed, not rolled back to run again
