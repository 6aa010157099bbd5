"""Job results: what a job became (JobStatus), and the wait for its outcome (App.result).

A job enqueued with keep_result keeps its outcome in fastjobs_results (the
value its handler returned, or the errors it was discarded or cancelled
with) until it expires; every other job is known while its row is in the
jobs table. The wait LISTENs on sql.RESULT_CHANNEL *before* it looks: an
outcome written between the look and the wait is then a notification
already queued on the connection, never missed. The statements that keep
outcomes notify once each, so a waiter sleeps in the kernel, issuing no
query, until an outcome is written.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import set_json_loads

from . import schema, sql
from .connections import Connected
from .errors import JobCancelled, JobFailed, JobNotFound

if TYPE_CHECKING:
    from .app import App
    from .job import AsyncConn, Conn

__all__ = ["JobHandle", "JobStatus"]


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job as App.status finds it, in the jobs table or among the kept results.

    `state` is one of fastjobs.JobState's values; `value` is the kept return
    value of a completed job (None otherwise); `errors` the attempts' error
    records as the jobs table stores them (at, attempt, error, traceback, and an
    exception's class as `module.qualname`); `priority` the one it was enqueued with.
    """

    job_id: int
    kind: str
    queue: str
    state: str
    attempt: int
    max_attempts: int
    args: dict[str, Any]
    enqueued_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    value: Any = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class _Found:
    """A job as sql.job_status found it: its status, and where (what App.result decides by)."""

    status: JobStatus
    keep_result: int | None  # of a job still in the jobs table
    kept: bool  # found among the kept results
    expired: bool  # a kept result past its expiry, not yet cleaned


def _found(job_id: int, row: tuple[Any, ...] | None) -> _Found:
    if row is None:
        raise JobNotFound(
            f"job {job_id} not found: no such job, or the transaction that enqueued it has not"
            " committed yet, or it finished and its outcome was not kept (enqueued without"
            " keep_result), or its kept result expired and was removed"
        )
    (id_, kind, queue, state, attempt, max_attempts, args, created, attempted, finalized) = row[:10]
    value, errors, keep_result, kept, expired, priority = row[10:]
    status = JobStatus(
        int(id_),
        kind,
        queue,
        state,
        int(attempt),
        int(max_attempts),
        args if isinstance(args, dict) else {},
        created,
        attempted,
        finalized,
        value if state == "completed" else None,
        list(errors or []),
        int(priority),
    )
    return _Found(status, keep_result, bool(kept), bool(expired))


