"""The error root of fastjobs and its few subclasses."""

from __future__ import annotations

from typing import Any

__all__ = [
    "Cancel",
    "ConfigurationError",
    "DatabaseUnavailable",
    "FastjobsError",
    "InvalidArguments",
    "JobCancelled",
    "JobFailed",
    "JobNotFound",
    "JobTimeout",
    "LoopError",
    "QueueFull",
    "Retry",
    "SchemaMissing",
    "SchemaTooNew",
    "Snooze",
    "UnknownKind",
]


class FastjobsError(Exception):
    """fastjobs failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class ConfigurationError(FastjobsError):
    """fastjobs is not configured: pass a DSN, or set FASTJOBS_DSN or DATABASE_URL
    (to a PostgreSQL URL, or to "embedded" for the embedded PostgreSQL)."""


class DatabaseUnavailable(FastjobsError):
    """PostgreSQL could not be reached."""


class LoopError(FastjobsError):
    """A statement of a worker's hot loop failed, or its connection did; the message is libpq's."""


class SchemaMissing(FastjobsError):
    """The fastjobs schema is missing or out of date in this database: run `fastjobs migrate`."""


class SchemaTooNew(SchemaMissing):
    """The fastjobs schema in this database is newer than this fastjobs runs on: upgrade fastjobs."""


class QueueFull(FastjobsError):
    """The queue's backlog is at its max_backlog (`fastjobs queues limit`): nothing was enqueued.

    `backlog` is the leader's last count (at most a few seconds old), `max_backlog` the limit.
    """

    def __init__(self, queue: str, backlog: int, max_backlog: int, waited: float = 0.0) -> None:
        self.queue, self.backlog, self.max_backlog = queue, backlog, max_backlog
        after = f" after waiting {waited:g}s for room" if waited else ""
        super().__init__(
            f"queue {queue!r} is full: {backlog:,} jobs waiting, its max_backlog is {max_backlog:,}{after};"
            " nothing was enqueued (wait_for_room=SECONDS waits for room)"
        )


class JobTimeout(FastjobsError):
    """The job ran longer than its timeout."""


class Retry(FastjobsError):
    """Raised by a handler: fail this attempt and run the job again after `delay` seconds."""

    def __init__(self, delay: float = 0.0, reason: str | None = None) -> None:
        super().__init__(reason or f"retry requested in {delay:g}s")
        self.delay = float(delay)


class Snooze(FastjobsError):
    """Raised by a handler: run the job again after `delay` seconds; the attempt does not count."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(f"snoozed for {delay:g}s")
        self.delay = float(delay)


class Cancel(FastjobsError):
    """Raised by a handler: stop this job for good, recording `reason`; it is not retried."""

    def __init__(self, reason: str = "cancelled by its handler") -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownKind(FastjobsError, ValueError):
    """This App has no handler for the job kind, and the kind was not declared with `app.declare`."""


class JobNotFound(FastjobsError, LookupError):
    """No job has this id."""


class InvalidArguments(FastjobsError, TypeError):
    """A job's stored arguments do not convert to its handler's annotations: it is discarded, not retried."""


class _Finished(FastjobsError):
    """The job ended without a result."""

    def __init__(self, job_id: int, errors: list[dict[str, Any]], message: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.errors = errors


class JobFailed(_Finished):
    """The job was discarded: its last attempt failed (`errors` holds every attempt's error)."""


class JobCancelled(_Finished):
    """The job was cancelled (`errors` holds its attempts' errors and the cancellation's note)."""
