"""The database side of an App: its DSN, and its own connections for the calls made without `conn=`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg

from . import database, enqueue, sql

__all__ = ["Connected", "IdleAsyncConnections", "IdleConnections", "finish"]

if TYPE_CHECKING:
    from .job import AsyncConn, Conn


def finish(idle: list[Any]) -> None:
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


class IdleConnections:
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


class IdleAsyncConnections:
    """Per event loop, a few idle autocommit async connections, for async enqueues made without `conn=`.

    A loop that ends (asyncio.run, a test's) takes its own with it: closed
    then, at the libpq level, not left to warn when collected.
    """

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary()
        )

    @contextlib.asynccontextmanager
    async def connection(
        self, dsn: str, keep: Callable[[], bool]
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection to `dsn`, kept idle afterwards while `keep()` (the App still uses `dsn`)."""
        loop = asyncio.get_running_loop()
        idle = self._by_loop.get(loop)
        if idle is None:
            idle = self._by_loop[loop] = []
            weakref.finalize(loop, finish, idle)
        conn = idle.pop() if idle else await database.connect_async(dsn, autocommit=True)
        try:
            yield conn
        except BaseException:
            await conn.close()
            raise
        if not conn.closed and len(idle) < IdleConnections.MAX_IDLE and keep():
            idle.append(conn)
        else:
            await conn.close()

    def close(self) -> None:
        for idle in list(self._by_loop.values()):
            finish(idle)

    async def aclose(self) -> None:
        """Close the running loop's idle connections through the loop."""
        idle = self._by_loop.pop(asyncio.get_running_loop(), [])
        while idle:
            await idle.pop().close()


class Connected:
    """The database side of an App: its DSN, resolved on first use, and its own connections (a few
    idle ones, sync and per event loop) for the calls made without `conn=`."""

    def __init__(self, dsn: str | None = None, *, schema: str | None = None) -> None:
        self._dsn = dsn
        # The catalogue of the schema: the statements every enqueue, worker and command sends.
        self._sql: ModuleType = sql.of(database.resolve_schema(schema))
        self._pool = IdleConnections()
        self._async_pool = IdleAsyncConnections()

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
        self._sql = catalogue

    @staticmethod
    def _adapted(conn: Conn | None) -> psycopg.Connection[Any] | None:
        """The caller's connection (psycopg's, or SQLAlchemy's unwrapped), checked; None without one."""
        db: psycopg.Connection[Any] | None = enqueue.adapt(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.Connection)
        return db

    @contextlib.contextmanager
    def _on(self, conn: psycopg.Connection[Any] | None) -> Iterator[psycopg.Connection[Any]]:
        """`conn`, else one of the app's own connections."""
        if conn is not None:
            yield conn
        else:
            with self.connection() as own:
                yield own

    @staticmethod
    async def _adapted_async(conn: AsyncConn | None) -> psycopg.AsyncConnection[Any] | None:
        """`_adapted` for the async methods."""
        db: psycopg.AsyncConnection[Any] | None = await enqueue.adapt_async(conn)
        if db is not None:
            enqueue.check_conn(db, psycopg.AsyncConnection)
        return db

    @contextlib.asynccontextmanager
    async def _on_async(
        self, conn: psycopg.AsyncConnection[Any] | None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """`_on` for the async methods."""
        if conn is not None:
            yield conn
        else:
            async with self.connection_async() as own:
                yield own

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit connection of fastjobs' own pool, opened lazily."""
        with self._pool.connection(self.dsn) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def connection_async(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """An autocommit async connection, pooled per event loop."""
        dsn = self.dsn
        async with self._async_pool.connection(dsn, keep=lambda: dsn == self._dsn) as conn:
            yield conn

    def close(self) -> None:
        """Close the pooled connections (a forked child drops its parent's without closing).

        Idle async connections are closed at the libpq level, which needs no
        event loop; `aclose` closes them the regular way.
        """
        self._pool.close()
        self._async_pool.close()

    async def aclose(self) -> None:
        """Close the pooled connections, the async ones of the running loop through their loop."""
        await self._async_pool.aclose()
        self.close()
