"""SQLAlchemy connections and sessions as `conn=`: the job joins their transaction, on psycopg 3 only."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

sqlalchemy = pytest.importorskip("sqlalchemy")
pytest.importorskip("greenlet")  # SQLAlchemy's asyncio needs it

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from fastjobs import App  # noqa: E402


def welcome(user_id: int) -> None:
    """A handler at module level."""


def _url(dsn: str, driver: str = "psycopg") -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    host = info.get("host", "127.0.0.1")
    port = info.get("port", 5432)
    return f"postgresql+{driver}://{info.get('user', 'postgres')}@{host}:{port}/{info['dbname']}"


def _kinds(dsn: str) -> list[tuple[str, Any]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT kind, args FROM fastjobs_jobs_all ORDER BY id").fetchall()


@pytest.fixture
def engine(dsn: str) -> Iterator[Any]:
    eng = create_engine(_url(dsn))
    with eng.begin() as conn:
        conn.execute(text("CREATE TABLE users (id int PRIMARY KEY)"))
    yield eng
    eng.dispose()


@pytest.fixture
def jobs(dsn: str) -> Iterator[tuple[App, Any]]:
    app = App(dsn)
    yield app, app.job(welcome)
    app.close()


def test_a_connection_s_commit_takes_the_job_and_its_rollback_drops_it(dsn, engine, jobs):
    _app, job = jobs
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO users VALUES (1)"))
        job.enqueue(1, conn=conn)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(text("INSERT INTO users VALUES (2)"))
        job.using(conn).enqueue(2)
        raise RuntimeError("the request failed")
    assert [args for _, args in _kinds(dsn)] == [{"user_id": 1}]


def test_an_enqueue_autobegins_like_execute_so_the_callers_commit_covers_it(dsn, engine, jobs):
    """On a Connection with no transaction yet, enqueue begins one (as conn.execute would): the
    job exists after conn.commit(), and closing without commit drops it with the rest."""
    _app, job = jobs
    with engine.connect() as conn:
        job.enqueue(1, conn=conn)
        assert conn.in_transaction()
        assert _kinds(dsn) == []  # not committed yet: invisible to others
        conn.commit()
    with engine.connect() as conn:
        job.enqueue(2, conn=conn)  # closed without commit: rolled back
    assert [args for _, args in _kinds(dsn)] == [{"user_id": 1}]


def test_a_session_joins_its_unit_of_work(dsn, engine, jobs):
    app, job = jobs
    with Session(engine) as session:
        session.execute(text("INSERT INTO users VALUES (1)"))
        job.enqueue(1, conn=session)
        app.enqueue_many(job.kind, [{"user_id": 2}, {"user_id": 3}], conn=session)
        session.rollback()
        job.using(session).enqueue(4)
        session.commit()
    assert [args for _, args in _kinds(dsn)] == [{"user_id": 4}]


def test_async_connection_and_session(dsn, jobs):
    app, job = jobs

    async def main() -> None:
        eng = create_async_engine(_url(dsn))
        try:
            async with eng.begin() as conn:
                await job.enqueue_async(1, conn=conn)
            async with eng.connect() as conn:
                await job.using(conn).enqueue_async(2)  # autobegun, then rolled back on close
            async with AsyncSession(eng) as session:
                await app.enqueue_many_async(job.kind, [{"user_id": 3}], conn=session)
                await session.commit()
        finally:
            await eng.dispose()
        await app.aclose()

    asyncio.run(main())
    assert [args for _, args in _kinds(dsn)] == [{"user_id": 1}, {"user_id": 3}]


def test_sync_and_async_mixed_up_are_refused_before_anything_is_sent(dsn, engine, jobs):
    _app, job = jobs
    with engine.connect() as conn:

        async def enqueue_on_sync() -> None:
            await job.enqueue_async(1, conn=conn)

        with pytest.raises(TypeError, match="async methods take an AsyncConnection or AsyncSession"):
            asyncio.run(enqueue_on_sync())
        assert not conn.in_transaction()

    async def enqueue_on_async() -> None:
        eng = create_async_engine(_url(dsn))
        try:
            async with eng.connect() as aconn:
                with pytest.raises(TypeError, match="use enqueue_async"):
                    job.enqueue(1, conn=aconn)
        finally:
            await eng.dispose()

    asyncio.run(enqueue_on_async())


def test_another_driver_is_refused_naming_the_url_to_use(dsn, jobs):
    """psycopg2, asyncpg and pg8000 cannot take the insert; the error says postgresql+psycopg://.
    The dialect is checked before any connection is made, so the drivers need not be installed."""
    _app, job = jobs
    for driver in ("psycopg2", "pg8000"):
        try:
            eng = create_engine(_url(dsn, driver))
        except ImportError:
            eng = None
        if eng is None:
            continue
        with eng.connect() as conn, pytest.raises(TypeError, match=r"postgresql\+psycopg://"):
            job.enqueue(1, conn=conn)
    sqlite = create_engine("sqlite://")
    with sqlite.connect() as conn, pytest.raises(TypeError, match="sqlite"):
        job.enqueue(1, conn=conn)
    with pytest.raises(TypeError, match="SQLAlchemy"):
        job.using(object())


def test_the_dialect_check_needs_no_connection(jobs):
    """A stand-in Connection of a psycopg2 dialect: refused by the dialect alone."""
    from sqlalchemy.dialects.postgresql import psycopg2 as pg2

    from fastjobs.contrib import sqlalchemy as contrib

    with pytest.raises(TypeError, match=r"psycopg2 driver.*postgresql\+psycopg://"):
        contrib._check_dialect(pg2.dialect())  # type: ignore[no-untyped-call]
    from sqlalchemy.dialects.postgresql import asyncpg

    with pytest.raises(TypeError, match=r"asyncpg driver.*postgresql\+psycopg://"):
        contrib._check_dialect(asyncpg.dialect())  # type: ignore[no-untyped-call]


def test_importing_fastjobs_does_not_import_sqlalchemy():
    probe = "import sys, fastjobs; print('sqlalchemy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
