"""App(schema=...): fastjobs' tables in a schema of their own, in a database shared with other applications.

Every statement names the schema (fastjobs.sql.of), enqueues on the caller's
connection too, whose search_path is left alone; `fastjobs migrate --schema`
creates it. Two schemas of one database are two installations: their jobs,
leaders, channels, stats and rotations never meet.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

from fastjobs import App, maintenance, queues, schema, sql
from fastjobs.cli import main
from fastjobs.errors import ConfigurationError, SchemaMissing

from . import procs
from .helpers import drain, query
from .test_migrations import psql

# Two schemas: a plain name, and one that must be quoted.
A, B = "jobs_a", "Jobs-B"

# Every name of fastjobs' objects a statement may use.
NAMES = re.compile(
    r"fastjobs_(?:jobs_all|jobs_[1-4]|jobs|workers|periodic|results|migrations|state|sleep_until|slot|queues|room)\b"
)


def _objects(dsn: str, namespace: str) -> list[tuple[str, str]]:
    """(kind, name) of every object of schema `namespace`: relations (tables, partitions, indexes,
    sequences), types, functions and triggers."""
    rows = query(
        dsn,
        """SELECT c.relkind::text AS kind, c.relname::text AS name FROM pg_class c
            WHERE c.relnamespace = to_regnamespace(%(n)s)
           UNION ALL SELECT 'type', t.typname::text FROM pg_type t
            WHERE t.typnamespace = to_regnamespace(%(n)s) AND t.typtype = 'e'
           UNION ALL SELECT 'function', p.proname::text FROM pg_proc p
            WHERE p.pronamespace = to_regnamespace(%(n)s)
           UNION ALL SELECT 'trigger', g.tgname::text FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
            WHERE c.relnamespace = to_regnamespace(%(n)s) AND NOT g.tgisinternal
           ORDER BY 1, 2""",
        {"n": f'"{namespace}"'},
    )
    return [(r["kind"], r["name"]) for r in rows]


@pytest.fixture
def schemas(dsn: str) -> Iterator[tuple[App, App]]:
    """Apps of schemas A and B, migrated into the test's database (which has the default one too)."""
    with psycopg.connect(dsn) as conn:
        for name in (A, B):
            schema.migrate(conn, schema=name)
    apps = App(dsn, schema=A), App(dsn, schema=B)
    yield apps
    for app in apps:
        app.close()


def _count(dsn: str, namespace: str) -> int:
    return int(query(dsn, f'SELECT count(*) AS n FROM "{namespace}".fastjobs_jobs_all')[0]["n"])


# -- names


@pytest.mark.parametrize(
    "name", ["", "bad name", "pg_jobs", "1jobs", 'a"b', "a'b", "a.b", "x" * 48, "jobs;drop", "ünïcode"]
)
def test_a_schema_name_fastjobs_cannot_use_is_refused_clearly(name: str, monkeypatch, capsys) -> None:
    with pytest.raises(ConfigurationError, match="is not a schema name fastjobs takes"):
        App("postgresql://nobody@127.0.0.1:1/x", schema=name)
    if name:  # an empty FASTJOBS_SCHEMA is unset
        monkeypatch.setenv("FASTJOBS_SCHEMA", name)
        with pytest.raises(ConfigurationError, match=r"FASTJOBS_SCHEMA: .* is not a schema name"):
            App("postgresql://nobody@127.0.0.1:1/x")
        assert main(["sql", "show", "job_insert"]) == 3  # the boot error: do not restart
        assert "FASTJOBS_SCHEMA" in capsys.readouterr().err


def test_the_longest_name_fits_every_channel_and_the_staging_table() -> None:
    catalogue = sql.of("x" * sql.SCHEMA_MAX)
    names = [
        catalogue.NOTIFY_CHANNEL,
        catalogue.PING_CHANNEL,
        catalogue.CANCEL_CHANNEL,
        catalogue.RESULT_CHANNEL,
    ]
    assert max(len(n.encode()) for n in names) == 63  # PostgreSQL's identifiers: NAMEDATALEN - 1
    staged = re.search(r'"(fastjobs_staged_\w+)"', catalogue.job_stage_create)
    assert staged is not None and len(staged[1]) <= 63


