"""Both hot loops in one run: the same scripted batches must leave the same rows and counters.

`_core_py` is the reference and `_core.pyx` its C twin. The rest of the suite
runs the one FASTJOBS_IMPL chooses; this module runs both, each on a database
of its own, and compares what they leave, so that drift between them fails CI.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from fastjobs import App, Cancel, Retry, Snooze, _core_py, current_job, planner
from fastjobs.abc import BUCKETS, OUTCOMES, PICKUP, ROW, RUN, BatchLoop, Core
from fastjobs.errors import FastjobsError, LoopError
from fastjobs.executor import Executor
from fastjobs.scoreboard import Labels
from fastjobs.testing import databases

from .helpers import query, wait_for

# The suite installs psycopg[c] and builds the extension: both twins are always there.
assert psycopg.pq.__impl__ != "binary", "the C loop needs psycopg to use the system libpq (psycopg[c])"
from fastjobs import _core  # noqa: E402 (after the check that says why it could not load)

TWINS: list[Core] = [_core_py, _core]
WORKER = "twin-worker"
COUNTERS = ("claimed", "completed", "failed", "retried", "discarded", "stale")


@dataclass(frozen=True)
class Job:
    kind: str
    args: str = "{}"  # the args column, as JSON text
    attempt: int = 0  # attempts made before the batch claims it
    max_attempts: int = 25
    cancelled: bool = False  # its cancellation arrives before the batch starts it


@dataclass(frozen=True)
class Batch:
    name: str
    jobs: list[Job]
    keep_completed: bool = False
    overlap: bool = False


def _register(app: App, dsn: str, executor: Executor) -> None:
    """One handler per way a job can end; `executor.cancel` is what the worker's control thread calls."""

    def own_id() -> int:
        job = current_job()
        assert job is not None
        return job.id

    def raiser(exc: BaseException) -> Any:
        def handler() -> None:
            raise exc

        return handler

    for kind, exc in [
        ("boom", ValueError("boom")),
        ("retry", Retry(30)),
        ("retry_now", Retry(0)),
        ("snooze", Snooze(60)),
        ("snooze_now", Snooze(0)),
        ("cancel", Cancel("not wanted")),
        ("exit", SystemExit(3)),
    ]:
        app.job(kind)(raiser(exc))

    @app.job("ok")
    def ok() -> None: ...

    @app.job("value")
    def value() -> dict[str, int]:
        return {"a": 1}

    @app.job("cancelled_running")
    def cancelled_running() -> None:
        executor.cancel(own_id())

    @app.job("cancelled_raising")
    def cancelled_raising() -> None:
        executor.cancel(own_id())
        raise ValueError("raised after its cancellation")

    @app.job("coroutine")
    def coroutine() -> Any:
        return asyncio.sleep(0)

    @app.job("stale")
    def stale() -> None:
        # Taken from this worker while it runs (as the rescuer would): its outcome is dropped.
        query(dsn, "UPDATE fastjobs_jobs_all SET attempted_by = 'another-worker' WHERE id = %s", (own_id(),))

    @app.job("slow_ok", timeout=30)
    def slow_ok() -> None: ...

    @app.job("slow_boom", timeout=30)
    def slow_boom() -> None:
        raise ValueError("slow boom")

    @app.job("slow_timeout", timeout=0.05)
    def slow_timeout() -> None:
        threading.Event().wait(30)

    @app.job("slow_coroutine", timeout=30)
    def slow_coroutine() -> Any:
        return asyncio.sleep(0)

    @app.job("slow_cancelled", timeout=30)
    def slow_cancelled() -> None:
        executor.cancel(own_id())

    @app.job("async_ok")
    async def async_ok() -> None: ...

    @app.job("async_boom")
    async def async_boom() -> None:
        raise ValueError("async boom")

    @app.job("async_retry")
    async def async_retry() -> None:
        raise Retry(30)

    @app.job("async_timeout", timeout=0.05)
    async def async_timeout() -> None:
        await asyncio.sleep(30)

    @app.job("async_cancelled")
    async def async_cancelled() -> None:
        executor.cancel(own_id())
        await asyncio.sleep(30)


