"""SQLAlchemy (`fastjobs[sqlalchemy]`): a Connection or Session as `conn=`, the job in its transaction.

`conn=` and `job.using(...)` take a SQLAlchemy `Connection` or `Session`
(the sync methods) and an `AsyncConnection` or `AsyncSession` (the async
ones). fastjobs inserts through the psycopg 3 connection underneath, in the
transaction SQLAlchemy has open on it, so the job exists only once that
transaction commits. The engine must use psycopg 3 (`postgresql+psycopg://`,
for `create_engine` and `create_async_engine` alike): psycopg2, asyncpg and
pg8000 connections cannot take the insert.

An enqueue counts as a statement for SQLAlchemy's autobegin: on a Connection
with no transaction begun, it begins one, as `conn.execute()` would; the
caller commits it (`conn.commit()`, `session.commit()`, or the `begin()`
block). `fastjobs.enqueue` calls this module only for objects whose class
comes from SQLAlchemy, so `import fastjobs` never imports SQLAlchemy.
"""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session

__all__ = ["driver_connection", "driver_connection_async"]

DRIVER = "psycopg"  # the dialect's driver name, for create_engine and create_async_engine alike


def driver_connection(conn: Connection | Session) -> psycopg.Connection[Any]:
    """The psycopg connection under a SQLAlchemy Connection or Session, its transaction begun."""
    if isinstance(conn, Session):
        conn = conn.connection()  # the session's transaction's connection, begun
    elif not isinstance(conn, Connection):
        raise _wrong_kind(conn, sync=True)
    _check_dialect(conn.dialect)
    if not conn.in_transaction():
        conn.begin()  # what conn.execute() would do: the caller's commit covers the job
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection), raw
    return raw


async def driver_connection_async(conn: Any) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under a SQLAlchemy AsyncConnection or AsyncSession, its transaction begun."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession  # needs greenlet: imported on use

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    elif not isinstance(conn, AsyncConnection):
        raise _wrong_kind(conn, sync=False)
    _check_dialect(conn.dialect)
    if not conn.in_transaction():
        await conn.begin()
    raw = (await conn.get_raw_connection()).driver_connection
    assert isinstance(raw, psycopg.AsyncConnection), raw
    return raw


def _check_dialect(dialect: Dialect) -> None:
    if dialect.name != "postgresql":
        raise TypeError(
            f"conn= is a SQLAlchemy connection to {dialect.name}: fastjobs' jobs live in PostgreSQL"
        )
    if dialect.driver != DRIVER:
        raise TypeError(
            f"conn= is a SQLAlchemy connection on the {dialect.driver} driver: fastjobs joins a transaction"
            " through psycopg 3 only; create the engine with a postgresql+psycopg:// URL"
            " (create_engine and create_async_engine alike)"
        )


def _wrong_kind(conn: object, *, sync: bool) -> TypeError:
    name = f"{type(conn).__module__}.{type(conn).__qualname__}"
    if sync and type(conn).__name__ in ("AsyncConnection", "AsyncSession"):
        return TypeError(f"conn= is a {name}: use enqueue_async or enqueue_many_async")
    if not sync and isinstance(conn, Connection | Session):
        return TypeError(f"conn= is a {name}: the async methods take an AsyncConnection or AsyncSession")
    wanted = "Connection or Session" if sync else "AsyncConnection or AsyncSession"
    return TypeError(f"conn= must be a SQLAlchemy {wanted} (or a psycopg 3 connection), not {name}")