def test_the_default_catalogue_names_nothing_and_a_schemas_names_everything_in_it() -> None:
    assert sql.of(None) is sql and sql.SCHEMA is None
    assert sql.of(A) is sql.of(A)  # built once
    for name in (A, B):
        catalogue = sql.of(name)
        assert name == catalogue.SCHEMA
        assert list(catalogue.STATEMENTS) == list(sql.STATEMENTS)
        assert catalogue.SECTIONS == sql.SECTIONS
        for statement, text in catalogue.STATEMENTS.items():
            bare = [
                m.start()
                for m in NAMES.finditer(text)
                if text[max(0, m.start() - len(name) - 3) : m.start()] != f'"{name}".'
            ]
            assert bare == [], f"{statement} names an object outside {name}: {text}"
        channels = [
            catalogue.NOTIFY_CHANNEL,
            catalogue.PING_CHANNEL,
            catalogue.CANCEL_CHANNEL,
            catalogue.RESULT_CHANNEL,
        ]
        assert channels == [
            f"{c}.{name}" for c in ("fastjobs", "fastjobs_ping", "fastjobs_cancel", "fastjobs_result")
        ]
        assert catalogue.LEADER_LOCK_KEY not in (
            sql.LEADER_LOCK_KEY,
            sql.of(A if name == B else B).LEADER_LOCK_KEY,
        )
        assert -(2**63) <= catalogue.LEADER_LOCK_KEY < 2**63
    # `public` is where App()'s tables usually are: the same channels and key (one installation).
    public = sql.of("public")
    assert (public.NOTIFY_CHANNEL, public.LEADER_LOCK_KEY) == (sql.NOTIFY_CHANNEL, sql.LEADER_LOCK_KEY)
    assert 'INSERT INTO "public".fastjobs_jobs_all' in public.job_insert_now


def test_every_statement_of_a_schemas_catalogue_prepares_against_it(
    dsn: str, schemas: tuple[App, App]
) -> None:
    """As tests/test_sql.py proves the default catalogue: each statement of B's (a name that must be
    quoted) prepares against B, on a session whose search_path finds no fastjobs table."""
    catalogue = sql.of(B)
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute("SET search_path TO pg_catalog")
        cur.execute(catalogue.job_stage_create)  # the staging statements refer to the session's temp table
        for name in sorted(set(catalogue.STATEMENTS) - catalogue.NOT_PREPARABLE):
            cur.execute(f"PREPARE {name} AS {catalogue.STATEMENTS[name]}")
        names = {row[0] for row in cur.execute("SELECT name FROM pg_prepared_statements")}
        # And those PREPARE cannot take, run as they are sent.
        for name in ("vacuum_jobs", "listen_jobs", "listen_cancel", "unlisten_result", "job_stage_clear"):
            cur.execute(catalogue.STATEMENTS[name])
        for name in ("job_copy", "job_copy_at", "job_copy_staged"):
            with cur.copy(catalogue.STATEMENTS[name]):
                pass  # no rows: the statement is accepted, the table found
        with conn.transaction():
            partition = pgsql.Identifier(*catalogue.relation("fastjobs_jobs_1"))
            cur.execute(pgsql.SQL(catalogue.slot_lock).format(partition=partition))
            cur.execute(pgsql.SQL(catalogue.slot_truncate).format(partition=partition))
    assert names == set(catalogue.STATEMENTS) - catalogue.NOT_PREPARABLE


def test_sql_show_prints_a_schemas_statement(capsys) -> None:
    assert main(["sql", "show", "job_cancel", "--schema", B]) == 0
    shown = capsys.readouterr().out
    assert shown == sql.of(B).job_cancel.lstrip("\n") + "\n"
    assert f'UPDATE "{B}".fastjobs_jobs_all j' in shown and f"pg_notify('fastjobs_cancel.{B}'" in shown
    assert main(["--schema", B, "sql", "show", "job_cancel"]) == 0
    assert capsys.readouterr().out == shown


