"""Migrations: from zero, re-run, concurrent migrators, `fastjobs migrate --sql`, the schema check."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from fastjobs import SchemaMissing, schema, sql
from fastjobs.cli import main


def _snapshot(dsn: str) -> dict[str, Any]:
    """Everything the migrations create, in a form two databases can be compared by."""
    queries = {
        "columns": """
            SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
              FROM information_schema.columns
             WHERE table_schema = 'public' ORDER BY table_name, ordinal_position""",
        "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1",
        "constraints": """
            SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
              FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2""",
        "triggers": """
            SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1""",
        "functions": """
            SELECT proname, prosrc FROM pg_proc
             WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
        "enums": """
            SELECT t.typname, e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid
             ORDER BY t.typname, e.enumsortorder""",
        "reloptions": """
            SELECT relname, reloptions FROM pg_class
             WHERE relnamespace = 'public'::regnamespace AND relkind = 'r' ORDER BY 1""",
        "migrations": "SELECT version, name FROM fastjobs_migrations ORDER BY version",
    }
    with psycopg.connect(dsn) as conn:
        return {name: conn.execute(query).fetchall() for name, query in queries.items()}


def _tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {row[0] for row in rows}


def test_migrate_from_zero_applies_and_records_every_migration(empty_dsn):
    shipped = schema.migrations()
    assert [m.version for m in shipped][:1] == [1]
    assert shipped[0].name == "initial"

    with psycopg.connect(empty_dsn) as conn:
        applied = schema.migrate(conn)

    assert applied == shipped
    assert {"fastjobs_jobs", "fastjobs_workers", "fastjobs_migrations"} <= _tables(empty_dsn)
    recorded = _snapshot(empty_dsn)["migrations"]
    assert recorded == [(m.version, m.name) for m in shipped]


def test_migrate_twice_is_a_no_op(empty_dsn):
    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate(conn)
    before = _snapshot(empty_dsn)

    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate(conn) == []
        assert schema.migrate(conn) == []

    assert _snapshot(empty_dsn) == before


def test_migrate_commits_its_work(empty_dsn):
    """migrate() on a non-autocommit connection must not leave the schema in an open transaction."""
    with psycopg.connect(empty_dsn) as conn:
        schema.migrate(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(empty_dsn) as other:
        schema.check(other)


def _advisory_waiters(conn: psycopg.Connection[Any], key: int) -> int:
    row = conn.execute(
        """SELECT count(*) FROM pg_locks
            WHERE locktype = 'advisory' AND NOT granted
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND classid = %s AND objid = %s""",
        (key >> 32, key & 0xFFFFFFFF),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_concurrent_migrators_apply_each_migration_once(empty_dsn):
    results: dict[int, list[schema.Migration]] = {}
    errors: list[BaseException] = []

    def migrate(i: int) -> None:
        try:
            with psycopg.connect(empty_dsn) as conn:
                results[i] = schema.migrate(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(i,)) for i in range(2)]
    # A third session holds the migration lock until both migrators queue up
    # behind it, so they really do race for it when it is released.
    with psycopg.connect(empty_dsn) as blocker, psycopg.connect(empty_dsn, autocommit=True) as watcher:
        psycopg.RawCursor(blocker).execute(sql.migration_lock, (sql.MIGRATION_LOCK_KEY,))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _advisory_waiters(watcher, sql.MIGRATION_LOCK_KEY) < 2 and not errors:
            assert time.monotonic() < deadline, "the migrators never waited on the migration lock"
        blocker.commit()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()

    assert errors == []
    assert sorted(len(applied) for applied in results.values()) == [0, len(schema.migrations())]
    assert _snapshot(empty_dsn)["migrations"] == [(m.version, m.name) for m in schema.migrations()]


def test_migrate_sql_prints_a_script_equivalent_to_migrate(empty_dsn, dsn, capsys):
    assert main(["migrate", "--sql"]) == 0
    script = capsys.readouterr().out
    assert "CREATE TABLE fastjobs_jobs" in script
    assert "fastjobs_migrations" in script

    # What a DBA does with psql: run the script as it is, simple query protocol.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(script)

    assert _snapshot(empty_dsn) == _snapshot(dsn)
    with psycopg.connect(empty_dsn) as conn:
        schema.check(conn)
        assert schema.migrate(conn) == []


def test_migrate_sql_needs_no_database(monkeypatch, capsys):
    monkeypatch.setenv("FASTJOBS_DSN", "postgresql://nobody@127.0.0.1:1/nothing")
    assert main(["migrate", "--sql"]) == 0
    assert capsys.readouterr().out.startswith("BEGIN;")


def test_cli_migrate(empty_dsn, capsys):
    assert main(["--dsn", empty_dsn, "migrate"]) == 0
    out = capsys.readouterr().out
    assert "applied 001_initial" in out
    with psycopg.connect(empty_dsn) as conn:
        schema.check(conn)

    assert main(["--dsn", empty_dsn, "migrate"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_cli_migrate_uses_fastjobs_dsn(empty_dsn, monkeypatch, capsys):
    monkeypatch.setenv("FASTJOBS_DSN", empty_dsn)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert main(["migrate"]) == 0
    assert "applied 001_initial" in capsys.readouterr().out
    assert "fastjobs_jobs" in _tables(empty_dsn)


def test_check_on_empty_database_says_run_migrate(empty_dsn):
    with psycopg.connect(empty_dsn) as conn, pytest.raises(SchemaMissing, match="fastjobs migrate"):
        schema.check(conn)


def test_check_with_an_empty_migrations_table_says_run_migrate(empty_dsn):
    with psycopg.connect(empty_dsn) as conn:
        conn.execute(sql.migration_table_create)
        conn.commit()
        with pytest.raises(SchemaMissing, match="fastjobs migrate"):
            schema.check(conn)


def test_check_passes_on_a_migrated_database(dsn):
    with psycopg.connect(dsn) as conn:
        schema.check(conn)
