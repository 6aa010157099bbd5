"""What the worker, retry and run tests share: reading job rows, running a worker or one batch."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from fastjobs import App, sql
from fastjobs.abc import BatchLoop
from fastjobs.executor import Executor
from fastjobs.impl import core
from fastjobs.worker import Worker, WorkerConfig

# Every behaviour must be the same with the claim sent ahead of the handlers and without.
OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])


def query(dsn: str, statement: str, params: Any = None) -> list[dict[str, Any]]:
    """Run one statement on a short-lived autocommit connection; its rows as dicts."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def jobs(dsn: str) -> list[dict[str, Any]]:
    """Every job row, oldest first, with run_at and finalized_at as seconds from now."""
    return query(
        dsn,
        """SELECT *, extract(epoch FROM run_at - now())::float8 AS run_in,
                  extract(epoch FROM run_at - attempted_at)::float8 AS delay_after_claim
             FROM fastjobs_jobs_all ORDER BY id""",
    )


def by_state(dsn: str) -> dict[str, int]:
    return {
        r["state"]: r["n"]
        for r in query(dsn, "SELECT state::text, count(*) AS n FROM fastjobs_jobs_all GROUP BY 1")
    }


def insert_raw(dsn: str, kind: str, args_json: str, queue: str = "default") -> int:
    """A job row written by SQL, bypassing every check enqueue makes."""
    rows = query(
        dsn,
        "INSERT INTO fastjobs_jobs (queue, kind, args) VALUES (%s, %s, %s::jsonb) RETURNING id",
        (queue, kind, args_json),
    )
    return int(rows[0]["id"])


def drain(app: App, queues: list[str] | None = None, worker_id: str | None = None, **settings: Any) -> Worker:
    """Run a worker in-process until the queue is empty; returns it for its counters.

    `settings` are WorkerConfig's fields.
    """
    worker = Worker(app, queues, config=WorkerConfig(**settings), worker_id=worker_id, exit_when_empty=True)
    worker.run()
    return worker


@contextmanager
def batch_loop(
    app: App,
    size: int,
    *,
    overlap: bool = True,
    keep_completed: bool = False,
    queues: list[str] | None = None,
    concurrency: int = 100,
    executor: Executor | None = None,
    **loop_options: Any,
) -> Iterator[BatchLoop]:
    """The implementation's BatchLoop with a fixed batch size, on a connection of its own.

    Tests that must see several jobs in one batch use it directly: a Worker
    starts at one job per claim and doubles from there.
    """
    conn = psycopg.connect(app.dsn, autocommit=True)
    executor = executor if executor is not None else Executor(concurrency)
    try:
        loop = core.BatchLoop(
            conn,
            dict(app.jobs),
            executor,
            "test-worker",
            queues or ["default"],
            keep_completed=keep_completed,
            batch_min=size,
            batch_max=size,
            overlap=overlap,
            **loop_options,
        )
        loop.prepare()
        yield loop
    finally:
        executor.close()
        conn.close()


def warm(app: App, loop: BatchLoop) -> None:
    """One quick job of kind "warm" on the state lane: a queue takes the fast lane once a batch of
    it ran quickly (the test registers the kind)."""
    app.enqueue("warm")
    assert loop.step() == 1 and loop.fast == 0


def run_one_batch(app: App, size: int, **options: Any) -> int:
    """Claim and run one batch of `size`, then write its outcomes; returns the jobs run."""
    with batch_loop(app, size, **options) as loop:
        try:
            return int(loop.step())
        finally:
            loop.stopping = True
            loop.finish()


class WorkerThread:
    """A Worker.run in a background thread (signals need the main thread; stop() does not)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> WorkerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the worker did not stop within 10 s of stop()"
        if self.error is not None and exc[0] is None:
            raise self.error


def handler_event(app: App, kind: str, **job_options: Any) -> tuple[threading.Event, list[Any]]:
    """Register `kind` as a handler that records its `n` and sets an event."""
    ran = threading.Event()
    seen: list[Any] = []

    def handle(n: int) -> None:
        seen.append(n)
        ran.set()

    app.job(kind=kind, **job_options)(handle)
    return ran, seen


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `predicate` every 5 ms until it holds or `timeout` passes; whether it held."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.005)
    return True


def asleep(dsn: str, seconds: float = 3600.0) -> None:
    """Inserts notify for `seconds`, as while a worker sleeps on its LISTEN connection (sql.worker_sleep)."""
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(sql.worker_sleep, (seconds,))


# Channel of the marker `notifications` sends after the work under test.
NOTIFY_END = "fastjobs_test_end"


def notifications(listener: psycopg.Connection[Any], dsn: str) -> Counter[str]:
    """Payloads notified on the fastjobs channel so far (the `listener` fixture's), counted.

    Notifications arrive in commit order, so a marker notified after the work
    under test is committed ends the wait: no sleeping on a timeout.
    """
    query(dsn, f"NOTIFY {NOTIFY_END}")
    seen: Counter[str] = Counter()
    for note in listener.notifies(timeout=30):
        if note.channel == NOTIFY_END:
            return seen
        assert note.channel == sql.NOTIFY_CHANNEL
        seen[note.payload] += 1
    raise AssertionError(f"the end marker never arrived; got {seen}")
