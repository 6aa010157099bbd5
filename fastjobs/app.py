"""The App: configuration, the job registry, and the handle `@app.job` returns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import difflib
import functools
import inspect
import os
import select
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeAlias, TypedDict, TypeVar, Unpack, overload

import psycopg

from . import control, database, enqueue, middleware, queues, results, schema, sql, typed
from .cron import Cron
from .enqueue import (
    InsertParams,
    Options,
    check_keep_result,
    check_kind,
    check_max_attempts,
    check_priority,
    check_queue,
)
from .errors import UnknownKind
from .middleware import Enqueue, EnqueueMiddleware, JobMiddleware
from .queues import QueueInfo
from .results import JobHandle, JobStatus
from .retry import RetryPolicy
from .types import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE, JobSpec

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from .testing import Mode, Testing

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=Callable[..., Any])

# What `conn=` takes: a psycopg 3 connection, or a SQLAlchemy one on psycopg 3 (fastjobs.contrib.sqlalchemy).
Conn: TypeAlias = "psycopg.Connection[Any] | SAConnection | Session"
AsyncConn: TypeAlias = "psycopg.AsyncConnection[Any] | SAAsyncConnection | AsyncSession"

# Reserved for enqueue options on the job handle, so a handler cannot take it.
_RESERVED = frozenset({"conn"})


class BulkOptions(TypedDict, total=False):
    """Per-call options of the enqueue methods; each defaults to the kind's registration."""

    queue: str | None
    priority: int | None
    run_at: dt.datetime | None  # timezone-aware
    delay: float | dt.timedelta | None  # seconds
    max_attempts: int | None
    keep_result: float | dt.timedelta | None  # seconds the outcome is kept (App.result)
    wait_for_room: float | None  # seconds to wait while the queue is at its max_backlog (else QueueFull)


class EnqueueOptions(BulkOptions, total=False):
    unique_key: str | None


