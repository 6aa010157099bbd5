"""Cancellation: `app.cancel` of queued, running and finished jobs.

A queued job is cancelled by one statement. A running one is told through
the worker's control thread (NOTIFY on fastjobs_cancel, and a poll at each
heartbeat): an async handler's task is cancelled, a sync handler sees
`fastjobs.current_job().cancelled`; either way the job ends 'cancelled'.
Workers run in threads; the tests wait on events and job rows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any

import psycopg
import pytest

import fastjobs
from fastjobs import App, JobNotFound, Worker, WorkerConfig, control
from fastjobs.executor import Executor
from fastjobs.heartbeat import Heartbeat
from fastjobs.impl import core

from .helpers import WorkerThread, drain, query, wait_for


def job(dsn: str, job_id: int) -> dict[str, Any]:
    rows = query(dsn, "SELECT *, state::text AS state FROM fastjobs_jobs_all WHERE id = %s", (job_id,))
    assert rows, f"job {job_id} is gone"
    return rows[0]


def state(dsn: str, job_id: int) -> str | None:
    rows = query(dsn, "SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,))
    return rows[0]["state"] if rows else None


# --- queued jobs -------------------------------------------------------------------------------


def test_cancel_of_queued_jobs_is_immediate(app: App, dsn: str) -> None:
    ran: list[str] = []
    app.job("k")(lambda name: ran.append(name))
    available = app.enqueue("k", {"name": "available"})
    scheduled = app.enqueue("k", {"name": "scheduled"}, delay=3600)
    retryable = app.enqueue("k", {"name": "retryable"})
    query(dsn, "UPDATE fastjobs_jobs_all SET state = 'retryable', attempt = 1 WHERE id = %s", (retryable,))
    assert [state(dsn, i) for i in (available, scheduled, retryable)] == [
        "available",
        "scheduled",
        "retryable",
    ]

    for job_id in (available, scheduled, retryable):
        assert app.cancel(job_id) == "cancelled"
        row = job(dsn, job_id)
        assert row["state"] == "cancelled"
        assert row["finalized_at"] is not None
        assert row["cancel_requested"] is False

    query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 hour'")  # nothing is due any more
    drain(app)
    assert ran == []
    assert {state(dsn, i) for i in (available, scheduled, retryable)} == {"cancelled"}


def test_cancel_of_a_finished_job_returns_its_state_unchanged(app: App, dsn: str) -> None:
    @app.job("ok")
    def ok() -> None: ...

    @app.job("fails", max_attempts=1)
    def fails() -> None:
        raise ValueError("no")

    completed = app.enqueue("ok")
    discarded = app.enqueue("fails")
    drain(app, keep_completed=True)
    cancelled = app.enqueue("ok", delay=60)
    assert app.cancel(cancelled) == "cancelled"

    for job_id, expected in ((completed, "completed"), (discarded, "discarded"), (cancelled, "cancelled")):
        before = job(dsn, job_id)
        assert app.cancel(job_id) == expected
        assert job(dsn, job_id) == before


def test_cancel_of_an_unknown_job_raises_job_not_found(app: App) -> None:
    with pytest.raises(JobNotFound, match="no job with id 12345"):
        app.cancel(12345)
    with pytest.raises(LookupError):
        app.cancel(12345)


def test_cancel_with_conn_joins_the_callers_transaction(app: App, dsn: str) -> None:
    job_id = app.enqueue("k")
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            assert app.cancel(job_id, conn=conn) == "cancelled"
            assert state(dsn, job_id) == "available"  # not committed yet
            raise psycopg.Rollback
        assert state(dsn, job_id) == "available"
        with conn.transaction():
            assert app.cancel(job_id, conn=conn) == "cancelled"
    assert state(dsn, job_id) == "cancelled"


# --- running jobs ------------------------------------------------------------------------------


def register_poller(app: App, kind: str, **options: Any) -> tuple[threading.Event, list[Any]]:
    """A sync handler that signals it started, then polls its job's `cancelled` flag (for 30 s at most)."""
    started = threading.Event()
    seen: list[Any] = []

    def poller() -> None:
        context = fastjobs.current_job()
        assert context is not None
        seen.append((context.id, context.kind, context.attempt))
        started.set()
        pause = threading.Event()
        deadline = time.monotonic() + 30
        while not context.cancelled and time.monotonic() < deadline:
            pause.wait(0.005)
        seen.append(context.cancelled)

    app.job(kind, **options)(poller)
    return started, seen


