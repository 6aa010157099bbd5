"""Migrations: numbered, forward-only SQL files applied under an advisory lock, safe on a live system.

A migration file is a list of steps. What comes before any marker, and
after a `-- fastjobs: transaction` line, is a transaction step: it runs in
one short transaction under `lock_timeout`, and when it cannot get its locks
in time it rolls back (so the enqueues and claims queued behind its lock
request go on), waits and tries again, a bounded number of times. A
`-- fastjobs: concurrently` line starts a step of exactly one
`CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS` statement, run outside any
transaction: the index is built while writes go on. A file with more than
one step must be idempotent (IF NOT EXISTS throughout), since a run
interrupted between its steps is completed by the next; the migration is
recorded with its last step.

In a schema of its own (`schema=`, App(schema=...)), the schema is created
if missing and every step runs with search_path set to it alone: the files
name fastjobs' objects unqualified, so each one is created there, and the
names a table's default or a trigger's condition holds are bound to it when
it is created. The notification channel a file names (the insert trigger's)
is written as the unqualified catalogue's literal and sent as the schema's
(`_in_schema`). The migrations table is the schema's: each schema is
migrated on its own, its versions its own.

Compatibility window: a migration never removes or changes what the code of
the previous migration uses, so code that knows migrations 1..N runs on a
schema at N, and at N+1 (migrated first, during a rolling deploy), never
on an older or a newer one (`check`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
from psycopg import sql as pgsql

from . import database, sql
from .errors import FastjobsError, SchemaMissing, SchemaTooNew

__all__ = [
    "APPLICATION",
    "COMPATIBLE_AHEAD",
    "LOCK_RETRIES",
    "LOCK_TIMEOUT",
    "Migration",
    "Step",
    "check",
    "migrate",
    "migrations",
    "required",
    "script",
]

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
_MARKER = re.compile(r"^-- fastjobs: (transaction|concurrently)[ \t]*$", re.MULTILINE)
_CONCURRENT_INDEX = re.compile(
    r"^CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+([a-z_][a-z0-9_]*)\s", re.IGNORECASE
)

# How many migrations ahead of the newest this code knows a schema may be.
COMPATIBLE_AHEAD = 1
# `fastjobs migrate`'s defaults: how long a transaction step waits for its
# locks before it gives way, and how many times it tries.
LOCK_TIMEOUT = 2.0
LOCK_RETRIES = 30
_BACKOFF_MAX = 10.0
APPLICATION = "fastjobs migrate"


@dataclass(frozen=True, slots=True)
class Step:
    sql: str
    concurrently: bool  # outside a transaction: one CREATE INDEX CONCURRENTLY IF NOT EXISTS
    index: str = ""  # the index a concurrent step builds


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:03d}_{self.name}"

    def steps(self) -> list[Step]:
        """The file's steps, in order (see the module docstring); a malformed file raises."""
        parts = _MARKER.split(self.sql)
        found = [Step(parts[0], False)] if _code(parts[0]) else []
        for kind, text in zip(parts[1::2], parts[2::2], strict=True):
            if kind == "transaction":
                found.append(Step(text, False))
                continue
            body = _code(text)
            match = _CONCURRENT_INDEX.match(body)
            if match is None or body.count(";") != 1 or not body.endswith(";"):
                raise FastjobsError(
                    f"migration {self.label}: a `-- fastjobs: concurrently` step must be one"
                    " CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS statement"
                )
            found.append(Step(text, True, match[1]))
        return found