class App:
    """A set of registered jobs and the database they live in.

    The DSN is resolved on first use: `dsn` > FASTJOBS_DSN > DATABASE_URL;
    "embedded" chooses the embedded PostgreSQL (the `embedded` extra), and
    none at all is a ConfigurationError: an App never falls back on it.

    An App that knows kinds (registered with `@app.job`, or declared with
    `app.declare` for handlers that run in another service) refuses to
    enqueue any other: a typo fails at the call, not 25 attempts later at a
    worker. An App that knows none is a pure producer and enqueues any kind
    (River's insert-only client; Celery's `send_task`).

    `schema` (else FASTJOBS_SCHEMA) keeps fastjobs' tables in a PostgreSQL
    schema of their own, for a database shared with other applications:
    `fastjobs migrate --schema NAME` creates it, and every statement names
    it, enqueues on the caller's connection too (their search_path is left
    alone). Without one, the tables are found on the session's search_path,
    `public` by default (docs/operations/schemas.md).
    """

    def __init__(self, dsn: str | None = None, *, schema: str | None = None) -> None:
        self._dsn = dsn
        # The catalogue of the schema: the statements every enqueue, worker and command sends.
        self._sql: ModuleType = sql.of(database.resolve_schema(schema))
        self.jobs: dict[str, JobSpec] = {}
        # Kinds enqueued here whose handlers run elsewhere: never run by this app's workers.
        self.declared: dict[str, JobSpec] = {}
        self._pool = _Pool()
        self._backpressure = queues.Backpressure(self.connection, self.connection_async, self._sql)
        self._async_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary()
        )
        # The testing kit in inline mode (fastjobs.testing): told of each enqueue.
        self._testing: Testing | None = None
        self._middleware: list[JobMiddleware] = []
        # Enqueue middleware of the sync enqueue methods, and of the async ones.
        self._enqueue_middleware: list[EnqueueMiddleware] = []
        self._enqueue_middleware_async: list[EnqueueMiddleware] = []

    @property
    def dsn(self) -> str:
        if self._dsn is None or self._dsn == database.EMBEDDED:
            self._dsn = database.resolve_dsn(self._dsn)
        return self._dsn

    @property
    def schema(self) -> str | None:
        """The schema of fastjobs' tables (None: the search_path's)."""
        schema: str | None = self._sql.SCHEMA
        return schema

    @property
    def sql(self) -> ModuleType:
        """The statements of this app's schema: `fastjobs.sql.of(app.schema)`."""
        return self._sql

    def configure(self, *, dsn: str | None = None, schema: str | None = None) -> None:
        """Point the app at another database, or schema (`fastjobs --dsn/--schema` do, after
        importing the app).

        `dsn` takes the place of the one given to the constructor or
        resolved from the environment, `schema` of its schema. Idle pooled connections to the
        previous database are closed, and those in use at the time are closed
        when given back: nothing enqueued from here on goes there. A Worker
        reads the DSN when it starts: configure before running workers.
        """
        if (dsn is not None or schema is None) and (not isinstance(dsn, str) or not dsn):
            raise ValueError(f"dsn must be a non-empty string, not {dsn!r} (or give schema= alone)")
        catalogue = self._sql if schema is None else sql.of(sql.schema_name(schema))
        self.close()
        self._dsn = self._dsn if dsn is None else dsn
        if catalogue is not self._sql:
            self._sql = catalogue
            self._backpressure = queues.Backpressure(self.connection, self.connection_async, catalogue)

    @overload
    def job(self, kind: Callable[P, R], /) -> Job[P, R]: ...

    @overload
    def job(
        self,
        kind: str | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        unique: bool | tuple[str, ...] | list[str] = False,
        cron: str | None = None,
        tz: str | None = None,
        keep_result: float | dt.timedelta | None = None,
    ) -> Callable[[Callable[P, R]], Job[P, R]]: ...

    def job(
        self,
        kind: str | Callable[P, R] | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        unique: bool | tuple[str, ...] | list[str] = False,
        cron: str | None = None,
        tz: str | None = None,
        keep_result: float | dt.timedelta | None = None,
    ) -> Callable[[Callable[P, R]], Job[P, R]] | Job[P, R]:
        """Register a handler (`def` or `async def`); `@app.job` bare is `@app.job()`.

        `kind`, the name stored on each job row, defaults to the function's
        `module.qualname`: renaming or moving the function changes it, so pass
        an explicit kind for jobs that must outlive a refactor. `retry(attempt,
        rand)` returns the seconds to wait after a failed attempt (default:
        fastjobs.retry.default_backoff). `unique=True` (or a list of argument
        names) derives a unique key from the args: a duplicate enqueued while
        the first is pending or running returns the first's id. `cron`
        (5 fields or a shorthand such as "@daily"; the `cron` extra) makes the
        leader enqueue the job, without args, once per tick across the
        cluster, the expression read in the IANA time zone `tz` (default UTC).
        `keep_result` (seconds or a timedelta) keeps each job's return value,
        or the errors it was discarded or cancelled with, that long after it
        ends, for `App.result` and `App.status` (docs/guides/results.md).
        """
        func: Callable[P, R] | None = None
        if callable(kind):  # bare `@app.job`: the function came as `kind`
            func, kind = kind, None
        elif kind is not None and not isinstance(kind, str):
            raise TypeError(f"kind must be a string, not {kind!r}")
        check_queue(queue)
        check_priority(priority)
        check_max_attempts(max_attempts)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if cron is not None:
            Cron(cron, tz)  # a bad expression or zone fails at registration, naming the field
        elif tz is not None:
            raise ValueError("tz= is the time zone of a cron schedule: give cron= too")
        unique_by: bool | tuple[str, ...] = unique if isinstance(unique, bool) else tuple(unique)
        keep = check_keep_result(keep_result)

        def register(func: Callable[P, R]) -> Job[P, R]:
            name = kind or f"{func.__module__}.{func.__qualname__}"
            if name in self.jobs and self.jobs[name].func is not func:
                raise ValueError(f"job kind {name!r} is already registered to {self.jobs[name].func!r}")
            if name in self.declared:
                raise ValueError(f"job kind {name!r} is declared as handled elsewhere (app.declare)")
            params, required = _signature(func)
            args_schema = typed.schema(name, func)  # an annotation it cannot store fails here
            if cron is not None and required:
                raise TypeError(
                    f"{name}: a cron job is enqueued without args, but requires {sorted(required)}"
                )
            if isinstance(unique_by, tuple) and params is not None and not params.issuperset(unique_by):
                raise TypeError(
                    f"{name}: unique= names {sorted(set(unique_by) - params)}, not arguments of it"
                )
            spec = JobSpec(
                kind=name,
                func=func,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                timeout=timeout,
                is_async=inspect.iscoroutinefunction(func),
                params=params,
                required=required,
                retry=retry,
                unique=unique_by,
                cron=cron,
                tz=tz,
                args_schema=args_schema,
                keep_result=keep,
            )
            self.jobs[name] = spec
            return Job(self, spec)

        return register if func is None else register(func)

    def declare(
        self,
        kind: str,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        unique: bool | tuple[str, ...] | list[str] = False,
        keep_result: float | dt.timedelta | None = None,
    ) -> Job[..., None]:
        """Declare a kind whose handler runs in another service, so that this app may enqueue it.

        Its enqueues use these defaults (give the ones the handler is
        registered with there); the args are not checked. This app's workers
        never run it, nor serve its queue. Returns a handle to enqueue it with.
        """
        check_queue(queue)
        check_priority(priority)
        check_max_attempts(max_attempts)
        check_kind(kind)
        if kind in self.jobs:
            raise ValueError(f"job kind {kind!r} is registered here to {self.jobs[kind].func!r}")

        def elsewhere(**args: Any) -> None:
            raise TypeError(f"job kind {kind!r} is declared here but runs elsewhere: enqueue it")

        spec = JobSpec(
            kind=kind,
            func=elsewhere,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            unique=unique if isinstance(unique, bool) else tuple(unique),
            keep_result=check_keep_result(keep_result),
        )
        self.declared[kind] = spec
        return Job(self, spec)

    def _spec(self, kind: str) -> JobSpec | None:
        """The spec an enqueue of `kind` uses: None in an app that knows no kinds; else UnknownKind."""
        try:
            spec = self.jobs.get(kind)
        except TypeError:  # unhashable: no kind at all, which enqueue.options says
            return None
        if spec is not None:
            return spec
        spec = self.declared.get(kind)
        if spec is not None or not (self.jobs or self.declared):
            return spec
        check_kind(kind)  # an empty or overlong kind is refused as such
        known = sorted(self.jobs.keys() | self.declared.keys())
        close = _close_matches(kind, known)
        if close:
            hint = f"did you mean {' or '.join(map(repr, close))}?"
        else:
            hint = f"it knows {', '.join(map(repr, known[:5]))}" + (", ..." if len(known) > 5 else "")
        raise UnknownKind(
            f"job kind {kind!r} is not registered on this App: {hint} "
            f"(a kind whose handler runs in another service: app.declare({kind!r}, queue=...) first)"
        )

    def middleware(self, func: M) -> M:
        """Register a job middleware, `mw(job, call_next)`, around every job's execution.

        A `def` one wraps the `def` handlers, an `async def` one the `async
        def` handlers; they run in registration order, the first outermost.
        See fastjobs.middleware. A worker composes them when it starts.
        """
        if not callable(func):
            raise TypeError(f"middleware must be callable, not {func!r}")
        self._middleware.append(func)
        return func

    def enqueue_middleware(self, func: M) -> M:
        """Register an enqueue middleware, `mw(enqueue, call_next)`, around every enqueue call.

        It sees each call (one job, or many: one `fastjobs.Enqueue`), may add
        to `enqueue.meta`, stored on every job of the call, and refuses the
        enqueue by raising. A `def` one wraps `enqueue` and `enqueue_many`, an
        `async def` one their async versions.
        """
        if not callable(func):
            raise TypeError(f"enqueue middleware must be callable, not {func!r}")
        chain = self._enqueue_middleware_async if middleware.is_async(func) else self._enqueue_middleware
        chain.append(func)
        return func

    @property
    def has_middleware(self) -> bool:
        """Whether jobs run behind middleware (then workers fill each JobContext whole)."""
        return bool(self._middleware)

    def runnable(self) -> dict[str, JobSpec]:
        """The registered specs as a worker runs them, taken once when it starts.

        Each spec's `call` is where the handler gets wrapped (middleware,
        argument conversion); a spec with nothing to wrap keeps `call=None`,
        so the hot loop calls the handler itself.
        """
        specs = {}
        for kind, spec in self.jobs.items():
            call = typed.converter(spec)  # the annotated types from JSON, for kinds that need it
            specs[kind] = spec if call is None else dataclasses.replace(spec, call=call)
        if self._middleware:  # around the handler's call, argument conversion included
            specs = {kind: middleware.wrap(spec, self._middleware) for kind, spec in specs.items()}
        return specs

    def enqueue(
        self,
        kind: str,
        args: dict[str, Any] | None = None,
        *,
        conn: Conn | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> JobHandle:
        """Insert one job and return its id (a JobHandle: an int that can wait for its result).

        With `conn` (a psycopg 3 connection, or a SQLAlchemy Connection or
        Session on psycopg 3), the job joins the caller's transaction: it
        exists (and is visible to workers) only once that transaction commits. With a
        `unique_key` (or a kind registered with `unique=`) held by a job still
        pending or running, nothing is inserted and that job's id is returned.
        """
        opts = enqueue.options(kind, self._spec(kind), **options)
        params = enqueue.insert_params(opts, args)  # bad args fail before a connection is taken
        db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
        self._backpressure.check(opts.queue, opts.wait_for_room, db)
        if not self._enqueue_middleware:
            return JobHandle(self._insert(params, db), self)
        if db is not None:
            enqueue.check_conn(db, psycopg.Connection)
        call = _enqueue_call(opts, {} if args is None else args)
        with self._chain_target(db) as target:

            def insert() -> int:
                return enqueue.insert(target, _with_meta(params, call), self._sql)

            job_id = middleware.run_enqueue(self._enqueue_middleware, call, insert)
        if self._testing is not None:
            self._testing.inserted(db)
        return JobHandle(job_id, self)

    @contextlib.contextmanager
    def _chain_target(self, conn: psycopg.Connection[Any] | None) -> Iterator[psycopg.Connection[Any]]:
        """Where an enqueue behind middleware inserts: the caller's connection, or one of fastjobs'
        own in a transaction around the whole chain, so that a middleware raising after
        call_next() (or calling it twice) leaves nothing inserted, as raising promises."""
        if conn is not None:
            yield conn
            return
        with self.connection() as own, own.transaction():
            yield own

    @contextlib.asynccontextmanager
    async def _chain_target_async(
        self, conn: psycopg.AsyncConnection[Any] | None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if conn is not None:
            yield conn
            return
        async with self.connection_async() as own, own.transaction():
            yield own

    def _insert(self, params: InsertParams, conn: psycopg.Connection[Any] | None) -> int:
        if conn is not None:
            enqueue.check_conn(conn, psycopg.Connection)
            job_id = enqueue.insert(conn, params, self._sql)
        else:
            with self.connection() as own:
                job_id = enqueue.insert_own(own, params, self._sql)
        if self._testing is not None:
            self._testing.inserted(conn)
        return job_id

    def enqueue_many(
        self,
        kind: str,
        args_iterable: Iterable[dict[str, Any]],
        *,
        conn: Conn | None = None,
        **options: Unpack[BulkOptions],
    ) -> int:
        """Insert many jobs of one kind with one binary COPY; return the count inserted.

        All or nothing: arguments that cannot be stored raise TypeError and
        none of the call's jobs is inserted. Workers are notified once. With
        `conn`, the jobs exist only once the caller's transaction commits.
        For a kind registered with `unique=`, jobs whose key is taken (or
        repeated in the call) are skipped and not counted.
        """
        opts = enqueue.options(kind, self._spec(kind), **options)
        db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.Connection)
        self._backpressure.check(opts.queue, opts.wait_for_room, db)
        if not self._enqueue_middleware:
            count = self._copy(opts, args_iterable, None, db)
        else:
            call = _enqueue_call(opts, None)
            with self._chain_target(db) as target:

                def copy() -> int:
                    return enqueue.copy_many(
                        target, opts, args_iterable, enqueue.dump_meta(call.meta), self._sql
                    )

                count = middleware.run_enqueue(self._enqueue_middleware, call, copy)
        if self._testing is not None:
            self._testing.inserted(db)
        return count

    def _copy(
        self,
        opts: Options,
        rows: Iterable[dict[str, Any]],
        meta: bytes | None,
        conn: psycopg.Connection[Any] | None,
    ) -> int:
        if conn is not None:
            return enqueue.copy_many(conn, opts, rows, meta, self._sql)
        with self.connection() as own:
            return enqueue.copy_many(own, opts, rows, meta, self._sql)

    async def enqueue_async(
        self,
        kind: str,
        args: dict[str, Any] | None = None,
        *,
        conn: AsyncConn | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> JobHandle:
        """`enqueue` on a `psycopg.AsyncConnection` (the caller's, or one of fastjobs'), or a
        SQLAlchemy AsyncConnection or AsyncSession on psycopg 3."""
        opts = enqueue.options(kind, self._spec(kind), **options)
        params = enqueue.insert_params(opts, args)
        # adapt_async's own test, inline: the usual enqueue creates no coroutine for it.
        db: psycopg.AsyncConnection[Any] | None = (
            conn
            if conn is None or isinstance(conn, psycopg.AsyncConnection)
            else await enqueue.adapt_async(conn)
        )
        await self._backpressure.check_async(opts.queue, opts.wait_for_room, db)
        if not self._enqueue_middleware_async:
            return JobHandle(await self._insert_async(params, db), self)
        if db is not None:
            enqueue.check_conn(db, psycopg.AsyncConnection)
        call = _enqueue_call(opts, {} if args is None else args)
        async with self._chain_target_async(db) as target:

            async def insert() -> int:
                return await enqueue.insert_async(target, _with_meta(params, call), self._sql)

            job_id = await middleware.run_enqueue_async(self._enqueue_middleware_async, call, insert)
        if self._testing is not None:
            await self._testing.inserted_async(db)
        return JobHandle(job_id, self)

    async def _insert_async(self, params: InsertParams, conn: psycopg.AsyncConnection[Any] | None) -> int:
        if conn is not None:
            enqueue.check_conn(conn, psycopg.AsyncConnection)
            job_id = await enqueue.insert_async(conn, params, self._sql)
        else:
            async with self.connection_async() as own:
                job_id = await enqueue.insert_async(own, params, self._sql)
        if self._testing is not None:
            await self._testing.inserted_async(conn)
        return job_id

    async def enqueue_many_async(
        self,
        kind: str,
        args_iterable: Iterable[dict[str, Any]],
        *,
        conn: AsyncConn | None = None,
        **options: Unpack[BulkOptions],
    ) -> int:
        """`enqueue_many` on a `psycopg.AsyncConnection` (the caller's, or one of fastjobs'), or a
        SQLAlchemy AsyncConnection or AsyncSession on psycopg 3."""
        opts = enqueue.options(kind, self._spec(kind), **options)
        db: psycopg.AsyncConnection[Any] | None = await enqueue.adapt_async(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.AsyncConnection)
        await self._backpressure.check_async(opts.queue, opts.wait_for_room, db)
        if not self._enqueue_middleware_async:
            count = await self._copy_async(opts, args_iterable, None, db)
        else:
            call = _enqueue_call(opts, None)
            async with self._chain_target_async(db) as target:

                async def copy() -> int:
                    return await enqueue.copy_many_async(
                        target, opts, args_iterable, enqueue.dump_meta(call.meta), self._sql
                    )

                count = await middleware.run_enqueue_async(self._enqueue_middleware_async, call, copy)
        if self._testing is not None:
            await self._testing.inserted_async(db)
        return count

    async def _copy_async(
        self,
        opts: Options,
        rows: Iterable[dict[str, Any]],
        meta: bytes | None,
        conn: psycopg.AsyncConnection[Any] | None,
    ) -> int:
        if conn is not None:
            return await enqueue.copy_many_async(conn, opts, rows, meta, self._sql)
        async with self.connection_async() as own:
            return await enqueue.copy_many_async(own, opts, rows, meta, self._sql)

    def periodic(
        self,
        cron: str,
        *,
        kind: str | None = None,
        queue: str = DEFAULT_QUEUE,
        tz: str | None = None,
        **options: Any,
    ) -> Callable[[Callable[P, R]], Job[P, R]]:
        """Register a job the leader enqueues once per tick of `cron` ("*/5 * * * *"), read in
        the IANA time zone `tz` (default UTC)."""
        return self.job(kind, queue=queue, cron=cron, tz=tz, **options)

    def testing(self, mode: Mode = "manual", *, dsn: str | None = None) -> Testing:
        """The testing kit for this app (docs/guides/testing.md); use it as a context manager.

        `manual` (the default): enqueued jobs wait until `drain()` runs them.
        `inline`: each enqueue runs its job at once through the worker's code
        path, or, with `conn=` inside a transaction, when that transaction
        commits (never if it rolls back). With `dsn`, the app uses that
        database inside the block and its own again after.
        """
        from .testing import Testing  # imported on use: importing fastjobs never loads the kit

        return Testing(self, mode, dsn=dsn)

    def cancel(self, job_id: int, *, conn: Conn | None = None) -> str:
        """Cancel a job; returns what became of it.

        A queued job (available, scheduled, retryable) is `cancelled` at once.
        A running one is told: an async handler is cancelled, a sync one can
        check `fastjobs.current_job().cancelled`; it finishes as `cancelled`
        ("cancelling" is returned). A finished job is left alone and its
        state returned. Raises JobNotFound for an unknown id.
        """
        with schema.required(self.schema):
            db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
            if db is not None:
                enqueue.check_conn(db, psycopg.Connection)
                return control.cancel(db, job_id, self._sql)
            with self.connection() as own:
                return control.cancel(own, job_id, self._sql)

    def pause(self, queue: str, *, conn: Conn | None = None) -> dt.datetime:
        """Pause `queue`: every worker stops taking its jobs (those started finish), enqueues go on.

        Effective when the transaction commits (on `conn=`, the caller's);
        returns since when it is paused. See fastjobs.queues.
        """
        return self._on_queue(lambda db, name: queues.pause(db, name, self._sql), queue, conn)

    def resume(self, queue: str, *, conn: Conn | None = None) -> bool:
        """Resume `queue` and wake its workers; False when it was not paused."""
        return self._on_queue(lambda db, name: queues.resume(db, name, self._sql), queue, conn)

    def limit_queue(
        self,
        queue: str,
        *,
        concurrency: int | None = queues.UNCHANGED,
        max_backlog: int | None = queues.UNCHANGED,
        rate_limit: str | None = queues.UNCHANGED,
        conn: Conn | None = None,
    ) -> None:
        """Set `queue`'s limits, stored in the database: every worker and producer, no restart.

        `concurrency`: at most this many of its jobs run at once across the
        cluster (from the next claim; the queue takes the state lane). None
        removes a limit; a limit not given stays as it is.

        `rate_limit`: at most N of its jobs start per period, across the
        cluster: "200/s", "1000/min", "50/h" (a token bucket holding one
        second's worth: a burst after a quiet spell is at most that).

        `max_backlog`: hold producers back while this many of its jobs wait:
        an enqueue into the queue raises QueueFull, or waits up to its
        `wait_for_room=` seconds for room. The backlog is the leader's count,
        at most a second or two old, so a burst can overshoot the limit by
        what producers enqueue in that time. See fastjobs.queues.
        """
        self._on_queue(
            lambda db, name: queues.limit(
                db,
                name,
                concurrency=concurrency,
                max_backlog=max_backlog,
                rate_limit=rate_limit,
                sql=self._sql,
            ),
            queue,
            conn,
        )

    def queues(self) -> list[QueueInfo]:
        """Every queue acted on or holding jobs: paused or not, its jobs waiting and running."""
        with schema.required(self.schema), self.connection() as own:
            return queues.list_queues(own, self._sql)

    def _on_queue(self, act: Callable[[psycopg.Connection[Any], str], R], queue: str, conn: Conn | None) -> R:
        with schema.required(self.schema):
            db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
            if db is not None:
                enqueue.check_conn(db, psycopg.Connection)
                return act(db, queue)
            with self.connection() as own:
                return act(own, queue)

    def status(self, job_id: int, *, conn: Conn | None = None) -> JobStatus:
        """What job `job_id` is now, without waiting: from the jobs table, or from the kept results
        (a job enqueued with keep_result, after it ended). Raises JobNotFound when neither has it."""
        db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.Connection)
            return results.status(db, job_id, self._sql)
        with self.connection() as own:
            return results.status(own, job_id, self._sql)

    async def status_async(self, job_id: int, *, conn: AsyncConn | None = None) -> JobStatus:
        """`status` on a `psycopg.AsyncConnection` (the caller's, or one of fastjobs')."""
        db: psycopg.AsyncConnection[Any] | None = await enqueue.adapt_async(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.AsyncConnection)
            return await results.status_async(db, job_id, self._sql)
        async with self.connection_async() as own:
            return await results.status_async(own, job_id, self._sql)

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
            return results.wait(own, job_id, timeout, self._sql)

    async def result_async(self, job_id: int, timeout: float | None = None) -> Any:
        """`result` in an event loop, on one of fastjobs' async connections."""
        async with self.connection_async() as own:
            return await results.wait_async(own, job_id, timeout, self._sql)

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit connection of fastjobs' own pool, opened lazily."""
        with self._pool.connection(self.dsn) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def connection_async(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """An autocommit async connection, pooled per event loop."""
        dsn = self.dsn
        loop = asyncio.get_running_loop()
        idle = self._async_pools.get(loop)
        if idle is None:
            # A loop that ends (asyncio.run, a test's) takes its pool with it:
            # its connections are closed then, not left to warn when collected.
            idle = self._async_pools[loop] = []
            weakref.finalize(loop, _finish, idle)
        conn = idle.pop() if idle else await database.connect_async(dsn, autocommit=True)
        try:
            yield conn
        except BaseException:
            await conn.close()
            raise
        if not conn.closed and len(idle) < _Pool.MAX_IDLE and dsn == self._dsn:
            idle.append(conn)
        else:
            await conn.close()

    def close(self) -> None:
        """Close the pooled connections (a forked child drops its parent's without closing).

        Idle async connections are closed at the libpq level, which needs no
        event loop; `aclose` closes them the regular way.
        """
        self._pool.close()
        for idle in list(self._async_pools.values()):
            _finish(idle)

    async def aclose(self) -> None:
        """Close the pooled connections, the async ones of the running loop through their loop."""
        idle = self._async_pools.pop(asyncio.get_running_loop(), [])
        while idle:
            await idle.pop().close()
        self.close()


class Job(Generic[P, R]):
    """What `@app.job` returns: call it to run the handler inline, `.enqueue` to queue it.

    `enqueue` takes the handler's own arguments, so type checkers check a call
    against the handler's signature (ParamSpec). The connection to enqueue
    in goes through `using(conn)`; `enqueue(conn=...)` works too, unchecked.
    """

    def __init__(
        self,
        app: App,
        spec: JobSpec,
        conn: Conn | AsyncConn | None = None,
        **defaults: Unpack[BulkOptions],
    ) -> None:
        self._func: Callable[P, R] = spec.func
        self.app = app
        self.spec = spec
        self.kind = spec.kind
        self._conn = conn
        self._defaults = defaults
        self.__wrapped__ = spec.func
        self.__doc__ = spec.func.__doc__

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._func(*args, **kwargs)

    def options(self, **options: Unpack[BulkOptions]) -> Job[P, R]:
        """A handle whose enqueues use these options (they would clash with argument names)."""
        given = {k: v for k, v in options.items() if v is not None}
        merged: BulkOptions = {**self._defaults, **given}  # type: ignore[typeddict-item]
        enqueue.options(self.kind, self.spec, **merged)  # bad options fail here, not at enqueue
        return Job(self.app, self.spec, self._conn, **merged)

    def using(self, conn: Conn | AsyncConn) -> Job[P, R]:
        """A handle that enqueues in `conn`'s transaction: the jobs exist once it commits.

        A `psycopg.AsyncConnection` (or a SQLAlchemy AsyncConnection or
        AsyncSession) serves the `_async` methods; the enqueue checks the
        connection further, as it checks a `conn=`.
        """
        sqlalchemy = enqueue.is_sqlalchemy(conn)
        if not isinstance(conn, psycopg.Connection | psycopg.AsyncConnection) and not sqlalchemy:
            raise enqueue.foreign_conn(conn, "using() takes a psycopg 3 Connection or AsyncConnection")
        return Job(self.app, self.spec, conn, **self._defaults)

    def args(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """The handler's arguments as the dict `enqueue_many` takes, checked by type checkers like a call."""
        return self._named(args, dict(kwargs))

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional arguments given their parameters' names (jobs store keyword arguments only)."""
        if not args:
            return kwargs
        names = self._positional
        if len(args) > len(names):
            raise TypeError(f"{self.kind} takes {len(names)} positional argument(s), {len(args)} given")
        for name, value in zip(names, args, strict=False):
            if name in kwargs:
                raise TypeError(f"{self.kind} got multiple values for argument {name!r}")
            kwargs[name] = value
        return kwargs

    @functools.cached_property
    def _positional(self) -> list[str]:
        """The names positional arguments of an enqueue fill, in order."""
        params = inspect.signature(self.spec.func).parameters.values()
        return [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

    # The App's methods check the connection (enqueue.check_conn), whichever way it came.
    def _conn_for(self, conn: Any) -> Any:
        """The call's `conn=`, else the one bound by `using`."""
        return self._conn if conn is None else conn

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """Enqueue one job with the handler's arguments; returns its id (a JobHandle)."""
        named = dict(kwargs)
        conn = self._conn_for(named.pop("conn", None))
        return self.app.enqueue(self.kind, self._named(args, named), conn=conn, **self._defaults)

    def enqueue_many(self, args_iterable: Iterable[dict[str, Any]], *, conn: Conn | None = None) -> int:
        """Enqueue one job per argument dict with one COPY; returns the count.

        `job.args(...)` builds a dict a type checker checks like a call.
        """
        return self.app.enqueue_many(self.kind, args_iterable, conn=self._conn_for(conn), **self._defaults)

    async def enqueue_async(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        named = dict(kwargs)
        conn = self._conn_for(named.pop("conn", None))
        return await self.app.enqueue_async(self.kind, self._named(args, named), conn=conn, **self._defaults)

    async def enqueue_many_async(
        self, args_iterable: Iterable[dict[str, Any]], *, conn: AsyncConn | None = None
    ) -> int:
        return await self.app.enqueue_many_async(
            self.kind, args_iterable, conn=self._conn_for(conn), **self._defaults
        )

    def __repr__(self) -> str:
        return f"<fastjobs.Job {self.kind!r} queue={self.spec.queue!r}>"


def _close_matches(kind: str, known: list[str]) -> list[str]:
    """Up to 3 known kinds like `kind`, whole or by their last dotted part (`send_welcome` finds
    `app.jobs.send_welcome`, whose whole name is too long for difflib's ratio alone).

    The dotted prefix both share is left out of the comparison: `shop.jobs.` alone would make
    every kind of the module look like `shop.jobs.send_emial`.
    """
    tail = kind.rpartition(".")[2]
    parts = kind.split(".")
    scored = []
    for name in known:
        other = name.split(".")
        shared = 0
        while shared < min(len(parts), len(other)) - 1 and parts[shared] == other[shared]:
            shared += 1
        whole = difflib.SequenceMatcher(None, ".".join(parts[shared:]), ".".join(other[shared:])).ratio()
        last = difflib.SequenceMatcher(None, tail, name.rpartition(".")[2]).ratio()
        if max(whole, last) >= 0.6:  # difflib.get_close_matches' default cutoff
            scored.append((-max(whole, last), name))
    return [name for _, name in sorted(scored)[:3]]


def _enqueue_call(opts: Options, args: dict[str, Any] | None) -> Enqueue:
    """What enqueue middleware sees of a call: `args` for one job, None for many."""
    return Enqueue(
        opts.kind,
        opts.queue,
        opts.priority,
        opts.max_attempts,
        opts.run_at,
        opts.delay,
        many=args is None,
        args=args,
    )


def _with_meta(params: InsertParams, call: Enqueue) -> InsertParams:
    """sql.job_insert's parameters with the meta the middleware gave."""
    meta = enqueue.dump_meta(call.meta)
    return params if meta is None else params._replace(meta=meta.decode())


def _signature(func: Callable[..., Any]) -> tuple[frozenset[str] | None, frozenset[str]]:
    """Names a handler accepts (None with **kwargs) and those it requires.

    Jobs are called with keyword arguments only, so positional-only
    parameters and *args cannot be filled from a job's args: *args is
    refused at registration rather than left empty at every call.
    """
    params: set[str] = set()
    required: set[str] = set()
    open_ended = False
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            open_ended = True
        elif p.kind is p.VAR_POSITIONAL:
            raise TypeError(
                f"{func.__qualname__}: *{p.name} can never receive anything: a job's args are passed by"
                " name; name each argument, or take **kwargs"
            )
        elif p.kind is p.POSITIONAL_ONLY:
            if p.default is p.empty:
                raise TypeError(
                    f"{func.__qualname__}: positional-only parameter {p.name!r} cannot be a job argument"
                )
        else:
            params.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
    if reserved := params & _RESERVED:
        raise TypeError(f"{func.__qualname__}: parameter name(s) {sorted(reserved)} are reserved by fastjobs")
    return (None if open_ended else frozenset(params)), frozenset(required)


def _finish(idle: list[Any]) -> None:
    """Close idle async connections at the libpq level, which needs no event loop."""
    while idle:
        conn = idle.pop()  # held: dropped before finish(), it would warn it was left open
        conn.pgconn.finish()


def _healthy(conn: psycopg.Connection[Any]) -> bool:
    """One poll, no round trip: an idle pooled connection (which listens to
    nothing) whose socket is readable has been told FATAL or closed."""
    if conn.closed or conn.broken:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable and conn.pgconn.status == psycopg.pq.ConnStatus.OK


class _Pool:
    """A few idle autocommit connections, for enqueues made without `conn`.

    After a fork the child must not touch the parent's sockets (closing one
    would end the parent's session), so a pid change drops them unclosed. The
    idle connections are to one DSN: asked for another (App.configure), the
    pool closes them, and keeps none of the previous one given back later.
    """

    MAX_IDLE = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[psycopg.Connection[Any]] = []
        self._pid = os.getpid()
        self._dsn: str | None = None  # the DSN of the idle connections

    @contextlib.contextmanager
    def connection(self, dsn: str) -> Iterator[psycopg.Connection[Any]]:
        stale: list[psycopg.Connection[Any]] = []
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            if dsn != self._dsn:
                stale, self._idle, self._dsn = self._idle, [], dsn
            conn = self._idle.pop() if self._idle else None
        for old in stale:
            old.close()
        if conn is not None and not _healthy(conn):
            conn.close()
            conn = None
        if conn is None:
            conn = database.connect(dsn, autocommit=True)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if (
                not conn.closed
                and len(self._idle) < self.MAX_IDLE
                and self._pid == os.getpid()
                and self._dsn == dsn
            ):
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            if self._pid != os.getpid():
                return
        for conn in idle:
            conn.close()