@pytest.mark.parametrize("options", [{}, {"timeout": 60}], ids=["inline", "with-timeout"])
def test_a_running_sync_job_that_checks_the_flag_ends_cancelled(
    app: App, dsn: str, options: dict[str, Any]
) -> None:
    started, seen = register_poller(app, "poller", **options)
    job_id = app.enqueue("poller")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10), "the handler did not start"
        asked = time.monotonic()
        assert app.cancel(job_id) == "cancelling"
        assert job(dsn, job_id)["cancel_requested"] is True
        assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
        took = time.monotonic() - asked
        print(f"\ncancel of a running job: {took:.3f}s from app.cancel to 'cancelled'")
    assert seen == [(job_id, "poller", 1), True]
    # NOTIFY reaches the control thread at once; the heartbeat poll (2 s) is the fallback.
    assert took < 5.0, took
    row = job(dsn, job_id)
    assert row["finalized_at"] is not None
    assert row["attempt"] == 1
    assert "Cancel" in row["errors"][-1]["error"]
    assert app.cancel(job_id) == "cancelled"


@pytest.mark.parametrize("options", [{}, {"timeout": 60}], ids=["inline", "with-timeout"])
def test_a_running_sync_job_that_raises_cancel_keeps_its_reason(
    app: App, dsn: str, options: dict[str, Any]
) -> None:
    """The handler's own Cancel(reason), raised once it sees the request, is what its errors say."""
    started = threading.Event()

    @app.job("stopper", **options)
    def stopper() -> None:
        context = fastjobs.current_job()
        assert context is not None
        started.set()
        pause = threading.Event()
        deadline = time.monotonic() + 30
        while not context.cancelled and time.monotonic() < deadline:
            pause.wait(0.005)
        raise fastjobs.Cancel("stopped at row 500 of 1000")

    job_id = app.enqueue("stopper")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10), "the handler did not start"
        assert app.cancel(job_id) == "cancelling"
        assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
    errors = job(dsn, job_id)["errors"]
    assert [e["error"] for e in errors] == ["Cancel: stopped at row 500 of 1000"]


def test_a_running_async_job_that_raises_cancel_keeps_its_reason(app: App, dsn: str) -> None:
    started = threading.Event()

    @app.job("async_stopper")
    async def async_stopper() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise fastjobs.Cancel("closed the upload first") from None

    job_id = app.enqueue("async_stopper")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10), "the handler did not start"
        assert app.cancel(job_id) == "cancelling"
        assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
    errors = job(dsn, job_id)["errors"]
    assert [e["error"] for e in errors] == ["Cancel: closed the upload first"]


def test_current_job_is_none_outside_a_handler_while_a_worker_thread_runs_one(app: App, dsn: str) -> None:
    started, _ = register_poller(app, "poller")
    job_id = app.enqueue("poller")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10)
        try:
            outside = fastjobs.current_job()
        finally:
            app.cancel(job_id)
            assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
        assert outside is None


def test_a_running_async_job_is_cancelled_promptly(app: App, dsn: str) -> None:
    started = threading.Event()
    finished: list[str] = []

    @app.job("sleeper")
    async def sleeper() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            finished.append("cancelled")
            raise
        finished.append("slept")

    job_id = app.enqueue("sleeper")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10), "the handler did not start"
        asked = time.monotonic()
        assert app.cancel(job_id) == "cancelling"
        assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
        took = time.monotonic() - asked
        print(f"\ncancel of a running job: {took:.3f}s from app.cancel to 'cancelled'")
    assert finished == ["cancelled"]
    assert took < 5.0, took
    assert "Cancel" in job(dsn, job_id)["errors"][-1]["error"]