KINDS = [
    "ok",
    "value",
    "boom",
    "retry",
    "retry_now",
    "snooze",
    "snooze_now",
    "cancel",
    "cancelled_running",
    "cancelled_raising",
    "coroutine",
    "stale",
    "slow_ok",
    "slow_boom",
    "slow_timeout",
    "slow_coroutine",
    "slow_cancelled",
    "async_ok",
    "async_boom",
    "async_retry",
    "async_timeout",
    "async_cancelled",
]
# No handler; args jsonb holds but orjson cannot decode; args that are no object; cancelled before it starts.
ODD = [Job("nobody"), Job("ok", '{"n": 1e400}'), Job("ok", "[1, 2]"), Job("ok", cancelled=True)]
ODD += [Job("slow_ok", cancelled=True)]
FAILING = ["boom", "retry", "retry_now", "snooze", "coroutine", "slow_timeout", "async_boom", "async_timeout"]

BATCHES = [
    Batch("first attempts", [Job(kind) for kind in KINDS] + ODD, keep_completed=True),
    Batch("later attempts", [Job(j.kind, j.args, 2, cancelled=j.cancelled) for j in ODD], overlap=True),
    Batch("later attempts, kept", [Job(kind, attempt=2) for kind in KINDS], keep_completed=True),
    Batch("last attempts", [Job(kind, attempt=2, max_attempts=3) for kind in [*FAILING, "ok", "nobody"]]),
    Batch("stopped by SystemExit", [Job("slow_ok"), Job("ok"), Job("exit"), Job("ok")]),
]


def _insert(dsn: str, queue: str, job: Job) -> int:
    rows = query(
        dsn,
        "INSERT INTO fastjobs_jobs (queue, kind, args, attempt, max_attempts)"
        " VALUES (%s, %s, %s::jsonb, %s, %s) RETURNING id",
        (queue, job.kind, job.args, job.attempt, job.max_attempts),
    )
    return int(rows[0]["id"])


def _rows(dsn: str, ids: list[int]) -> list[Any]:
    """Each job's row as the twins must agree on it: None once deleted; errors without time or traceback."""
    found = {
        row["id"]: row
        for row in query(
            dsn,
            """SELECT id, state::text, attempt, errors, attempted_by,
                      greatest(0, floor(extract(epoch FROM run_at - attempted_at)))::int AS delay
                 FROM fastjobs_jobs_all WHERE id = ANY(%s)""",
            (ids,),
        )
    }
    rows: list[Any] = []
    for job_id in ids:
        row = found.get(job_id)
        if row is None:
            rows.append(None)
            continue
        errors = [(e["attempt"], e["error"], e["traceback"] is not None) for e in row["errors"] or []]
        rows.append((row["state"], row["attempt"], row["delay"], row["attempted_by"], errors))
    return rows


def _counted(labels: Labels, counts: memoryview) -> dict[str, tuple[int, ...]]:
    """Per kind counted: its outcomes, its handler runs timed and its jobs picked up (times vary)."""
    cells = counts.tolist()
    n = len(BUCKETS) + 1
    return {
        kind: (
            *cells[at : at + len(OUTCOMES)],
            sum(cells[at + RUN : at + RUN + n]),
            sum(cells[at + PICKUP : at + PICKUP + n]),
        )
        for at, _, kind in labels.names(0)
        if any(cells[at : at + ROW])
    }


