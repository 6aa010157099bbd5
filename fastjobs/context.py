"""The job a handler runs, as it sees it: `JobContext` and `current_job()`."""

from __future__ import annotations

import contextvars
import datetime as dt
import threading
import time
from typing import TYPE_CHECKING, Any

from .abc import PG_EPOCH

__all__ = ["JobContext", "bind", "current_job"]

if TYPE_CHECKING:
    from .executor import Executor


def _pg_time(micros: int | None) -> dt.datetime | None:
    return None if micros is None else PG_EPOCH + dt.timedelta(microseconds=micros)


class JobContext:
    """What a running handler and its middleware know of the job: `fastjobs.current_job()`.

    `id`, `kind`, `attempt` and `cancelled` are always set. The rest (queue,
    args, max_attempts, meta, the times) is set only in a worker whose app has
    middleware, and None otherwise: the hot loop would need a wider claim and
    more work per job for them. A sync job's context is updated in place for
    the next job: keep what you need of it, not the object.

    A sync handler that may run long should check `cancelled` now and then
    and return (or raise Cancel) when it turns true.
    """

    __slots__ = (
        "_enqueued",
        "_scheduled",
        "_started",
        "args",
        "attempt",
        "cancelled",
        "id",
        "kind",
        "max_attempts",
        "meta",
        "queue",
    )

    def __init__(self, job_id: int = 0, kind: str = "", attempt: int = 0) -> None:
        self.id = job_id
        self.kind = kind
        self.attempt = attempt
        self.cancelled = False
        self.queue: str | None = None
        self.args: dict[str, Any] | None = None
        self.max_attempts: int | None = None
        self.meta: dict[str, Any] | None = None
        # The claim's binary timestamptz (microseconds since 2000) and time.time(),
        # made datetimes only when read.
        self._enqueued: int | None = None
        self._scheduled: int | None = None
        self._started: float | None = None

    def fill(
        self,
        queue: str | None,
        args: dict[str, Any],
        max_attempts: int,
        claimed: tuple[dict[str, Any], int, int],
    ) -> None:
        """Set the fields a loop claiming with context read (the slow path's; the C loop sets them inline)."""
        self.queue = queue
        self.args = args
        self.max_attempts = max_attempts
        self.meta, self._enqueued, self._scheduled = claimed
        self._started = time.time()

    @property
    def enqueued_at(self) -> dt.datetime | None:
        """When the job was enqueued (its created_at)."""
        return _pg_time(self._enqueued)

    @property
    def scheduled_at(self) -> dt.datetime | None:
        """When this attempt was due (its run_at: the enqueue's, or a retry's or snooze's)."""
        return _pg_time(self._scheduled)

    @property
    def started_at(self) -> dt.datetime | None:
        """When this attempt started, by the worker's clock."""
        return None if self._started is None else dt.datetime.fromtimestamp(self._started, dt.UTC)

    def __repr__(self) -> str:
        return (
            f"<JobContext id={self.id} kind={self.kind!r} attempt={self.attempt} cancelled={self.cancelled}>"
        )


# Each worker thread's executor context (the hot loop updates it in place per
# sync job) and, for async handlers, each task's own.
_thread = threading.local()
_async_job: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("fastjobs_job", default=None)


def bind(executor: Executor, context: JobContext) -> None:
    """Make `context` the calling thread's `current_job()`, and `executor` whose worker and queue
    the records of its jobs carry (_job_fields)."""
    _thread.job = context
    _thread.executor = executor


def current_job() -> JobContext | None:
    """The job the calling handler is running, or None outside a handler."""
    job = _async_job.get()
    if job is not None:
        return job
    job = getattr(_thread, "job", None)
    return job if job is not None and job.id else None