# -- migrations


def test_migrate_creates_the_schema_and_puts_every_object_in_it(
    empty_dsn: str, capsys, tmp_path: Path
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("SET search_path TO pg_catalog")  # a caller's own: left as it was
        applied = schema.migrate(conn, schema=A)
        assert [m.version for m in applied] == [m.version for m in schema.migrations()]
        assert schema.migrate(conn, schema=A) == []  # the second run finds everything applied
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog",)
        schema.check(conn, sql.of(A))
        with pytest.raises(SchemaMissing, match=r"run `fastjobs migrate`"):
            schema.check(conn)  # the default schema was never migrated
    objects = _objects(empty_dsn, A)
    assert ("r", "fastjobs_jobs") in objects and ("p", "fastjobs_jobs_all") in objects  # slot 0, the parent
    assert {("r", f"fastjobs_jobs_{slot}") for slot in range(1, 5)} <= set(objects)  # the rotating slots
    assert {("S", "fastjobs_slot"), ("S", "fastjobs_sleep_until"), ("S", "fastjobs_jobs_id")} <= set(objects)
    assert ("type", "fastjobs_state") in objects and ("function", "fastjobs_notify_inserted") in objects
    assert {("trigger", "fastjobs_jobs_notify"), ("trigger", "fastjobs_jobs_all_notify")} <= set(objects)
    assert ("i", "fastjobs_jobs_unique_idx") in objects and ("i", "fastjobs_jobs_1_claim_idx") in objects
    assert ("r", "fastjobs_migrations") in objects and ("r", "fastjobs_results") in objects
    assert [o for o in _objects(empty_dsn, "public") if "fastjobs" in o[1]] == []
    # The trigger's function notifies the schema's channel.
    source = query(empty_dsn, f"SELECT prosrc FROM pg_proc WHERE pronamespace = '{A}'::regnamespace")
    assert f"pg_notify('fastjobs.{A}'" in source[0]["prosrc"]

    # `fastjobs migrate --sql --schema` through psql builds the same schema, and migrate finds it done.
    assert main(["migrate", "--sql", "--schema", B]) == 0
    script = capsys.readouterr().out
    assert f'CREATE SCHEMA IF NOT EXISTS "{B}";' in script and f'SET search_path TO "{B}";' in script
    result = psql(empty_dsn, script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _objects(empty_dsn, B) == objects
    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate(conn, schema=B) == []
    # The migrations table is each schema's own.
    assert main(["--dsn", empty_dsn, "migrate", "--schema", B]) == 0
    assert "up to date" in capsys.readouterr().out


# -- enqueue


def test_enqueue_in_a_schema_on_every_path_leaves_the_callers_search_path_alone(
    dsn: str, schemas: tuple[App, App]
) -> None:
    app, _ = schemas

    @app.job("hello")
    def hello(n: int) -> None: ...

    @app.job("keyed", unique=True)
    def keyed(n: int) -> None: ...

    hello.enqueue(n=1)  # fastjobs' own pool, straight through libpq
    hello.options(delay=60).enqueue(n=2)  # scheduled: into slot 0
    assert hello.enqueue_many([{"n": i} for i in range(3, 8)]) == 5  # COPY
    assert keyed.enqueue_many([{"n": 1}, {"n": 1}, {"n": 2}]) == 2  # staged COPY: the schema's temp table
    with psycopg.connect(dsn) as conn:
        conn.execute("SET search_path TO pg_catalog")  # where no fastjobs table is
        with conn.transaction():
            hello.using(conn).enqueue(n=8)
            assert keyed.enqueue_many([{"n": 3}], conn=conn) == 1
        with pytest.raises(RuntimeError), conn.transaction():
            hello.using(conn).enqueue(n=9)
            raise RuntimeError("rolled back")  # nothing of it is kept
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog",)

    async def on_async() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("SET search_path TO pg_catalog")
            async with conn.transaction():
                await hello.using(conn).enqueue_async(n=10)
                await hello.enqueue_many_async([{"n": 11}], conn=conn)
            assert await (await conn.execute("SHOW search_path")).fetchone() == ("pg_catalog",)
        await hello.enqueue_async(n=12)
        await app.aclose()

    asyncio.run(on_async())
    rows = query(dsn, f"SELECT kind, args->>'n' AS n FROM {A}.fastjobs_jobs_all ORDER BY id")
    assert sorted(int(r["n"]) for r in rows if r["kind"] == "hello") == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]
    assert sorted(int(r["n"]) for r in rows if r["kind"] == "keyed") == [1, 2, 3]
    assert query(dsn, "SELECT count(*) AS n FROM fastjobs_jobs_all") == [{"n": 0}]
    assert _count(dsn, B) == 0


def test_an_enqueue_into_a_schema_not_migrated_says_to_migrate_it(dsn: str) -> None:
    app = App(dsn, schema="nowhere")
    hint = r"run `fastjobs migrate --schema nowhere`"
    try:
        with pytest.raises(SchemaMissing, match=hint):
            app.enqueue("anything")
        with pytest.raises(SchemaMissing, match=hint):
            app.enqueue("anything", delay=5)
        with pytest.raises(SchemaMissing, match=hint):
            app.enqueue_many("anything", [{}])
        with psycopg.connect(dsn) as conn, pytest.raises(SchemaMissing, match=hint):
            app.enqueue("anything", conn=conn)

        async def on_async() -> None:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                with pytest.raises(SchemaMissing, match=hint):
                    await app.enqueue_async("anything", conn=conn)

        asyncio.run(on_async())
    finally:
        app.close()
    result = procs.cli(dsn, "--schema", "nowhere", "stats")
    assert result.returncode == 3 and "fastjobs migrate --schema nowhere" in result.stderr


def test_fastjobs_schema_is_the_default_and_configure_changes_it(
    dsn: str, schemas: tuple[App, App], monkeypatch
) -> None:
    monkeypatch.setenv("FASTJOBS_SCHEMA", B)
    app = App(dsn)
    try:
        assert app.schema == B and app.sql is sql.of(B)
        app.enqueue("x")
        app.configure(schema=A)
        app.enqueue("x")
        assert App(dsn, schema=A).schema == A  # schema= over FASTJOBS_SCHEMA
    finally:
        app.close()
    assert (_count(dsn, A), _count(dsn, B)) == (1, 1)


def test_pausing_and_limiting_a_queue_is_the_schemas_own(dsn: str, schemas: tuple[App, App]) -> None:
    app, other = schemas
    app.pause("default")
    app.limit_queue("default", max_backlog=1)
    assert [(q.name, q.paused, q.max_backlog) for q in app.queues()] == [("default", True, 1)]
    assert other.queues() == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        queues.count_backlogs(conn, app.sql)  # the leader's count: the schema's queues
        assert queues.list_queues(conn) == []  # the default schema's: untouched
    app.enqueue("x")
    other.enqueue("x")  # B's queue has no limit
    listed = procs.cli(dsn, "queues", "list", "--json", "--schema", A)
    assert [q["name"] for q in json.loads(listed.stdout)] == ["default"], listed.stderr
    assert app.resume("default") is True and other.resume("default") is False


def test_a_limited_queues_room_is_counted_in_its_schema(dsn: str, schemas: tuple[App, App]) -> None:
    """fastjobs_room (a claim of a limited queue calls it) counts the jobs of its own schema, whatever
    the worker's search_path finds: here a running job of the default schema's queue of that name."""
    app, _ = schemas
    app.job("x")(_nothing)
    app.limit_queue("default", concurrency=1, rate_limit="1000/s")
    query(
        dsn,
        "INSERT INTO fastjobs_jobs (queue, kind, state, attempted_by, attempted_at)"
        " VALUES ('default', 'x', 'running', 'elsewhere', now())",
    )
    for _ in range(3):
        app.enqueue("x")
    drain(app, ["default"])
    assert _count(dsn, A) == 0  # each ran (and was deleted): A's room was A's


def _nothing() -> None:
    pass


# -- running, results, cancel, periodic, rotation, stats


def test_a_worker_results_cancel_periodic_and_rotation_in_a_schema(
    dsn: str, schemas: tuple[App, App]
) -> None:
    app, other = schemas
    started = threading.Event()

    @app.job("double", keep_result=60)
    def double(n: int) -> int:
        return 2 * n

    @app.job("wait")
    async def wait() -> None:
        started.set()
        await asyncio.sleep(60)

    @other.job("double")
    def other_double(n: int) -> int:
        raise AssertionError("a job of another schema")

    other_id = other_double.enqueue(n=1)
    handle = double.enqueue(n=21)
    drain(app, ["default"])
    assert handle.result(timeout=10) == 42
    assert app.status(handle).state == "completed"
    assert other.status(other_id).state == "available"  # not run: another schema's
    # Each schema numbers its jobs: the same id is two jobs (why a cancel, whose payload is an id,
    # must never reach another schema's workers).
    assert int(handle) == int(other_id)  # both schemas' first job

    # Cancel a running job: its worker hears it on the schema's channel.
    job_id = app.enqueue("wait")
    worker = threading.Thread(target=drain, args=(app, ["default"]), daemon=True)
    worker.start()
    assert started.wait(30)
    assert app.cancel(job_id) == "cancelling"
    worker.join(30)
    assert not worker.is_alive()
    assert app.status(job_id).state == "cancelled"

    # The leader's periodic enqueue and its record are the schema's.
    spec = app.job("tick", cron="* * * * *")(lambda: None).spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        now = dt.datetime.now(dt.UTC).replace(second=1)
        assert maintenance.periodic_once(conn, [spec], now=now, app=app) == [
            ("tick", now.replace(second=0, microsecond=0))
        ]
        found = maintenance.periodic_status(conn, [spec], sql=app.sql)
        assert [p.last_tick is not None for p in found] == [True]
        assert maintenance.periodic_status(conn, [spec], sql=other.sql)[0].last_tick is None
    assert query(dsn, f"SELECT count(*) AS n FROM {A}.fastjobs_jobs_all WHERE kind = 'tick'") == [{"n": 1}]

    # The rotation empties and advances the schema's slots, and no other's.
    def current(namespace: str) -> int:
        return int(query(dsn, f'SELECT last_value AS v FROM "{namespace}".fastjobs_slot')[0]["v"])

    before = current(A), current(B), int(query(dsn, "SELECT last_value AS v FROM fastjobs_slot")[0]["v"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert maintenance.rotate_once(conn, sql=app.sql)["rotated"] == 1
        rotator = maintenance.Rotator(maintenance.RotationConfig(worth=0), sql=other.sql)
        assert rotator.turn(conn)[0]["rotated"] == 1
    assert current(A) == before[0] % 4 + 1 and current(B) == before[1] % 4 + 1
    assert int(query(dsn, "SELECT last_value AS v FROM fastjobs_slot")[0]["v"]) == before[2]

    # `fastjobs stats` and `jobs list` show the schema's jobs only.
    doc = json.loads(procs.cli(dsn, "--schema", B, "stats", "--json").stdout)
    assert [(q["queue"], q["state"], q["count"]) for q in doc["queues"]] == [("default", "available", 1)]
    listed = procs.cli(dsn, "jobs", "list", "--json", "--schema", A)
    assert listed.returncode == 0, listed.stderr
    assert {job["kind"] for job in json.loads(listed.stdout)} == {"tick", "wait"}  # the cancelled one kept


def test_two_schemas_run_side_by_side_and_never_meet(
    dsn: str, schemas: tuple[App, App], masters: procs.Masters
) -> None:
    """Two `fastjobs run` of one database, schemas A and B, at once: each runs its own jobs once, has
    its leader, and hears none of the other's wake-ups, cancels or results."""
    app_a, app_b = schemas
    listener = psycopg.connect(dsn, autocommit=True)
    channels = [c for name in (None, A, B) for c in sql.of(name).CHANNELS] + ["fastjobs_test_end"]
    for channel in channels:
        listener.execute(f'LISTEN "{channel}"')
    try:
        master_a = masters.start("--processes", "2", options=("--schema", A))
        master_b = masters.start("--processes", "2", options=("--schema", B))
        keys = {sql.of(A).LEADER_LOCK_KEY, sql.of(B).LEADER_LOCK_KEY}
        held = (
            "SELECT (classid::bigint << 32 | objid::bigint) AS key FROM pg_locks"
            " WHERE locktype = 'advisory' AND granted"
        )
        procs.wait_for(lambda: {r["key"] for r in query(dsn, held)} >= keys, "both schemas' leaders")
        n = 200
        assert app_a.enqueue_many("record", [{"n": i} for i in range(n)]) == n
        assert app_b.enqueue_many("record", [{"n": n + i} for i in range(n)]) == n
        for i in range(5):  # one at a time too: each wakes its own schema's sleeping workers
            app_a.enqueue("record", {"n": 2 * n + i})
            app_b.enqueue("record", {"n": 3 * n + i})
        procs.wait_for(
            lambda: query(dsn, "SELECT count(*) AS c FROM runs")[0]["c"] >= 2 * n + 10, "every job run", 60
        )
        # A running job cancelled in A: its notification carries a job id, which B's workers never hear.
        running = app_a.enqueue("record_async", {"n": -1, "sleep": 60})
        procs.wait_for(lambda: query(dsn, "SELECT 1 FROM runs WHERE n = -1"), "the long job to start")
        assert app_a.cancel(running) == "cancelling"
        procs.wait_for(lambda: app_a.status(running).state == "cancelled", "the cancel to reach A's worker")
        kept = app_b.enqueue("record", {"n": -2}, keep_result=60)
        assert app_b.result(kept, timeout=30) is None

        runs = query(dsn, "SELECT n, pid FROM runs WHERE n >= 0")
        assert sorted(r["n"] for r in runs) == list(range(2 * n)) + list(range(2 * n, 2 * n + 5)) + list(
            range(3 * n, 3 * n + 5)
        )
        ran_by = {r["n"]: r["pid"] for r in runs}
        pids_a, pids_b = set(master_a.forks()), set(master_b.forks())
        assert all(pid in pids_a for k, pid in ran_by.items() if k < n or 2 * n <= k < 3 * n)
        assert all(pid in pids_b for k, pid in ran_by.items() if n <= k < 2 * n or k >= 3 * n)
        # B's workers sleep (inserts of B notify), and a job of B's on a queue nobody serves wakes
        # B's workers alone: the trigger of each schema notifies its own channel.
        with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
            cur.execute(sql.of(B).worker_sleep, (3600,))
        app_b.enqueue("record", {"n": -3}, queue="only_b")

        # What was heard, channel by channel: each schema's on its own channels only.
        query(dsn, 'NOTIFY "fastjobs_test_end"')
        heard: dict[str, set[str]] = {}
        for note in listener.notifies(timeout=30):
            if note.channel == "fastjobs_test_end":
                break
            heard.setdefault(note.channel, set()).add(note.payload)
        assert heard.get(sql.of(A).CANCEL_CHANNEL) == {str(running)}
        assert str(kept) in ",".join(heard.get(sql.of(B).RESULT_CHANNEL, set()))
        assert not set(heard) & sql.CHANNELS, heard  # the default schema's channels: silent
        assert sql.of(B).CANCEL_CHANNEL not in heard and sql.of(A).RESULT_CHANNEL not in heard
        assert "only_b" in heard[sql.of(B).NOTIFY_CHANNEL]
        assert "only_b" not in heard.get(sql.of(A).NOTIFY_CHANNEL, set())

        # Each `fastjobs --schema stats` sees its own cluster: its workers, none of the other's.
        for name, master in ((A, master_a), (B, master_b)):
            doc = procs.stats_json(dsn, "--schema", name)
            pids = {w["pid"] for host in doc["cluster"] for w in host["workers"]}
            assert pids and pids <= set(master.forks())
    finally:
        listener.close()
    for master in (master_a, master_b):
        assert master.stop() == 0
