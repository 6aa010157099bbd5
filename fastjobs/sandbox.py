"""Databases for tests: the test server, a migrated template, and each test's copy of it."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import database, schema

__all__ = ["Databases", "databases"]


class Databases:
    """The test server, its template database, and the per-test copies of it.

    The server is FASTJOBS_TEST_DSN's, else an embedded PostgreSQL (the
    `embedded` extra) in a temporary directory deleted when the process
    exits. The template is migrated once per process and dropped at exit;
    each copy is a `CREATE DATABASE ... TEMPLATE` (milliseconds).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # template() creates under it
        self._dsn: str | None = None
        self.source = ""
        self._template: str | None = None
        self._counter = itertools.count()

    def server_dsn(self) -> str:
        """The server's admin DSN, starting the embedded server on first use."""
        with self._lock:
            if self._dsn is None:
                dsn = os.environ.get("FASTJOBS_TEST_DSN")
                if dsn:
                    self.source = "FASTJOBS_TEST_DSN"
                else:
                    # The postgres processes run as the package's own
                    # unprivileged user when the tests run as root: the
                    # directory must be theirs to enter.
                    parent = Path(tempfile.mkdtemp(prefix="fastjobs-test-"))
                    parent.chmod(0o755)
                    server = database.start_embedded(parent / "pg", cleanup_mode="delete")
                    dsn = server.get_uri("postgres")
                    self.source = "embedded PostgreSQL"
                self._dsn = dsn
            return self._dsn

    def template(self) -> str:
        """The name of the migrated template database, created on first use."""
        admin = self.server_dsn()
        with self._lock:
            if self._template is None:
                name = f"fastjobs_tpl_{os.getpid()}"
                dsn = self.create(name)
                with psycopg.connect(dsn) as conn:
                    schema.migrate(conn)
                self._template = name
                # Registered after the embedded server's own cleanup, so it runs first.
                atexit.register(self._drop_template, admin, os.getpid())
            return self._template

    def _drop_template(self, admin: str, pid: int) -> None:
        if pid == os.getpid() and self._template is not None:  # not a forked child's copy
            with contextlib.suppress(psycopg.Error):
                self.drop(self._template)

    def create(self, name: str | None = None, template: str | None = None) -> str:
        """Create database `name` (a fresh name by default), empty or a copy of `template`; its DSN."""
        name = name or self.fresh_name()
        with psycopg.connect(self.server_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return make_conninfo(self.server_dsn(), dbname=name)

    def drop(self, name_or_dsn: str) -> None:
        """Drop a database (by name, or the database of a DSN), closing its sessions."""
        is_dsn = "=" in name_or_dsn or "://" in name_or_dsn
        name = conninfo_to_dict(name_or_dsn).get("dbname") if is_dsn else name_or_dsn
        with psycopg.connect(self.server_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def fresh_name(self, prefix: str = "fastjobs_t") -> str:
        return f"{prefix}_{os.getpid()}_{next(self._counter)}"

    def migrated(self) -> str:
        """A new migrated database of its own (a copy of the template); its DSN."""
        return self.create(template=self.template())

    @contextlib.contextmanager
    def fresh(self) -> Iterator[str]:
        """A new migrated database for the duration of the block; its DSN."""
        dsn = self.migrated()
        try:
            yield dsn
        finally:
            self.drop(dsn)


# One per process: every test session in it (pytester's in-process runs too)
# shares the server and the template.
databases = Databases()
