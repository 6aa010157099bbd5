"""A real PostgreSQL for every test: FASTJOBS_TEST_DSN, or a throwaway embedded server.

A template database is migrated once per session; each test that needs the
database gets its own `CREATE DATABASE ... TEMPLATE` copy (milliseconds).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fastjobs import App, database, schema, sql
from fastjobs.impl import IMPLEMENTATION

from . import procs
from .helpers import NOTIFY_END

_counter = itertools.count()
_server: dict[str, str] = {}


def _server_dsn() -> str:
    """The admin DSN of the test server, starting the embedded one on first use."""
    if "dsn" in _server:
        return _server["dsn"]
    dsn = os.environ.get("FASTJOBS_TEST_DSN")
    if dsn:
        _server["source"] = "FASTJOBS_TEST_DSN"
    else:
        # The server's data lives in a fresh temporary directory that is
        # deleted when the session ends; the postgres processes run as the
        # package's own unprivileged user when the tests run as root.
        parent = Path(tempfile.mkdtemp(prefix="fastjobs-test-"))
        parent.chmod(0o755)
        server = database.start_embedded(parent / "pg", cleanup_mode="delete")
        dsn = server.get_uri("postgres")
        _server["source"] = "embedded PostgreSQL"
    _server["dsn"] = dsn
    return dsn


def pytest_report_header(config: pytest.Config) -> list[str]:
    dsn = _server_dsn()
    with psycopg.connect(dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    return [
        f"fastjobs implementation: {IMPLEMENTATION} (psycopg {psycopg.pq.__impl__})",
        f"database: {_server['source']}, PostgreSQL {version}",
    ]


def _admin() -> psycopg.Connection[Any]:
    return psycopg.connect(_server_dsn(), autocommit=True)


def _create_database(name: str, template: str | None = None) -> str:
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return make_conninfo(_server_dsn(), dbname=name)


def _drop_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """Name of a database migrated once per session, to copy per test."""
    name = f"fastjobs_tpl_{os.getpid()}"
    dsn = _create_database(name)
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn)
    yield name
    _drop_database(name)


@pytest.fixture
def dsn(template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    name = f"fastjobs_t_{os.getpid()}_{next(_counter)}"
    yield _create_database(name, template_db)
    _drop_database(name)


@pytest.fixture
def twin_dsns(template_db: str) -> Iterator[tuple[str, str]]:
    """Two fresh, migrated databases: one per implementation, for tests that run both side by side."""
    names = [f"fastjobs_t_{os.getpid()}_{next(_counter)}" for _ in range(2)]
    yield _create_database(names[0], template_db), _create_database(names[1], template_db)
    for name in names:
        _drop_database(name)


@pytest.fixture
def empty_dsn() -> Iterator[str]:
    """A fresh database without the fastjobs schema."""
    name = f"fastjobs_e_{os.getpid()}_{next(_counter)}"
    yield _create_database(name)
    _drop_database(name)


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
    """A connection listening on the fastjobs channel (see helpers.notifications)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        conn.execute(f"LISTEN {NOTIFY_END}")
        yield conn
