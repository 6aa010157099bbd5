"""Migrations: numbered, forward-only SQL files applied under an advisory lock."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg

from . import sql
from .errors import FastjobsError, SchemaMissing

_FILE = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration shipped in the package (`migrations/` of the source tree), in order."""
    found = []
    for entry in resources.files("fastjobs.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise FastjobsError(f"migrations are not numbered 001.. without gaps: {versions}")
    return found


def migrate(conn: psycopg.Connection[Any]) -> list[Migration]:
    """Apply the pending migrations in one transaction; return those applied.

    The advisory lock makes concurrent migrators queue up: the second one
    finds everything applied and does nothing.
    """
    with conn.transaction(), psycopg.RawCursor(conn) as cur:
        cur.execute(sql.migration_lock, (sql.MIGRATION_LOCK_KEY,))
        cur.execute(sql.migration_table_create)
        applied = {row[0] for row in cur.execute(sql.migration_applied_list)}
        pending = [m for m in migrations() if m.version not in applied]
        for migration in pending:
            cur.execute(migration.sql.encode())
            cur.execute(sql.migration_record, (migration.version, migration.name))
    return pending


def script(since: int = 0) -> str:
    """The migrations after version `since` as one SQL script, for DBAs who apply by hand.

    `fastjobs migrate --sql` prints them all (a new database);
    `--sql --since 1` the upgrade of a database at 001.
    """
    parts = ["BEGIN;", f"SELECT pg_advisory_xact_lock({sql.MIGRATION_LOCK_KEY});"]
    parts.append(sql.migration_table_create.strip() + ";")
    for m in migrations():
        if m.version <= since:
            continue
        parts.append(f"-- {m.version:03d}_{m.name}")
        parts.append(m.sql.strip())
        parts.append(
            f"INSERT INTO fastjobs_migrations (version, name) VALUES ({m.version}, '{m.name}')"
            " ON CONFLICT DO NOTHING;"
        )
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def check(conn: psycopg.Connection[Any]) -> None:
    """Raise SchemaMissing unless every shipped migration is applied."""
    with psycopg.RawCursor(conn) as cur:
        exists = cur.execute(sql.schema_exists).fetchone()
        version = cur.execute(sql.schema_version).fetchone()[0] if exists and exists[0] else None  # type: ignore[index]
    latest = migrations()[-1].version
    if version is None or version < latest:
        have = "none" if version is None else f"{version:03d}"
        raise SchemaMissing(
            f"the fastjobs schema is at {have}, this fastjobs needs {latest:03d}: run `fastjobs migrate`"
        )


@contextlib.contextmanager
def required() -> Iterator[None]:
    """Errors of a missing or old schema become SchemaMissing, which says to run `fastjobs migrate`.

    For the calls that skip `check` (a round trip each): a missing table or
    type means no schema; a missing column, or no unique index for an ON
    CONFLICT (002 adds the unique keys' index), an older one.
    """
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedObject) as exc:
        raise SchemaMissing(
            f"the fastjobs schema is missing in this database ({exc.diag.message_primary}):"
            " run `fastjobs migrate`"
        ) from None
    except (psycopg.errors.UndefinedColumn, psycopg.errors.InvalidColumnReference) as exc:
        raise SchemaMissing(
            f"the fastjobs schema in this database is out of date ({exc.diag.message_primary}):"
            " run `fastjobs migrate`"
        ) from None
