"""Job results (keep_result): kept apart, returned by App.result, woken by a notification."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

import fastjobs
from fastjobs import App, JobCancelled, JobFailed, JobNotFound, JobStatus, abc, maintenance
from fastjobs.cli import main
from fastjobs.executor import Executor
from fastjobs.impl import core
from tests.helpers import batch_loop, drain, query, warm

LANES = pytest.mark.parametrize("lane", ["fast", "state"])


class Opaque:
    pass


def _register(app: App) -> None:
    @app.job(kind="add", keep_result=60)
    def add(a: int, b: int) -> int:
        return a + b

    @app.job(kind="plain")
    def plain(a: int, b: int) -> int:
        return a + b

    @app.job(kind="opaque", keep_result=60, max_attempts=2)
    def opaque() -> Any:
        return {"x": Opaque()}

    @app.job(kind="boom", keep_result=60, max_attempts=1)
    def boom() -> None:
        raise RuntimeError("it broke")

    @app.job(kind="warm")
    def warm_up() -> None:
        pass


def _results(dsn: str) -> list[dict[str, Any]]:
    return query(dsn, "SELECT id, state::text, value, errors FROM fastjobs_results ORDER BY id")


@contextmanager
def _lane(app: App, lane: str) -> Iterator[None]:
    """A loop on `lane` (its queue proven first, for the fast one) that runs, on leaving the block,
    every job due now."""
    with batch_loop(app, 50, fast_lane=lane == "fast") as loop:
        if lane == "fast":
            warm(app, loop)
        yield
        while loop.step():
            pass
        loop.finish()
        assert (loop.fast > 0) == (lane == "fast")


def _run(app: App, lane: str) -> None:
    with _lane(app, lane):
        pass


@LANES
def test_a_value_is_kept_and_returned_and_jobs_without_keep_result_keep_nothing(
    app: App, dsn: str, lane: str
) -> None:
    _register(app)
    with _lane(app, lane):
        kept = app.enqueue("add", {"a": 1, "b": 2})
        per_call = app.enqueue("plain", {"a": 2, "b": 2}, keep_result=30)
        plain = [app.enqueue("plain", {"a": n, "b": 0}) for n in range(5)]
        app.enqueue_many("plain", [{"a": n, "b": 0} for n in range(5)])
        app.enqueue_many("add", [{"a": 10, "b": n} for n in range(3)])
    rows = _results(dsn)
    assert [r["value"] for r in rows] == [3, 4, 10, 11, 12]
    assert all(r["state"] == "completed" for r in rows)
    assert not query(dsn, "SELECT 1 FROM fastjobs_jobs_all")  # completed jobs still deleted
    assert isinstance(kept, fastjobs.JobHandle) and isinstance(kept, int)
    assert kept.result() == 3 and app.result(per_call, timeout=1) == 4
    status = app.status(kept)
    assert isinstance(status, JobStatus)
    assert (status.state, status.value, status.kind, status.args, status.attempt) == (
        "completed", 3, "add", {"a": 1, "b": 2}, 1,
    )  # fmt: skip
    assert status.finished_at is not None and status.started_at is not None
    with pytest.raises(JobNotFound, match="not found"):
        app.result(plain[0])


def test_the_status_keeps_the_priority_a_job_was_enqueued_with(app: App, dsn: str) -> None:
    """Waiting, and once done among the kept results (what a Django task's result reports). On the
    state lane: a fast claim after the mark takes the mark's priority only (both lanes copy the
    priority by the same _keep, which the other tests run on both)."""
    _register(app)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with _lane(app, "state"):
        done = app.enqueue("add", {"a": 1, "b": 1}, priority=7)
        failed = app.enqueue("boom", priority=-3)
        waiting = app.enqueue("add", {"a": 0, "b": 0}, priority=5, run_at=later)
        assert app.status(waiting).priority == 5
    assert [app.status(job_id).priority for job_id in (done, failed)] == [7, -3]
    kept = query(dsn, "SELECT priority FROM fastjobs_results ORDER BY id")
    assert kept == [{"priority": 7}, {"priority": -3}]


@LANES
def test_a_value_that_cannot_be_stored_fails_the_attempt_and_is_retried(
    app: App, dsn: str, lane: str
) -> None:
    _register(app)
    with _lane(app, lane):
        job_id = app.enqueue("opaque")
    row = query(dsn, "SELECT state::text, attempt, errors FROM fastjobs_jobs_all WHERE id = %s", (job_id,))[0]
    assert (row["state"], row["attempt"]) == ("retryable", 1)
    message = row["errors"][0]["error"]
    assert f"job {job_id} (opaque)" in message and "dict" in message and "Opaque" in message
    assert not _results(dsn)


@LANES
def test_a_discarded_job_raises_job_failed_with_its_errors(app: App, dsn: str, lane: str) -> None:
    _register(app)
    with _lane(app, lane):
        job_id = app.enqueue("boom")
    assert not query(dsn, "SELECT 1 FROM fastjobs_jobs_all WHERE id = %s AND state <> 'discarded'", (job_id,))
    with pytest.raises(JobFailed) as caught:
        app.result(job_id)
    assert caught.value.job_id == job_id
    assert "it broke" in caught.value.errors[0]["error"] and "it broke" in str(caught.value)
    assert caught.value.errors[0]["class"] == "builtins.RuntimeError"
    assert _results(dsn)[0]["state"] == "discarded"
    query(dsn, "DELETE FROM fastjobs_jobs_all")  # the jobs table's retention ended: still known
    assert app.status(job_id).state == "discarded"
    with pytest.raises(JobFailed):
        app.result(job_id)


def test_a_cancelled_job_raises_job_cancelled(app: App, dsn: str) -> None:
    _register(app)
    job_id = app.enqueue("add", {"a": 1, "b": 1}, delay=3600)
    assert app.cancel(job_id) == "cancelled"
    query(dsn, "DELETE FROM fastjobs_jobs_all")
    with pytest.raises(JobCancelled) as caught:
        app.result(job_id)
    assert caught.value.job_id == job_id
    assert app.status(job_id).state == "cancelled"


def test_unknown_and_unkept_jobs_say_why(app: App, dsn: str) -> None:
    _register(app)
    with pytest.raises(JobNotFound, match="no such job"):
        app.result(123456)
    job_id = app.enqueue("plain", {"a": 1, "b": 1})
    with pytest.raises(JobNotFound, match="without keep_result"):
        app.result(job_id)
    status = app.status(job_id)
    assert (status.state, status.value, status.errors) == ("available", None, [])
    with psycopg.connect(dsn, row_factory=dict_row) as conn:  # the caller's, any row factory
        assert app.status(job_id, conn=conn) == status


def test_a_timeout_raises_and_leaves_the_job_alone(app: App, dsn: str) -> None:
    _register(app)
    job_id = app.enqueue("add", {"a": 1, "b": 1})
    before = query(dsn, "SELECT * FROM fastjobs_jobs_all WHERE id = %s", (job_id,))
    with pytest.raises(TimeoutError):
        app.result(job_id, timeout=0.05)
    assert query(dsn, "SELECT * FROM fastjobs_jobs_all WHERE id = %s", (job_id,)) == before


# The waiter's sessions go by this name: the test's loop and producer have sessions of their own
# in the database, whose last statements may name the results table too.
WAITER = "fastjobs-test-waiter"


def _waiter_activity(dsn: str) -> list[tuple[Any, ...]]:
    """The waiter's sessions: their state, last statement's change, and whether that statement was
    its look at the tables (sql.job_status; pg_stat_activity may hold a prefix of its text)."""
    rows = query(
        dsn,
        """SELECT a.state, a.state_change, a.query FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.application_name = %s
              AND a.pid <> pg_backend_pid()""",
        (WAITER,),
    )
    look = fastjobs.sql.job_status.strip()
    return [
        (r["state"], r["state_change"], bool(r["query"].strip()) and look.startswith(r["query"].strip()))
        for r in rows
    ]


@LANES
def test_the_wait_is_woken_by_the_notification_and_issues_no_query(app: App, dsn: str, lane: str) -> None:
    """The waiter's session stays idle on its last statement (its look at the tables) until the
    outcome is written: no polling; then the notification wakes it."""
    _register(app)
    got: list[Any] = []
    waiting = App(make_conninfo(dsn, application_name=WAITER))
    with _lane(app, lane):
        job_id = app.enqueue("add", {"a": 20, "b": 22})
        waiter = threading.Thread(target=lambda: got.append(waiting.result(job_id, timeout=60)), daemon=True)
        waiter.start()
        # Idle after its look at the tables, not merely idle: it is idle a moment after its LISTEN
        # too, before the look (CI caught it there, then active on the look, time and again).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            first = _waiter_activity(dsn)
            if [(state, looked) for state, _, looked in first] == [("idle", True)]:
                break
            time.sleep(0.01)
        assert [(state, looked) for state, _, looked in first] == [("idle", True)], first
        time.sleep(0.5)  # what a polling waiter would have queried in
        assert _waiter_activity(dsn) == first
    waiter.join(10)
    waiting.close()
    assert got == [42]


def test_result_async_and_the_handle(app: App, dsn: str) -> None:
    _register(app)

    async def main() -> tuple[Any, Any, JobStatus]:
        handle = await app.enqueue_async("add", {"a": 5, "b": 5})
        waiting = asyncio.ensure_future(handle.result_async(timeout=30))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(_run, app, "state")
        value = await waiting
        again = await app.result_async(handle)
        return value, again, await app.status_async(handle)

    value, again, status = asyncio.run(main())
    assert value == again == 10 and status.value == 10


def test_handlers_on_the_slow_path_keep_their_value(app: App, dsn: str) -> None:
    """Async handlers, sync ones with a timeout, and sync ones on threads run on the executor."""

    @app.job(kind="async_add", keep_result=60)
    async def async_add(a: int) -> int:
        return a + 1

    @app.job(kind="timed_add", keep_result=60, timeout=30)
    def timed_add(a: int) -> int:
        return a + 2

    @app.job(kind="pooled_add", keep_result=60, queue="pooled")
    def pooled_add(a: int) -> int:
        return a + 3

    ids = [app.enqueue(kind, {"a": 1}) for kind in ("async_add", "timed_add", "pooled_add")]
    drain(app, ["default", "pooled"], threads={"pooled": 4})
    assert [app.result(job_id) for job_id in ids] == [2, 3, 4]


def test_the_cleaner_expires_results_in_batches(app: App, dsn: str) -> None:
    _register(app)
    app.enqueue_many("add", [{"a": n, "b": 0} for n in range(5)])
    _run(app, "state")
    assert len(_results(dsn)) == 5
    with psycopg.connect(dsn, autocommit=True) as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        config = maintenance.CleanerConfig(batch=2)
        assert maintenance.clean_once(conn, now, config)["results"] == 0  # nothing expired yet
        later = now + dt.timedelta(seconds=61)
        assert maintenance.clean_once(conn, later, config)["results"] == 5
    assert not _results(dsn)


def test_an_expired_result_is_gone_before_the_cleaner_removes_it(app: App, dsn: str) -> None:
    """Past its keep_result, a kept outcome reads as gone to status() (Django's get_result) as to
    result(), though its row waits for the cleaner's next pass."""
    _register(app)
    job_id = app.enqueue("add", {"a": 1, "b": 1})
    _run(app, "state")
    assert app.status(job_id).value == 2
    query(dsn, "UPDATE fastjobs_results SET expires_at = now() - interval '1 second'")
    for look in (app.status, app.result):
        with pytest.raises(JobNotFound, match="expired"):
            look(job_id)
    assert len(_results(dsn)) == 1


def test_drain_in_the_testing_kit_makes_results_available(dsn: str) -> None:
    app = App(dsn)
    _register(app)
    with app.testing() as kit:
        job_id = app.enqueue("add", {"a": 2, "b": 3})
        kit.drain()
        assert app.result(job_id) == 5
    with app.testing("inline"):  # the job runs as its enqueue commits, through the same loop
        assert app.enqueue("add", {"a": 3, "b": 4}).result(timeout=10) == 7
    app.close()


def test_keep_result_is_validated() -> None:
    app = App("postgresql://nowhere/none")
    with pytest.raises(ValueError, match="keep_result"):
        app.job(keep_result=-1)
    job = app.job(kind="k", keep_result=dt.timedelta(minutes=1))(lambda: None)
    assert job.spec.keep_result == 60
    with pytest.raises(ValueError, match="keep_result"):
        job.options(keep_result="soon")  # type: ignore[arg-type]


def test_jobs_show_displays_a_kept_result_of_a_job_gone_from_the_jobs_table(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(app)
    job_id = app.enqueue("add", {"a": 40, "b": 2})
    _run(app, "state")
    assert main(["--dsn", dsn, "jobs", "show", str(job_id)]) == 0
    out = capsys.readouterr().out
    fields = dict(line.strip().split(": ", 1) for line in out.splitlines() if ": " in line)
    assert (fields["id"], fields["kind"], fields["state"], fields["result"]) == (
        str(job_id), "add", "completed", "42",
    )  # fmt: skip
    assert main(["--dsn", dsn, "jobs", "show", str(job_id), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"] == 42


def test_a_retried_job_forgets_its_kept_outcome_and_keeps_the_next(app: App, dsn: str) -> None:
    ran: list[int] = []

    @app.job(kind="flaky", keep_result=60, max_attempts=1)
    def flaky() -> str:
        ran.append(1)
        if len(ran) == 1:
            raise RuntimeError("first time")
        return "second time"

    job_id = app.enqueue("flaky")
    _run(app, "state")
    with pytest.raises(JobFailed):
        app.result(job_id)
    assert main(["--dsn", dsn, "jobs", "retry", str(job_id)]) == 0
    assert app.status(job_id).state == "available"  # the discarded outcome is forgotten
    _run(app, "state")
    assert app.result(job_id) == "second time"


def test_every_statement_that_ends_a_job_keeps_its_outcome_and_wakes_its_waiter(app: App, dsn: str) -> None:
    """An operator's discard, the rescuer's and a crashed worker's: each keeps the outcome of a job
    with keep_result and tells its waiters, as the loops' statements do."""
    _register(app)
    discarded = app.enqueue("add", {"a": 1, "b": 1}, delay=3600)
    got: list[BaseException] = []

    def wait() -> None:
        try:
            app.result(discarded, timeout=30)
        except BaseException as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while not _waiter_activity(dsn) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert main(["--dsn", dsn, "jobs", "discard", str(discarded)]) == 0
    waiter.join(10)
    assert len(got) == 1 and isinstance(got[0], JobFailed)
    rescued = app.enqueue("add", {"a": 1, "b": 2}, max_attempts=1)
    query(
        dsn,
        """UPDATE fastjobs_jobs_all SET state = 'running', attempt = 1, attempted_by = 'gone',
                  attempted_at = now() - interval '1 hour' WHERE id = %s""",
        (rescued,),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        maintenance.rescue_once(conn)
    assert [r["id"] for r in _results(dsn) if r["state"] == "discarded"] == [discarded, rescued]
    with pytest.raises(JobFailed, match="died"):
        app.result(rescued)


@LANES
def test_a_loop_that_claims_no_job_keeping_its_result_never_sends_the_results_statements(
    app: App, dsn: str, lane: str
) -> None:
    """Jobs without keep_result go by the finish statements of before; a batch with one takes the
    _results variant, and the loop goes back once KEEPING_CLAIMS claims have held none."""
    _register(app)
    conn = psycopg.connect(dsn, autocommit=True)
    executor = Executor(10)
    loop = core.BatchLoop(conn, dict(app.jobs), executor, "w", ["default"], batch_min=5, batch_max=5,
                          fast_lane=lane == "fast")  # fmt: skip
    try:
        loop.prepare()
        if lane == "fast":
            warm(app, loop)

        def executed() -> dict[str, int]:
            rows = conn.execute(
                "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
                " WHERE name LIKE 'job_finish%%results'"
            ).fetchall()
            return {name: count for name, count in rows if count}

        def drain_all() -> None:
            while loop.step():
                pass

        app.enqueue_many("plain", [{"a": n, "b": 0} for n in range(20)])
        drain_all()
        assert executed() == {}
        app.enqueue("add", {"a": 1, "b": 1})
        drain_all()
        assert executed() != {}
        before = executed()
        for _ in range(abc.KEEPING_CLAIMS + 1):
            app.enqueue_many("plain", [{"a": n, "b": 0} for n in range(5)])
            drain_all()
        app.enqueue_many("plain", [{"a": n, "b": 0} for n in range(20)])
        after = executed()
        drain_all()
        assert executed() == after
        loop.stopping = True
        loop.finish()
        assert len(_results(dsn)) == 1 and before
    finally:
        executor.close()
        conn.close()