def status(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> JobStatus:
    """Job `job_id` as it is now (sql.job_status); JobNotFound when neither table has it, or its
    kept outcome expired (the cleaner may not have removed it yet). `sql`: the catalogue of the
    App's schema (fastjobs.sql.of), as for every function here."""
    with schema.required(sql.SCHEMA), psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        _json(cur)
        return _unexpired(_found(job_id, cur.execute(sql.job_status, (job_id,)).fetchone()))


def _unexpired(found: _Found) -> JobStatus:
    if found.expired:
        raise JobNotFound(_EXPIRED.format(job_id=found.status.job_id))
    return found.status


_EXPIRED = "job {job_id}'s kept outcome expired (its keep_result ran out)"


def _json(cur: psycopg.RawCursor[Any] | psycopg.AsyncRawCursor[Any]) -> None:
    """Decode json and jsonb on this cursor whatever the caller's connection does with them
    (Django's loads jsonb as text, for its JSONField to decode)."""
    set_json_loads(orjson.loads, cur)


async def status_async(conn: psycopg.AsyncConnection[Any], job_id: int, sql: ModuleType = sql) -> JobStatus:
    with schema.required(sql.SCHEMA):
        async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
            _json(cur)
            await cur.execute(sql.job_status, (job_id,))
            return _unexpired(_found(job_id, await cur.fetchone()))


def outcome(found: _Found) -> tuple[bool, Any]:
    """(True, value) when the job's outcome is known (raising JobFailed or JobCancelled for one
    without a value), (False, None) while it may still come; JobNotFound when it never will."""
    job = found.status
    job_id, state = job.job_id, job.state
    if found.expired:
        raise JobNotFound(_EXPIRED.format(job_id=job_id))
    last = job.errors[-1].get("error") if job.errors and isinstance(job.errors[-1], dict) else None
    if state == "discarded":
        raise JobFailed(
            job_id,
            job.errors,
            f"job {job_id} ({job.kind}) was discarded after {job.attempt} attempt(s)"
            + (f": {last}" if last else ""),
        )
    if state == "cancelled":
        raise JobCancelled(
            job_id, job.errors, f"job {job_id} ({job.kind}) was cancelled" + (f": {last}" if last else "")
        )
    if state == "completed":
        if not found.kept:
            raise JobNotFound(
                f"job {job_id} ({job.kind}) completed, but was enqueued without keep_result:"
                " its return value was not kept"
            )
        return True, job.value
    if not found.kept and found.keep_result is None:
        raise JobNotFound(
            f"job {job_id} ({job.kind}) was enqueued without keep_result: its result will not be kept"
            " (give @app.job(keep_result=SECONDS) or .options(keep_result=SECONDS))"
        )
    return False, None


def _concerns(job_id: int, payload: str) -> bool:
    """Whether a RESULT_CHANNEL notification may be about `job_id` ('' says: look again)."""
    return not payload or str(job_id) in payload.split(",")


def _timeout_error(job_id: int, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"job {job_id} did not finish within {timeout:g}s (it is left as it is)")


def wait(conn: psycopg.Connection[Any], job_id: int, timeout: float | None, sql: ModuleType = sql) -> Any:
    """The value of job `job_id` once it is kept, woken by its notification (see the module)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with schema.required(sql.SCHEMA), psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        cur.execute(sql.listen_result)
        try:
            while True:
                done, value = outcome(_found(job_id, cur.execute(sql.job_status, (job_id,)).fetchone()))
                if done:
                    return value
                while True:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _timeout_error(job_id, timeout)
                    heard = [n.payload for n in conn.notifies(timeout=left, stop_after=1)]
                    if any(_concerns(job_id, payload) for payload in heard):
                        break
        finally:
            if not conn.closed:
                cur.execute(sql.unlisten_result)


async def wait_async(
    conn: psycopg.AsyncConnection[Any], job_id: int, timeout: float | None, sql: ModuleType = sql
) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    with schema.required(sql.SCHEMA):
        async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
            await cur.execute(sql.listen_result)
            try:
                while True:
                    await cur.execute(sql.job_status, (job_id,))
                    done, value = outcome(_found(job_id, await cur.fetchone()))
                    if done:
                        return value
                    while True:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise _timeout_error(job_id, timeout)
                        heard = [n.payload async for n in conn.notifies(timeout=left, stop_after=1)]
                        if any(_concerns(job_id, payload) for payload in heard):
                            break
            finally:
                if not conn.closed:
                    await cur.execute(sql.unlisten_result)


class JobResults(Connected):
    """The App's reads of what became of a job: its status now, or its result once it ends."""

    def status(self, job_id: int, *, conn: Conn | None = None) -> JobStatus:
        """What job `job_id` is now, without waiting: from the jobs table, or from the kept results
        (a job enqueued with keep_result, after it ended). Raises JobNotFound when neither has it."""
        with self._on(self._adapted(conn)) as db:
            return status(db, job_id, self._sql)

    async def status_async(self, job_id: int, *, conn: AsyncConn | None = None) -> JobStatus:
        """`status` on a `psycopg.AsyncConnection` (the caller's, or one of fastjobs')."""
        async with self._on_async(await self._adapted_async(conn)) as db:
            return await status_async(db, job_id, self._sql)

    def result(self, job_id: int, timeout: float | None = None) -> Any:
        """The value job `job_id` returned, waiting for it to finish (at most `timeout` seconds).

        Only a job enqueued with keep_result keeps it. Raises JobFailed (with
        the job's `errors`) if the job was discarded, JobCancelled if it was
        cancelled, TimeoutError (leaving the job alone) if it did not finish
        in time, and JobNotFound, saying why, if there is nothing to wait
        for: no such job, one without keep_result, or a result expired. The
        wait issues no query: it is woken by the notification of its outcome.
        """
        with self.connection() as own:
            return wait(own, job_id, timeout, self._sql)

    async def result_async(self, job_id: int, timeout: float | None = None) -> Any:
        """`result` in an event loop, on one of fastjobs' async connections."""
        async with self.connection_async() as own:
            return await wait_async(own, job_id, timeout, self._sql)


class JobHandle(int):
    """What an enqueue returns: the job's id (an int, as before), that can also wait for its result."""

    _app: App

    def __new__(cls, job_id: int, app: App) -> JobHandle:
        handle = super().__new__(cls, job_id)
        handle._app = app
        return handle

    def result(self, timeout: float | None = None) -> Any:
        """`App.result` of this job."""
        return self._app.result(int(self), timeout=timeout)

    async def result_async(self, timeout: float | None = None) -> Any:
        """`App.result_async` of this job."""
        return await self._app.result_async(int(self), timeout=timeout)

    def status(self) -> JobStatus:
        """`App.status` of this job."""
        return self._app.status(int(self))

    async def status_async(self) -> JobStatus:
        """`App.status_async` of this job."""
        return await self._app.status_async(int(self))

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (and copies) as the plain id
        return (int, (int(self),))
