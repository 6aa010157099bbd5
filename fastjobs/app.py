"""The App: configuration, the job registry, and the handle `@app.job` returns."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, overload

import psycopg

from . import bulk, control, enqueue, keys, middleware, queues, schema, typed
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
from .job import AsyncConn, BulkOptions, Conn, EnqueueOptions, Job, P, R, close_kinds, spec_of
from .middleware import EnqueueMiddleware, JobMiddleware
from .queues import QueueInfo
from .results import JobHandle, JobResults
from .retry import RetryPolicy
from .types import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE, JobSpec

__all__ = ["App"]

if TYPE_CHECKING:
    from .testing import Mode, Testing

M = TypeVar("M", bound=Callable[..., Any])


class App(JobResults):
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
        super().__init__(dsn, schema=schema)
        self.jobs: dict[str, JobSpec] = {}
        # Kinds enqueued here whose handlers run elsewhere: never run by this app's workers.
        self.declared: dict[str, JobSpec] = {}
        self._backpressure = queues.Backpressure(self.connection, self.connection_async, self._sql)
        # The testing kit in inline mode (fastjobs.testing): told of each enqueue.
        self._testing: Testing | None = None
        self._middleware: list[JobMiddleware] = []
        # Enqueue middleware of the sync enqueue methods, and of the async ones.
        self._enqueue_middleware: list[EnqueueMiddleware] = []
        self._enqueue_middleware_async: list[EnqueueMiddleware] = []

    def configure(self, *, dsn: str | None = None, schema: str | None = None) -> None:
        """`Connected.configure`: a schema given also takes the backpressure reads along."""
        catalogue = self._sql
        super().configure(dsn=dsn, schema=schema)
        if self._sql is not catalogue:
            self._backpressure = queues.Backpressure(self.connection, self.connection_async, self._sql)

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
        concurrency_key: str | Callable[[dict[str, Any]], Any] | None = None,
        concurrency_limit: int | None = None,
        rate_limit: str | None = None,
        fair_key: str | Callable[[dict[str, Any]], object] | None = None,
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
        concurrency_key: str | Callable[[dict[str, Any]], Any] | None = None,
        concurrency_limit: int | None = None,
        rate_limit: str | None = None,
        fair_key: str | Callable[[dict[str, Any]], object] | None = None,
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
        `concurrency_limit` lets at most that many of its jobs run at once
        across the cluster, and `rate_limit` ("100/s", "1000/min") start at
        most that many per period: per key when `concurrency_key` (an
        argument's name, or a callable of the args dict) gives each job its
        key, else for the kind as a whole; `limit_key` sets other limits for
        some keys (docs/operations/keys.md).
        `fair_key` (an argument's name, or a callable of the args dict) gives
        each job a fairness key, computed at enqueue: its queue's claims take
        keyed jobs round-robin across keys (docs/operations/queues.md).
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
        limits = keys.declared(kind or "@app.job", concurrency_key, concurrency_limit, rate_limit)

        def register(func: Callable[P, R]) -> Job[P, R]:
            name = kind or f"{func.__module__}.{func.__qualname__}"
            if name in self.jobs and self.jobs[name].func is not func:
                raise ValueError(f"job kind {name!r} is already registered to {self.jobs[name].func!r}")
            if name in self.declared:
                raise ValueError(f"job kind {name!r} is declared as handled elsewhere (app.declare)")
            spec = spec_of(
                func,
                name,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                timeout=timeout,
                retry=retry,
                unique=unique_by,
                cron=cron,
                tz=tz,
                keep_result=keep,
                limit=limits,
                fair_key=fair_key,
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
        concurrency_key: str | Callable[[dict[str, Any]], Any] | None = None,
        concurrency_limit: int | None = None,
        rate_limit: str | None = None,
    ) -> Job[..., None]:
        """Declare a kind whose handler runs in another service, so that this app may enqueue it.

        Its enqueues use these defaults (give the ones the handler is
        registered with there, limits included: a job carries its key and
        limits from its enqueue); the args are not checked. This app's workers
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
            limit=keys.declared(kind, concurrency_key, concurrency_limit, rate_limit),
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
        close = close_kinds(kind, known)
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
        self._backpressure.check(opts.queue, opts.wait_for_room, db, opts.keyed)
        if not self._enqueue_middleware:
            return JobHandle(self._insert(params, db), self)
        if db is not None:
            enqueue.check_conn(db, psycopg.Connection)
        call = middleware.call_of(opts, {} if args is None else args)
        with middleware.chain_target(db, self.connection) as target:

            def insert() -> int:
                return enqueue.insert(target, middleware.with_meta(params, call), self._sql)

            job_id = middleware.run_enqueue(self._enqueue_middleware, call, insert)
        if self._testing is not None:
            self._testing.inserted(db)
        return JobHandle(job_id, self)

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
        db = self._adapted(conn)
        self._backpressure.check(opts.queue, opts.wait_for_room, db, opts.keyed)
        if not self._enqueue_middleware:
            count = self._copy(opts, args_iterable, None, db)
        else:
            call = middleware.call_of(opts, None)
            with middleware.chain_target(db, self.connection) as target:

                def copy() -> int:
                    return bulk.copy_many(
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
        with self._on(conn) as db:
            return bulk.copy_many(db, opts, rows, meta, self._sql)

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
        await self._backpressure.check_async(opts.queue, opts.wait_for_room, db, opts.keyed)
        if not self._enqueue_middleware_async:
            return JobHandle(await self._insert_async(params, db), self)
        if db is not None:
            enqueue.check_conn(db, psycopg.AsyncConnection)
        call = middleware.call_of(opts, {} if args is None else args)
        async with middleware.chain_target_async(db, self.connection_async) as target:

            async def insert() -> int:
                return await enqueue.insert_async(target, middleware.with_meta(params, call), self._sql)

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
        db = await self._adapted_async(conn)
        await self._backpressure.check_async(opts.queue, opts.wait_for_room, db, opts.keyed)
        if not self._enqueue_middleware_async:
            count = await self._copy_async(opts, args_iterable, None, db)
        else:
            call = middleware.call_of(opts, None)
            async with middleware.chain_target_async(db, self.connection_async) as target:

                async def copy() -> int:
                    return await bulk.copy_many_async(
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
        async with self._on_async(conn) as db:
            return await bulk.copy_many_async(db, opts, rows, meta, self._sql)

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
        with schema.required(self.schema), self._on(self._adapted(conn)) as db:
            return control.cancel(db, job_id, self._sql)

    def pause(self, queue: str, *, conn: Conn | None = None) -> dt.datetime:
        """Pause `queue`: every worker stops taking its jobs (those started finish), enqueues go on.

        Effective when the transaction commits (on `conn=`, the caller's);
        returns since when it is paused. See fastjobs.queues.
        """
        with schema.required(self.schema), self._on(self._adapted(conn)) as db:
            return queues.pause(db, queue, self._sql)

    def resume(self, queue: str, *, conn: Conn | None = None) -> bool:
        """Resume `queue` and wake its workers; False when it was not paused."""
        with schema.required(self.schema), self._on(self._adapted(conn)) as db:
            return queues.resume(db, queue, self._sql)

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
        with schema.required(self.schema), self._on(self._adapted(conn)) as db:
            queues.limit(
                db,
                queue,
                concurrency=concurrency,
                max_backlog=max_backlog,
                rate_limit=rate_limit,
                sql=self._sql,
            )

    def limit_key(
        self,
        kind: str | Job[..., Any],
        key: str = "",
        *,
        concurrency: int | None = queues.UNCHANGED,
        rate_limit: str | None = queues.UNCHANGED,
        conn: Conn | None = None,
    ) -> None:
        """Set the limits of kind `kind`'s jobs with key `key` ('': the kind as a whole), stored in the
        database, in place of those they were enqueued with, from the next claim: every worker, no
        restart. None puts the declared limit back; a limit not given stays as it is (fastjobs.keys)."""
        name = kind if isinstance(kind, str) else kind.kind
        with schema.required(self.schema), self._on(self._adapted(conn)) as db:
            keys.limit(db, name, key, concurrency=concurrency, rate_limit=rate_limit, sql=self._sql)

    def queues(self) -> list[QueueInfo]:
        """Every queue acted on or holding jobs: paused or not, its jobs waiting and running."""
        with schema.required(self.schema), self.connection() as own:
            return queues.list_queues(own, self._sql)