def test_cancelling_one_async_job_leaves_the_others_running(app: App, dsn: str) -> None:
    started = threading.Event()
    cancelled = threading.Event()
    release = asyncio.Event()
    loops: list[asyncio.AbstractEventLoop] = []
    done: list[int] = []

    @app.job("waiter")
    async def waiter(n: int) -> None:
        loops[:] = [asyncio.get_running_loop()]
        if n == 0:
            started.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        done.append(n)

    ids = [app.enqueue("waiter", {"n": n}) for n in range(3)]
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10)
        assert app.cancel(ids[0]) == "cancelling"
        assert cancelled.wait(10), "job 0 was not cancelled"
        loops[0].call_soon_threadsafe(release.set)
        assert wait_for(lambda: state(dsn, ids[1]) is None and state(dsn, ids[2]) is None, timeout=5)
        assert wait_for(lambda: state(dsn, ids[0]) == "cancelled", timeout=5)
    assert sorted(done) == [1, 2]


def test_a_job_cancelled_while_claimed_but_not_started_never_runs(app: App, dsn: str) -> None:
    """A batch of two: the first blocks until the second's cancellation reached the worker."""
    started = threading.Event()
    release = threading.Event()
    ran: list[str] = []

    @app.job("first")
    def first() -> None:
        started.set()
        release.wait(30)
        ran.append("first")

    @app.job("second")
    def second() -> None:
        ran.append("second")

    first_id = app.enqueue("first")
    second_id = app.enqueue("second")
    worker_id = "test-cancel-worker"
    conn = psycopg.connect(dsn, autocommit=True)
    executor = Executor()
    control = Heartbeat(dsn, worker_id, executor)
    errors: list[BaseException] = []
    try:
        loop = core.BatchLoop(
            conn, dict(app.jobs), executor, worker_id, ["default"], batch_min=2, batch_max=2, overlap=False
        )
        loop.prepare()
        control.start()

        def run_batch() -> None:
            try:
                assert loop.step() == 2
                loop.stopping = True
                loop.finish()
            except BaseException as exc:
                errors.append(exc)

        batch = threading.Thread(target=run_batch)
        batch.start()
        assert started.wait(10), "the first job did not start"
        assert state(dsn, second_id) == "running"  # claimed in the same batch
        assert app.cancel(second_id) == "cancelling"
        assert wait_for(lambda: second_id in executor.cancelled, timeout=5)
        release.set()
        batch.join(10)
        assert not batch.is_alive()
    finally:
        release.set()
        control.stop()
        executor.close()
        conn.close()
    assert not errors, errors
    assert ran == ["first"]
    assert state(dsn, first_id) is None  # completed, deleted
    row = job(dsn, second_id)
    assert row["state"] == "cancelled"
    assert row["finalized_at"] is not None


def test_a_job_finishing_before_the_cancel_arrives_keeps_its_outcome(app: App, dsn: str) -> None:
    @app.job("quick")
    def quick() -> None: ...

    job_id = app.enqueue("quick")
    drain(app, keep_completed=True)
    assert app.cancel(job_id) == "completed"
    assert job(dsn, job_id)["cancel_requested"] is False


def test_cancel_requested_is_cleared_by_retry(app: App, dsn: str) -> None:
    """A job cancelled while running and retried by hand is available, its request cleared."""
    started, _ = register_poller(app, "poller")
    job_id = app.enqueue("poller")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.1))):
        assert started.wait(10)
        app.cancel(job_id)
        assert wait_for(lambda: state(dsn, job_id) == "cancelled", timeout=5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert control.retry(conn, job_id).state == "available"
    row = job(dsn, job_id)
    assert (row["state"], row["cancel_requested"], row["finalized_at"]) == ("available", False, None)
    assert row["run_at"] <= dt.datetime.now(dt.UTC)