def _script(core: Core, dsn: str) -> list[Any]:
    """Run every batch once with `core`'s BatchLoop: one step, then finish; what each left."""
    app = App(dsn)
    executor = Executor()
    executor.bind()
    _register(app, dsn, executor)
    seen = []
    try:
        for number, batch in enumerate(BATCHES):
            queue = f"batch{number}"
            ids = [_insert(dsn, queue, job) for job in batch.jobs]
            executor.cancelled.update(i for i, job in zip(ids, batch.jobs, strict=True) if job.cancelled)
            labels = Labels(list(app.jobs), [[queue]])
            counts = memoryview(bytearray(labels.rows * ROW * 8)).cast("q")
            with psycopg.connect(dsn, autocommit=True) as conn:
                size = len(batch.jobs)
                loop = core.BatchLoop(
                    conn,
                    dict(app.jobs),
                    executor,
                    WORKER,
                    [queue],
                    keep_completed=batch.keep_completed,
                    batch_min=size,
                    batch_max=size,
                    overlap=batch.overlap,
                    counts=counts,
                )
                loop.prepare()
                stopped = None
                try:
                    ran = loop.step()
                except SystemExit as exc:
                    ran, stopped = -1, exc.code
                loop.stopping = True
                loop.finish()
            counters = {name: getattr(loop, name) for name in COUNTERS}
            seen.append((batch.name, ran, stopped, counters, _rows(dsn, ids), _counted(labels, counts)))
    finally:
        executor.close()
        app.close()
    return seen


def test_the_twins_leave_the_same_rows_and_counters(twin_dsns: tuple[str, str], monkeypatch: Any) -> None:
    # No jitter in the backoff (attempt**4 seconds exactly), so delays compare exactly.
    monkeypatch.setattr(random, "random", lambda: 0.5)
    python = _script(_core_py, twin_dsns[0])
    c = _script(_core, twin_dsns[1])
    for ours, theirs in zip(python, c, strict=True):
        assert ours == theirs, ours[0]

    first, later, later_kept, last, stopped = python
    assert {kind: row and row[:3] for kind, row in zip(KINDS, first[4], strict=False)} == {
        "ok": ("completed", 1, 0),
        "value": ("completed", 1, 0),
        "boom": ("retryable", 1, 1),
        "retry": ("retryable", 1, 30),
        "retry_now": ("available", 1, 0),
        "snooze": ("scheduled", 0, 60),
        "snooze_now": ("available", 0, 0),
        "cancel": ("cancelled", 1, 0),
        "cancelled_running": ("cancelled", 1, 0),
        "cancelled_raising": ("cancelled", 1, 0),
        "coroutine": ("retryable", 1, 1),
        "stale": ("running", 1, 0),
        "slow_ok": ("completed", 1, 0),
        "slow_boom": ("retryable", 1, 1),
        "slow_timeout": ("retryable", 1, 1),
        "slow_coroutine": ("retryable", 1, 1),
        "slow_cancelled": ("cancelled", 1, 0),
        "async_ok": ("completed", 1, 0),
        "async_boom": ("retryable", 1, 1),
        "async_retry": ("retryable", 1, 30),
        "async_timeout": ("retryable", 1, 1),
        "async_cancelled": ("cancelled", 1, 0),
    }
    assert [row and row[:3] for row in first[4][len(KINDS) :]] == [
        ("retryable", 1, 1),  # no handler here: another deploy may have one
        ("discarded", 1, 0),  # args that do not decode
        ("discarded", 1, 0),  # args that are no object
        ("cancelled", 1, 0),
        ("cancelled", 1, 0),
    ]
    # Cancelled jobs count as failed attempts; the stale completion is taken back.
    counters = dict(claimed=27, completed=4, failed=20, retried=11, discarded=2, stale=1)
    assert first[1:4] == (27, None, counters)
    # Per kind (completed, retried, discarded, cancelled, snoozed, runs timed, picked up): slow
    # jobs are timed by the card's SlowJobs alone (none here); the stale completion stays counted.
    counted = first[5]
    assert counted["ok"] == (1, 0, 2, 1, 0, 1, 4)  # three odd jobs of kind ok: bad args twice, cancelled
    assert counted["boom"] == counted["retry"] == counted["retry_now"] == (0, 1, 0, 0, 0, 1, 1)
    assert counted["snooze"] == counted["snooze_now"] == (0, 0, 0, 0, 1, 1, 1)
    assert counted["cancel"] == counted["cancelled_running"] == (0, 0, 0, 1, 0, 1, 1)
    assert counted["slow_ok"] == (1, 0, 0, 1, 0, 0, 2)
    assert counted["async_timeout"] == (0, 1, 0, 0, 0, 0, 1)
    assert counted["(other)"] == (0, 1, 0, 0, 0, 0, 1)
    assert sum(sum(c[:5]) for c in counted.values()) == 27
    assert [row and row[:3] for row in later[4]] == [
        ("retryable", 3, 81),
        ("discarded", 3, 0),
        ("discarded", 3, 0),
        ("cancelled", 3, 0),
        ("cancelled", 3, 0),
    ]
    kept = zip(KINDS, later_kept[4], strict=True)
    assert {kind: row[:3] for kind, row in kept if row[0] != "completed"} == {
        "boom": ("retryable", 3, 81),
        "retry": ("retryable", 3, 30),
        "retry_now": ("available", 3, 0),
        "snooze": ("scheduled", 2, 60),
        "snooze_now": ("available", 2, 0),
        "cancel": ("cancelled", 3, 0),
        "cancelled_running": ("cancelled", 3, 0),
        "cancelled_raising": ("cancelled", 3, 0),
        "coroutine": ("retryable", 3, 81),
        "stale": ("running", 3, 0),
        "slow_boom": ("retryable", 3, 81),
        "slow_timeout": ("retryable", 3, 81),
        "slow_coroutine": ("retryable", 3, 81),
        "slow_cancelled": ("cancelled", 3, 0),
        "async_boom": ("retryable", 3, 81),
        "async_retry": ("retryable", 3, 30),
        "async_timeout": ("retryable", 3, 81),
        "async_cancelled": ("cancelled", 3, 0),
    }
    assert [row and row[:2] for row in last[4]] == [("discarded", 3)] * 2 + [
        ("discarded", 3),
        ("scheduled", 2),  # a snooze gives its attempt back: not the last one
        ("discarded", 3),
        ("discarded", 3),
        ("discarded", 3),
        ("discarded", 3),
        None,  # completed at its last attempt
        ("discarded", 3),
    ]
    # SystemExit: the job before it completed, it failed, the others (the slow one set aside
    # for after the fast ones, the one after it) went back uncounted.
    assert stopped[1:3] == (-1, 3)
    assert [row and row[:2] for row in stopped[4]] == [
        ("available", 0),
        None,
        ("retryable", 1),
        ("available", 0),
    ]