def _code(text: str) -> str:
    """`text` without its comment lines and surrounding blanks."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--")).strip()


def migrations(directory: Path | Traversable | None = None) -> list[Migration]:
    """Every migration shipped in the package (`migrations/` of the source tree), in order.

    `directory` reads them from elsewhere instead (the tests' pending migrations).
    """
    found = []
    source = directory if directory is not None else resources.files("fastjobs.migrations")
    for entry in source.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise FastjobsError(f"migrations are not numbered 001.. without gaps: {versions}")
    return found


def _say(line: str) -> None:
    logger.warning("migrate: %s", line)


def migrate(
    conn: psycopg.Connection[Any],
    *,
    dsn: str | None = None,
    lock_timeout: float = LOCK_TIMEOUT,
    retries: int = LOCK_RETRIES,
    directory: Path | Traversable | None = None,
    say: Callable[[str], None] = _say,
    target: int | None = None,
    schema: str | None = None,
) -> list[Migration]:
    """Apply the pending migrations step by step (see the module docstring); return those applied.

    With `target`, only those up to that version: Django's migrations of
    fastjobs.contrib.django each bring the schema to the version they name.

    The session-level advisory lock makes concurrent migrators queue up: the
    second one finds everything applied and does nothing. With `dsn`, a
    second connection watches the migration's session and says whenever it
    waits on another (pid, application, state, query), through `say`.
    With `schema`, the migrations go into that schema (see the module docstring).
    """
    if retries < 1 or not lock_timeout > 0:
        raise FastjobsError("migrate needs a positive lock timeout and at least one attempt")
    statements = sql.of(schema)
    pending_all = [m for m in migrations(directory) if target is None or m.version <= target]
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        # The caller's transaction is its own: nothing to do is fine, anything else is not.
        with psycopg.RawCursor(conn) as cur:
            exists = cur.execute(statements.schema_exists).fetchone()
            applied = (
                {row[0] for row in cur.execute(statements.migration_applied_list)}
                if exists and exists[0]
                else set()
            )
        if all(m.version in applied for m in pending_all):
            return []
        raise FastjobsError(
            "migrate needs a connection outside any transaction (CREATE INDEX CONCURRENTLY): commit first"
        )
    was_autocommit = conn.autocommit
    conn.autocommit = True  # CREATE INDEX CONCURRENTLY runs outside any transaction
    watcher = _Watcher(dsn, conn.info.backend_pid, say) if dsn else None
    try:
        with psycopg.RawCursor(conn) as cur:
            if watcher is not None:
                watcher.start()
            _lock(cur, say)
            search_path = None
            try:
                if schema is not None:
                    cur.execute(pgsql.SQL(sql.schema_create).format(schema=pgsql.Identifier(schema)))
                    row = cur.execute(sql.migration_search_path, (f'"{schema}"',)).fetchone()
                    search_path = row[0] if row else None
                cur.execute(statements.migration_table_create)
                applied = {row[0] for row in cur.execute(statements.migration_applied_list)}
                pending = [m for m in pending_all if m.version not in applied]
                for migration in pending:
                    steps = migration.steps()
                    for number, step in enumerate(steps, 1):
                        last = number == len(steps)
                        if watcher is not None:
                            watcher.doing = f"{migration.label} step {number} of {len(steps)}"
                        step = _in_schema(step, statements)
                        if step.concurrently:
                            _build_index(cur, step)
                            if last:
                                cur.execute(statements.migration_record, (migration.version, migration.name))
                        else:
                            record = migration if last else None
                            _transaction(
                                conn, migration, number, step, record, lock_timeout, retries, say, statements
                            )
            finally:
                with contextlib.suppress(psycopg.Error):
                    if search_path is not None:  # the caller's own (Django's connection)
                        cur.execute(sql.migration_search_path, (search_path,))
                    cur.execute(sql.migration_unlock, (sql.MIGRATION_LOCK_KEY,))
    finally:
        if watcher is not None:
            watcher.stop()
        if not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            conn.autocommit = was_autocommit
    return pending


def _in_schema(step: Step, statements: ModuleType) -> Step:
    """`step` as it runs in the schema of `statements`: its channels are the schema's (see the module
    docstring)."""
    text = step.sql
    for name in ("NOTIFY_CHANNEL", "PING_CHANNEL", "CANCEL_CHANNEL", "RESULT_CHANNEL"):
        text = text.replace(f"'{getattr(sql, name)}'", f"'{getattr(statements, name)}'")
    return step if text == step.sql else Step(text, step.concurrently, step.index)


def _lock(cur: psycopg.RawCursor[Any], say: Callable[[str], None]) -> None:
    """Take the migration lock, polling while another migrator holds it (see sql.migration_lock)."""
    waited = False
    while not cur.execute(sql.migration_lock, (sql.MIGRATION_LOCK_KEY,)).fetchone()[0]:  # type: ignore[index]
        if not waited:
            say("another `fastjobs migrate` holds the migration lock; waiting for it to finish")
            waited = True
        time.sleep(0.1)


def _transaction(
    conn: psycopg.Connection[Any],
    migration: Migration,
    number: int,
    step: Step,
    record: Migration | None,
    lock_timeout: float,
    retries: int,
    say: Callable[[str], None],
    statements: ModuleType = sql,
) -> None:
    """Run one transaction step under `lock_timeout`, giving way and retrying while its locks are held."""
    for attempt in range(1, retries + 1):
        try:
            with conn.transaction(), psycopg.RawCursor(conn) as cur:
                cur.execute(sql.migration_lock_timeout, (f"{int(lock_timeout * 1000)}ms",))
                cur.execute(step.sql.encode())
                if record is not None:
                    cur.execute(statements.migration_record, (record.version, record.name))
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == retries:
                raise FastjobsError(
                    f"{migration.label} step {number}: gave up after {retries} attempts of"
                    f" {lock_timeout:g}s waiting for its locks; nothing of this step was applied"
                ) from None
            delay = min(_BACKOFF_MAX, 0.25 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            say(
                f"{migration.label} step {number}: its locks were not granted within {lock_timeout:g}s;"
                f" gave way, retrying in {delay:.1f}s (attempt {attempt + 1} of {retries})"
            )
            time.sleep(delay)


def _build_index(cur: psycopg.RawCursor[Any], step: Step) -> None:
    """CREATE INDEX CONCURRENTLY, after dropping what an interrupted build of it left (an invalid index)."""
    invalid = cur.execute(sql.migration_index_invalid, (step.index,)).fetchone()
    if invalid is not None and invalid[0]:
        cur.execute(pgsql.SQL(sql.migration_index_drop).format(index=pgsql.Identifier(step.index)))
    # No lock_timeout here: the build waits only for transactions older than it, blocking nobody.
    cur.execute(step.sql.encode())


class _Watcher(threading.Thread):
    """Says what the migrating session waits on, from a connection of its own (pg_blocking_pids)."""

    def __init__(self, dsn: str, pid: int, say: Callable[[str], None]) -> None:
        super().__init__(name="fastjobs-migrate-watcher", daemon=True)
        self.dsn = dsn
        self.pid = pid
        self.say = say
        self.doing = ""
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(5)

    def run(self) -> None:
        seen: frozenset[int] = frozenset()
        try:
            with (
                database.connect(self.dsn, autocommit=True, application_name=APPLICATION) as conn,
                psycopg.RawCursor(conn) as cur,
            ):
                while not self._stop_event.wait(0.25):
                    rows = cur.execute(sql.migration_blockers, (self.pid,)).fetchall()
                    pids = frozenset(r[0] for r in rows)
                    if pids - seen:
                        for pid, application, state, age, query in rows:
                            self.say(
                                f"{self.doing} waits for pid {pid} (application {application!r}, {state},"
                                f" transaction open {age:.1f}s): {query}"
                            )
                    seen = pids
        except (psycopg.Error, FastjobsError):
            return  # only a reporter: the migration goes on without it


def script(since: int = 0, lock_timeout: float = LOCK_TIMEOUT, schema: str | None = None) -> str:
    """The migrations after version `since` as one psql script, for DBAs who apply by hand.

    `fastjobs migrate --sql` prints them all (a new database);
    `--sql --since 1` the upgrade of a database at 001. It is run with
    `psql -v ON_ERROR_STOP=1 -f`, one statement at a time: each step is its
    own transaction with `lock_timeout` (a step that fails on it applied
    nothing; run the script again), and CREATE INDEX CONCURRENTLY runs
    outside any. With `schema`, into that schema: the script creates it and
    sets the session's search_path to it first.
    """
    statements = sql.of(schema)
    parts = [
        "-- fastjobs migrations: run with `psql -v ON_ERROR_STOP=1 -f THIS_FILE`, not in one transaction",
        '-- (CREATE INDEX CONCURRENTLY cannot run in one). A step that fails with "lock timeout" applied',
        "-- nothing: run the script again (steps of a multi-step migration are idempotent). A failed",
        "-- CONCURRENTLY build leaves an INVALID index: DROP INDEX CONCURRENTLY it before running again.",
        f"SELECT pg_advisory_lock({sql.MIGRATION_LOCK_KEY});",
    ]
    if schema is not None:
        parts += [sql.schema_create.format(schema=f'"{schema}"') + ";", f'SET search_path TO "{schema}";']
    parts.append(statements.migration_table_create.strip() + ";")
    timeout = f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms';"
    for m in migrations():
        if m.version <= since:
            continue
        parts.append(f"-- {m.label}")
        steps = m.steps()
        record = (
            f"INSERT INTO fastjobs_migrations (version, name) VALUES ({m.version}, '{m.name}')"
            " ON CONFLICT DO NOTHING;"
        )
        for number, step in enumerate(steps, 1):
            last = number == len(steps)
            step = _in_schema(step, statements)
            if step.concurrently:
                parts.append(step.sql.strip())
                if last:
                    parts.append(record)
            else:
                parts += ["BEGIN;", timeout, step.sql.strip()]
                parts += [record, "COMMIT;"] if last else ["COMMIT;"]
    parts.append(f"SELECT pg_advisory_unlock({sql.MIGRATION_LOCK_KEY});")
    return "\n".join(parts) + "\n"


def check(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> None:
    """Raise SchemaMissing unless the schema is within this code's window: its newest migration, or one more.

    Older: run `fastjobs migrate` (deploy order: migrate, then the new code).
    Newer by more than COMPATIBLE_AHEAD: SchemaTooNew, upgrade fastjobs here.
    `sql` is the catalogue of the schema to check (fastjobs.sql.of).
    """
    with psycopg.RawCursor(conn) as cur:
        exists = cur.execute(sql.schema_exists).fetchone()
        version = cur.execute(sql.schema_version).fetchone()[0] if exists and exists[0] else None  # type: ignore[index]
    latest = migrations()[-1].version
    if version is None or version < latest:
        have = "none" if version is None else f"{version:03d}"
        raise SchemaMissing(
            f"the fastjobs schema{_named(sql.SCHEMA)} is at {have}, this fastjobs needs {latest:03d}:"
            f" run {_migrate_command(sql.SCHEMA)}"
        )
    if version > latest + COMPATIBLE_AHEAD:
        raise SchemaTooNew(
            f"the fastjobs schema is at {version:03d}, newer than this fastjobs runs on ({latest:03d}"
            f" to {latest + COMPATIBLE_AHEAD:03d}): upgrade fastjobs on this host"
        )


@contextlib.contextmanager
def required(schema: str | None = None) -> Iterator[None]:
    """Errors of a missing or old schema become SchemaMissing, which says to run `fastjobs migrate`.

    For the calls that skip `check` (a round trip each): a missing table or
    type means no schema; a missing column, or no unique index for an ON
    CONFLICT (002 adds the unique keys' index), an older one. `schema` is the
    App's (App(schema=...)): a schema that does not exist is missing too.
    """
    try:
        yield
    except (
        psycopg.errors.UndefinedTable,
        psycopg.errors.UndefinedObject,
        psycopg.errors.InvalidSchemaName,
    ) as exc:
        raise SchemaMissing(
            f"the fastjobs schema{_named(schema)} is missing in this database ({exc.diag.message_primary}):"
            f" run {_migrate_command(schema)}"
        ) from None
    except (psycopg.errors.UndefinedColumn, psycopg.errors.InvalidColumnReference) as exc:
        raise SchemaMissing(
            f"the fastjobs schema{_named(schema)} in this database is out of date"
            f" ({exc.diag.message_primary}): run {_migrate_command(schema)}"
        ) from None


def _named(schema: str | None) -> str:
    return "" if schema is None else f" (in schema {schema!r})"


def _migrate_command(schema: str | None) -> str:
    """The command that creates or upgrades fastjobs' tables of `schema`."""
    return "`fastjobs migrate`" if schema is None else f"`fastjobs migrate --schema {schema}`"
