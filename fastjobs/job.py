"""The handle `@app.job` returns, and the per-call enqueue options it takes."""

from __future__ import annotations

import datetime as dt
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeAlias, TypedDict, TypeVar, Unpack

import psycopg

from . import enqueue, typed
from .results import JobHandle
from .retry import RetryPolicy
from .types import JobSpec, KeyLimit

__all__ = ["AsyncConn", "BulkOptions", "Conn", "EnqueueOptions", "Job", "close_kinds", "signature", "spec_of"]

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from .app import App


P = ParamSpec("P")
R = TypeVar("R")


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
    fair_key: str | int | None  # the jobs' fairness key, in place of the kind's (fair_key=)


class EnqueueOptions(BulkOptions, total=False):
    unique_key: str | None


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


def signature(func: Callable[..., Any]) -> tuple[frozenset[str] | None, frozenset[str]]:
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


def close_kinds(kind: str, known: list[str]) -> list[str]:
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


def spec_of(
    func: Callable[..., Any],
    name: str,
    *,
    queue: str,
    priority: int,
    max_attempts: int,
    timeout: float | None,
    retry: RetryPolicy | None,
    unique: bool | tuple[str, ...],
    cron: str | None,
    tz: str | None,
    keep_result: int | None,
    limit: KeyLimit | None = None,
    fair_key: str | Callable[[dict[str, Any]], object] | None = None,
) -> JobSpec:
    """The spec `func` is registered with as kind `name`: its signature and annotations read, and
    checked against `cron` (a cron job takes no args), `unique` (keys are its arguments) and
    `fair_key` (an argument's name, or a callable of the args)."""
    params, required = signature(func)
    args_schema = typed.schema(name, func)  # an annotation it cannot store fails here
    if cron is not None and required:
        raise TypeError(f"{name}: a cron job is enqueued without args, but requires {sorted(required)}")
    if isinstance(unique, tuple) and params is not None and not params.issuperset(unique):
        raise TypeError(f"{name}: unique= names {sorted(set(unique) - params)}, not arguments of it")
    by = limit.key if limit is not None else None
    if isinstance(by, str) and params is not None and by not in params:
        raise TypeError(f"{name}: concurrency_key= names {by!r}, not an argument of it")
    if isinstance(fair_key, str):
        if params is not None and fair_key not in params:
            raise TypeError(f"{name}: fair_key= names {fair_key!r}, not an argument of it")
    elif fair_key is not None and not callable(fair_key):
        raise TypeError(f"{name}: fair_key= must be an argument's name or a callable of the args dict")
    return JobSpec(
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
        unique=unique,
        cron=cron,
        tz=tz,
        args_schema=args_schema,
        keep_result=keep_result,
        limit=limit,
        fair_key=fair_key,
    )