def _loop(core: Core, app: App, conn: psycopg.Connection[Any]) -> BatchLoop:
    loop = core.BatchLoop(conn, dict(app.jobs), Executor(), WORKER, ["default"], batch_min=1, batch_max=1)
    loop.prepare()
    return loop


def _terminate(dsn: str, pid: int) -> None:
    query(dsn, "SELECT pg_terminate_backend(%s)", (pid,))
    gone = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
    assert wait_for(lambda: not query(dsn, gone, (pid,)), timeout=5)


def _connection_lost_between_statements(core: Core, dsn: str) -> str:
    app = App(dsn)
    app.job("ok")(lambda: None)
    app.enqueue("ok")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            loop = _loop(core, app, conn)
            _terminate(dsn, conn.info.backend_pid)
            with pytest.raises(LoopError) as raised:
                loop.step()
            return str(raised.value)
    finally:
        app.close()


def _connection_lost_in_a_statement(core: Core, dsn: str) -> str:
    """The loop's backend is killed while its statement waits for a row lock another session holds."""
    app = App(dsn)
    app.job("ok")(lambda: None)
    job_id = app.enqueue("ok")
    errors: list[BaseException] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as locker:
            loop = _loop(core, app, conn)
            assert loop.step() == 1
            locker.execute("SELECT 1 FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (job_id,))

            def finish() -> None:
                try:
                    loop.finish()  # its completion waits for the lock
                except BaseException as exc:
                    errors.append(exc)

            writer = threading.Thread(target=finish)
            writer.start()
            waiting = "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
            pid = conn.info.backend_pid
            assert wait_for(lambda: bool(query(dsn, waiting, (pid,))), timeout=5)
            _terminate(dsn, pid)
            writer.join(5)
            assert not writer.is_alive()
    finally:
        app.close()
    [error] = errors
    assert isinstance(error, LoopError), repr(error)
    return str(error)


def _statement_failed(core: Core, dsn: str) -> str:
    """The loop's statement fails (lock timeout: no outcome's fault, so not isolated): LoopError."""
    app = App(dsn)
    app.job("ok")(lambda: None)
    job_id = app.enqueue("ok")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as locker:
            conn.execute("SET lock_timeout = '100ms'")
            loop = _loop(core, app, conn)
            assert loop.step() == 1
            locker.execute("SELECT 1 FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (job_id,))
            with pytest.raises(LoopError) as raised:
                loop.finish()
            return str(raised.value)
    finally:
        app.close()


def _both(scenario: Callable[[Core, str], str], twin_dsns: tuple[str, str]) -> tuple[str, str]:
    """The scenario's LoopError message with the Python loop, then with the C loop."""
    return scenario(_core_py, twin_dsns[0]), scenario(_core, twin_dsns[1])


def test_a_lost_connection_is_a_loop_error_with_libpq_s_message_on_both(twin_dsns: tuple[str, str]) -> None:
    python, c = _both(_connection_lost_between_statements, twin_dsns)
    assert python == c
    assert python.startswith("FATAL:  terminating connection due to administrator command\n")
    assert issubclass(LoopError, FastjobsError)


def test_a_connection_lost_in_a_statement_keeps_its_first_error_on_both(twin_dsns: tuple[str, str]) -> None:
    python, c = _both(_connection_lost_in_a_statement, twin_dsns)
    # The server's error first, then libpq's "server closed the connection": one message, in that order.
    first = "FATAL:  terminating connection due to administrator command"
    assert python.splitlines()[0] == c.splitlines()[0] == first
    assert "server closed the connection unexpectedly" in python
    assert python.splitlines()[-3:] == c.splitlines()[-3:]


def test_a_failed_statement_is_a_loop_error_with_postgres_message_on_both(twin_dsns: tuple[str, str]) -> None:
    python, c = _both(_statement_failed, twin_dsns)
    assert python.splitlines()[0] == c.splitlines()[0] == "ERROR:  canceling statement due to lock timeout"


def test_the_c_module_imports_no_python_twin() -> None:
    probe = "import sys, fastjobs._core; print(sorted(m for m in sys.modules if m.startswith('fastjobs._c')))"
    env = {**os.environ, "FASTJOBS_IMPL": "c"}  # the package itself imports the implementation it chooses
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "['fastjobs._core']"


@pytest.mark.parametrize("core", TWINS, ids=lambda core: core.IMPLEMENTATION)
def test_the_card_views_come_together_or_not_at_all(core: Core, app: App) -> None:
    """The hot loop writes the job it runs beside the count it bumps: half a card is refused."""
    progress: Any = memoryview(bytearray(8)).cast("d")
    refused = pytest.raises(ValueError, match="both or neither")
    with psycopg.connect(app.dsn, autocommit=True) as conn, refused:
        core.BatchLoop(conn, dict(app.jobs), Executor(), WORKER, ["default"], progress=progress)


# The per-batch policy, scripted over many batches: what each step claimed, on which lane, and
# the size it chose next, with the fast lane, full context and marks on. Claims after the mark
# are kept for FRONT_CLAIM_MAX_WAIT (front_claim_duty 1e-9), so which claims go from the front
# depends on the script, not on the clock. Each entry: ("a"|"b", kind, jobs, priority) enqueues,
# None steps once.
POLICY: list[tuple[str, str, int, int] | None] = [
    ("a", "quick", 1, 0),
    None,  # the first batch of a queue: the state lane proves it quick
    ("a", "quick", 3, 0),
    None,  # the fast lane
    None,  # an empty fast claim: the queue goes to the state lane
    *[("a", "quick", 2, 0), None] * 4,  # short claims, full or not: no backlog
    ("a", "quick", 40, 0),
    None,
    None,
    None,
    ("a", "quick", 5, 9),  # ahead of the mark: only a claim from the front finds them
    None,
    None,
    None,
    None,
    None,
    ("a", "boom", 3, 0),  # failures on the fast lane: written in its transaction
    ("a", "quick", 30, 0),
    None,
    None,
    ("b", "timed", 4, 0),  # a kind with timeout=: queue b never takes the fast lane
    ("b", "quick_b", 20, 0),
    *[None] * 10,  # the queues' turns, each with a size of its own
]


def _policy(core: Core, dsn: str) -> list[tuple[Any, ...]]:
    app = App(dsn)
    app.job("quick", queue="a")(lambda: None)
    app.job("quick_b", queue="b")(lambda: None)
    app.job("timed", queue="b", timeout=30)(lambda: None)

    @app.job("boom", queue="a", max_attempts=1)
    def boom() -> None:
        raise ValueError("boom")

    trace: list[tuple[Any, ...]] = []
    executor = Executor()
    with psycopg.connect(dsn, autocommit=True) as conn:
        loop = core.BatchLoop(
            conn,
            dict(app.jobs),
            executor,
            WORKER,
            ["a", "b"],
            batch_min=1,
            batch_max=24,
            overlap=False,
            front_claim_duty=1e-9,
            whole_context=True,
            fast_lane=True,
        )
        loop.prepare()
        try:
            for entry in POLICY:
                if entry is not None:
                    queue, kind, n, priority = entry
                    app.enqueue_many(kind, ({} for _ in range(n)), queue=queue, priority=priority)
                    continue
                fast = loop.fast
                ran = loop.step()
                trace.append((ran, loop.fast - fast, loop.size, loop.claimed, loop.completed, loop.failed))
            loop.stopping = True
            loop.finish()
        finally:
            executor.close()
            app.close()
    trace.append(
        tuple(
            sorted(
                (row["queue"], row["state"], row["n"])
                for row in query(
                    dsn,
                    "SELECT queue, state::text AS state, count(*) AS n FROM fastjobs_jobs_all GROUP BY 1, 2",
                )
            )
        )
    )
    return trace


def test_the_twins_decide_each_batch_alike(twin_dsns: tuple[str, str], monkeypatch: Any) -> None:
    """Queue turns, lanes, marks, sizes: the same script leaves the same trace step by step.
    test_the_twins_leave_the_same_rows_and_counters compares one step per batch; this one the
    decisions that span batches, where a tuning change to one twin alone shows.

    A size is capped by the pace of its queue's last batch (BATCH_SECONDS), so a batch stretched
    by a loaded machine would change the next sizes of one twin: both twins ask the one planner,
    whose BATCH_SECONDS the script sets out of reach (a stall of minutes still proves a queue and
    caps nothing). Should a stall outlast FRONT_CLAIM_MAX_WAIT, the pair runs again, up to three
    times, on fresh databases; a twin that decides otherwise differs every time."""
    monkeypatch.setattr(planner, "BATCH_SECONDS", 1000.0)
    python, c = _policy(_core_py, twin_dsns[0]), _policy(_core, twin_dsns[1])
    for _ in range(2):
        if python == c:
            break
        fresh = [databases.create(template=databases.template()) for _ in TWINS]
        try:
            python, c = _policy(_core_py, fresh[0]), _policy(_core, fresh[1])
        finally:
            for dsn in fresh:
                databases.drop(dsn)
    for step, (ours, theirs) in enumerate(zip(python, c, strict=True)):
        assert ours == theirs, (step, python, c)
    # The script reaches what it is for: both lanes, and every job but the failed ones done.
    assert sum(entry[1] for entry in python[:-1]) > 0
    assert sum(entry[0] - entry[1] for entry in python[:-1]) > 0
    # The jobs enqueued ahead of the mark wait for the claim from the front, due in 10 s.
    assert python[-1] == (("a", "available", 5), ("a", "discarded", 3)), python
