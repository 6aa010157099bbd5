"""A real PostgreSQL for every test: FASTJOBS_TEST_DSN, or a throwaway embedded server.

A template database is migrated once per session; each test that needs the
database gets its own `CREATE DATABASE ... TEMPLATE` copy (milliseconds). The
server and the copies are fastjobs.testing's, as users' tests get them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App, sql
from fastjobs.impl import IMPLEMENTATION
from fastjobs.testing import databases

from . import procs
from .helpers import NOTIFY_END, asleep


def pytest_report_header(config: pytest.Config) -> list[str]:
    with psycopg.connect(databases.server_dsn()) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    return [
        f"fastjobs implementation: {IMPLEMENTATION} (psycopg {psycopg.pq.__impl__})",
        f"database: {databases.source}, PostgreSQL {version}",
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Captured output as UTF-8 can carry it: hostile texts (a lone surrogate from a file name)
    reach the logs, and pytest-xdist cannot send a report holding one from its workers."""
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode()) for title, text in report.sections
    ]


def _create_database(name: str, template: str | None = None) -> str:
    return databases.create(name, template)


def _drop_database(name: str) -> None:
    databases.drop(name)


@pytest.fixture(scope="session")
def template_db() -> str:
    """Name of a database migrated once per session (fastjobs.testing's), to copy per test."""
    return databases.template()


@pytest.fixture
def dsn(fastjobs_dsn: str) -> str:
    """A fresh, migrated database of this test's own (the testing kit's fixture)."""
    return fastjobs_dsn


@pytest.fixture
def twin_dsns(template_db: str) -> Iterator[tuple[str, str]]:
    """Two fresh, migrated databases: one per implementation, for tests that run both side by side."""
    dsns = databases.create(template=template_db), databases.create(template=template_db)
    yield dsns
    for one in dsns:
        databases.drop(one)


@pytest.fixture
def empty_dsn() -> Iterator[str]:
    """A fresh database without the fastjobs schema."""
    name = databases.fresh_name("fastjobs_e")
    yield databases.create(name)
    databases.drop(name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn) as c:
        yield c


@pytest.fixture
def app(dsn: str) -> Iterator[App]:
    application = App(dsn)
    yield application
    application.close()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def masters(tmp_path: Path, dsn: str) -> Iterator[procs.Masters]:
    """Real `fastjobs run` masters of tests/procs.py's jobs module, each execution a row of `runs`."""
    procs.create_runs_table(dsn)
    with procs.Masters(tmp_path, dsn) as m:
        yield m


@pytest.fixture
def listener(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the fastjobs channel (see helpers.notifications), as a sleeping
    worker's: inserts notify (helpers.asleep)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        conn.execute(f"LISTEN {NOTIFY_END}")
        asleep(dsn)
        yield conn
