"""Middleware: what wraps each job's execution and each enqueue, composed once per worker or call.

A job middleware is `mw(job, call_next)`: `job` is the running job's
JobContext, `call_next()` runs the next middleware or the handler and returns
its result. A `def` middleware wraps the `def` handlers, an `async def` one the
`async def` handlers (whose `call_next()` is awaited); register one of each
for an app with both. They run in registration order, the first outermost.
Whatever the handler raises (Retry, Snooze, Cancel included) comes out of
`call_next()` and, unless a middleware catches it, out of the chain to
become the job's outcome; a middleware that raises fails the job like a
handler would.

An enqueue middleware is `mw(enqueue, call_next)` with an `Enqueue`: it may
add to `enqueue.meta` (stored on every job of the call) before calling
`call_next()`, which inserts and returns the job's id (one) or the count
(many); raising refuses the enqueue. Again `def` ones wrap the sync enqueue
methods, `async def` ones the async methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from . import enqueue
from .context import JobContext, _async_job, _thread
from .enqueue import InsertParams, Options
from .errors import FastjobsError
from .types import JobSpec

__all__ = [
    "Enqueue",
    "EnqueueMiddleware",
    "JobMiddleware",
]

JobMiddleware = Callable[[JobContext, Callable[[], Any]], Any]
EnqueueMiddleware = Callable[["Enqueue", Callable[[], Any]], Any]


@dataclass(slots=True)
class Enqueue:
    """One enqueue call as enqueue middleware sees it: one job, or many of one kind (`many`)."""

    kind: str
    queue: str
    priority: int
    max_attempts: int
    run_at: dt.datetime | None
    delay: float | None
    many: bool
    # The job's arguments (one job); None for many, whose rows are read as they are inserted.
    args: dict[str, Any] | None = None
    # Stored on every job of the call as its `meta` (JSON-serialisable values).
    meta: dict[str, Any] = field(default_factory=dict)


def is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func)


def wrap(spec: JobSpec, middleware: Sequence[JobMiddleware]) -> JobSpec:
    """`spec` with its handler (its `target`: argument conversion included) behind the
    middleware of its kind; unchanged when none applies."""
    chain = tuple(m for m in middleware if is_async(m) == spec.is_async)
    if not chain:
        return spec
    inner = spec.target
    if spec.is_async:
        return dataclasses.replace(spec, call=_async_chain(chain, inner))
    return dataclasses.replace(spec, call=_sync_chain(chain, inner))


def _sync_chain(chain: tuple[JobMiddleware, ...], inner: Callable[..., Any]) -> Callable[..., Any]:
    # The loops call the result with the job's args; the context is the
    # calling thread's, which its loop fills before each call.
    def step(index: int, job: JobContext, args: dict[str, Any]) -> Any:
        if index == len(chain):
            return inner(**args)
        return chain[index](job, lambda: step(index + 1, job, args))

    if len(chain) == 1:  # the usual case, one frame less per job
        [only] = chain

        def call_one(**args: Any) -> Any:
            return only(_thread.job, lambda: inner(**args))

        return call_one

    def call(**args: Any) -> Any:
        return step(0, _thread.job, args)

    return call


def _async_chain(chain: tuple[JobMiddleware, ...], inner: Callable[..., Any]) -> Callable[..., Any]:
    async def step(index: int, job: JobContext, args: dict[str, Any]) -> Any:
        if index == len(chain):
            return await inner(**args)
        return await chain[index](job, lambda: step(index + 1, job, args))

    async def call(**args: Any) -> Any:
        return await step(0, _async_job.get(), args)  # type: ignore[arg-type]

    return call


def run_enqueue(chain: Sequence[EnqueueMiddleware], enqueue: Enqueue, insert: Callable[[], int]) -> int:
    """Run the sync enqueue middleware around `insert` (which reads `enqueue.meta`); what it returned.

    The caller gets the insert's result whatever a middleware returns; a
    chain that never reached the insert raises rather than lose the jobs silently.
    """
    done: list[int] = []

    def step(index: int) -> Any:
        if index == len(chain):
            if done:  # raising rolls back what the first call inserted (or, with conn=, the caller may)
                raise FastjobsError("an enqueue middleware called call_next() more than once")
            done.append(insert())
            return done[0]
        return chain[index](enqueue, lambda: step(index + 1))

    step(0)
    return _inserted(chain, enqueue, done)


async def run_enqueue_async(
    chain: Sequence[EnqueueMiddleware], enqueue: Enqueue, insert: Callable[[], Awaitable[int]]
) -> int:
    """Run the async enqueue middleware around `insert` (see run_enqueue)."""
    done: list[int] = []

    async def step(index: int) -> Any:
        if index == len(chain):
            if done:  # raising rolls back what the first call inserted (or, with conn=, the caller may)
                raise FastjobsError("an enqueue middleware called call_next() more than once")
            done.append(await insert())
            return done[0]
        return await chain[index](enqueue, lambda: step(index + 1))

    await step(0)
    return _inserted(chain, enqueue, done)


def _inserted(chain: Sequence[EnqueueMiddleware], enqueue: Enqueue, done: list[int]) -> int:
    if not done:
        names = ", ".join(getattr(m, "__qualname__", repr(m)) for m in chain)
        raise FastjobsError(
            f"enqueue middleware ({names}) returned without calling call_next():"
            f" no {enqueue.kind!r} job was enqueued (raise to refuse an enqueue)"
        )
    return done[0]


def call_of(opts: Options, args: dict[str, Any] | None) -> Enqueue:
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


def with_meta(params: InsertParams, call: Enqueue) -> InsertParams:
    """sql.job_insert's parameters with the meta the middleware gave."""
    meta = enqueue.dump_meta(call.meta)
    return params if meta is None else params._replace(meta=meta.decode())


@contextlib.contextmanager
def chain_target(
    conn: psycopg.Connection[Any] | None,
    connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
) -> Iterator[psycopg.Connection[Any]]:
    """Where an enqueue behind middleware inserts: the caller's connection, or one of `connection()`
    in a transaction around the whole chain, so that a middleware raising after call_next() (or
    calling it twice) leaves nothing inserted, as raising promises."""
    if conn is not None:
        yield conn
        return
    with connection() as own, own.transaction():
        yield own


@contextlib.asynccontextmanager
async def chain_target_async(
    conn: psycopg.AsyncConnection[Any] | None,
    connection: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """`chain_target` for the async enqueues."""
    if conn is not None:
        yield conn
        return
    async with connection() as own, own.transaction():
        yield own
