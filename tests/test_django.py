"""fastjobs as Django's task backend, in the small project of tests/django_project on the real PostgreSQL.

In-process tests set Django up once and point its connection at each test's
own database; the management command and Django's own test runner run as
real processes (`manage.py fastjobs_run`, `manage.py test`).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

django = pytest.importorskip("django", minversion="6.0")

PROJECT = Path(__file__).parent / "django_project"
sys.path.insert(0, str(PROJECT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproject.settings")
django.setup()

from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.tasks import TaskResultStatus, default_task_backend, task_backends  # noqa: E402
from django.tasks.exceptions import TaskResultDoesNotExist  # noqa: E402
from django.test import Client  # noqa: E402

from fastjobs import schema  # noqa: E402
from fastjobs.contrib.django import FastjobsBackend  # noqa: E402
from shop.models import Order, Run  # noqa: E402
from shop.tasks import OutOfStock, add, double, fail, record, refuse, whoami  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

APP_NAME = "fastjobs-django-test"  # the project's Django sessions, in pg_stat_activity


def _point_django_at(dsn: str) -> None:
    info = conninfo_to_dict(dsn)
    connections.close_all()
    wrapper = connections["default"]
    wrapper.settings_dict.update(
        NAME=info["dbname"],
        USER=info.get("user", "postgres"),
        HOST=info.get("host", "127.0.0.1"),
        PORT=str(info.get("port", "5432")),
    )


@pytest.fixture
def project(dsn: str) -> Iterator[str]:
    """The test's database, fastjobs' schema in it (the template's), the project's tables migrated."""
    _point_django_at(dsn)
    call_command("migrate", verbosity=0)
    yield dsn
    connections.close_all()


@pytest.fixture
def backend(project: str) -> FastjobsBackend:
    found = task_backends["default"]
    assert isinstance(found, FastjobsBackend)
    return found


def _jobs(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT kind, queue, priority, args, state::text FROM fastjobs_jobs_all ORDER BY id"
        ).fetchall()


# Enqueue in Django's transaction -------------------------------------------


def test_a_view_s_job_exists_iff_its_atomic_block_commits(backend):
    client = Client(raise_request_exception=False)
    ok = client.post("/orders", {"email": "a@example.com"})
    assert ok.status_code == 200
    failed = client.post("/orders", {"email": "b@example.com", "fail": "1"})
    assert failed.status_code == 500
    order = ok.json()["order"]
    assert list(Order.objects.values_list("id", flat=True)) == [order]
    # One job, of the kind and queue of the task, at its priority; none for the rolled-back order.
    assert _jobs(backend.dsn()) == [
        ("shop.tasks.confirm", "emails", 10, {"args": [order], "kwargs": {}}, "available")
    ]
    with backend.testing() as kit:
        assert kit.drain().completed == 1
    assert Order.objects.get(id=order).confirmed


def test_enqueue_joins_the_open_atomic_block_and_its_savepoints(backend):
    with transaction.atomic():
        kept = add.enqueue(1, 2)
        with pytest.raises(RuntimeError), transaction.atomic():
            add.enqueue(3, 4)
            raise RuntimeError("rolls back to the savepoint")
        # Read on the same connection: the job is visible to its own transaction.
        assert add.get_result(kept.id).status == TaskResultStatus.READY
        assert _jobs(backend.dsn()) == []  # ... and to no one else yet
    assert [row[3] for row in _jobs(backend.dsn())] == [{"args": [1, 2], "kwargs": {}}]
    with pytest.raises(RuntimeError), transaction.atomic():
        add.enqueue(5, 6)
        raise RuntimeError("the whole block rolls back")
    assert len(_jobs(backend.dsn())) == 1


def test_outside_a_block_the_job_is_committed_at_once(backend):
    add.enqueue(1, 1)
    assert len(_jobs(backend.dsn())) == 1


# Results ----------------------------------------------------------------------


def test_get_result_status_return_value_and_errors(backend):
    ok = add.enqueue(2, 3)
    bad = fail.enqueue("no stock")
    assert ok.status == TaskResultStatus.READY and not ok.is_finished
    with backend.testing() as kit:
        kit.drain()
    done = add.get_result(ok.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.args == [2, 3] and done.kwargs == {}
    assert done.enqueued_at <= done.started_at <= done.finished_at
    assert done.attempts == 1 and done.errors == []
    failed = default_task_backend.get_result(bad.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.task.func is fail.func
    with pytest.raises(ValueError, match="Task failed"):
        _ = failed.return_value
    [error] = failed.errors
    assert error.exception_class is ValueError
    assert "no stock" in error.traceback
    # A class of the project's own, by its path.
    refused = refuse.enqueue("socks")
    with backend.testing() as kit:
        kit.drain()
    [error] = refuse.get_result(refused.id).errors
    assert error.exception_class_path == "shop.tasks.OutOfStock"
    assert error.exception_class is OutOfStock
    # refresh() reads it again; an unknown id is TaskResultDoesNotExist.
    ok.refresh()
    assert ok.status == TaskResultStatus.SUCCESSFUL and ok.return_value == 5
    for unknown in ("999999", "not-an-id"):
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(unknown)


def test_a_failed_task_is_retried_when_max_attempts_allows_and_is_ready_in_between(backend, monkeypatch):
    monkeypatch.setattr(backend, "max_attempts", 3)
    kinds = set(backend.tasks)
    backend.tasks.clear()
    backend.app.jobs.clear()
    try:
        for name in kinds:  # registered anew, with 3 attempts
            backend.validate_task(_task(name))
        result = fail.enqueue("flaky")
        with backend.testing() as kit:
            kit.drain()
            assert fail.get_result(result.id).status == TaskResultStatus.READY  # retryable
            kit.drain(now=dt.timedelta(days=1))
        final = fail.get_result(result.id)
        assert final.status == TaskResultStatus.FAILED
        assert final.attempts == 3 and len(final.errors) == 3
    finally:
        monkeypatch.undo()
        backend.tasks.clear()
        backend.app.jobs.clear()
        for name in kinds:
            backend.validate_task(_task(name))


def _task(module_path: str) -> Any:
    from django.utils.module_loading import import_string

    return import_string(module_path)


def test_aenqueue_aget_result_and_an_async_task(backend):
    """aenqueue and aget_result run Django's connection on a thread of asgiref's (Django's base
    class), which is where the connection is closed after; the async task runs on the worker's loop."""
    import asyncio

    from asgiref.sync import sync_to_async

    async def enqueue() -> Any:
        try:
            return await double.aenqueue(21)
        finally:
            await sync_to_async(connections.close_all)()

    async def fetch(result_id: str) -> Any:
        try:
            return await double.aget_result(result_id)
        finally:
            await sync_to_async(connections.close_all)()

    enqueued = asyncio.run(enqueue())
    with backend.testing() as kit:
        kit.drain()
    done = asyncio.run(fetch(enqueued.id))
    assert done.id == enqueued.id
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 42


def test_the_testing_kit_is_manual_only(backend):
    with pytest.raises(ValueError, match="manual mode only"):
        backend.testing("inline")


def test_takes_context_gets_the_task_result_and_attempt(backend):
    result = whoami.enqueue("hi")
    with backend.testing() as kit:
        kit.drain()
    assert whoami.get_result(result.id).return_value == {"id": result.id, "attempt": 1, "note": "hi"}


# Priorities and run_after ------------------------------------------------------


def test_priorities_are_django_s_and_run_higher_first(backend):
    results = [record.using(priority=priority).enqueue(f"p{priority}") for priority in (-100, 0, 100, 50, -5)]
    assert sorted(row[2] for row in _jobs(backend.dsn())) == [-100, -5, 0, 50, 100]
    with backend.testing() as kit:
        kit.drain()
    # A result's task is the one enqueued, at its priority.
    assert [record.get_result(result.id).task.priority for result in results] == [-100, 0, 100, 50, -5]
    assert list(Run.objects.order_by("id").values_list("name", flat=True)) == [
        "p100",
        "p50",
        "p0",
        "p-5",
        "p-100",
    ]


def test_run_after_defers_the_task(backend):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    result = record.using(run_after=later).enqueue("later")
    assert _jobs(backend.dsn())[0][4] == "scheduled"
    with backend.testing() as kit:
        assert kit.drain().completed == 0
        assert record.get_result(result.id).status == TaskResultStatus.READY
        assert kit.drain(now=dt.timedelta(hours=2)).completed == 1
    assert record.get_result(result.id).status == TaskResultStatus.SUCCESSFUL


def test_the_feature_flags_are_what_the_backend_does():
    assert FastjobsBackend.supports_defer
    assert FastjobsBackend.supports_async_task
    assert FastjobsBackend.supports_get_result
    assert FastjobsBackend.supports_priority


def test_a_database_that_is_not_postgresql_is_refused_clearly(project):
    lite = FastjobsBackend("lite", {"OPTIONS": {"DATABASE": "lite"}, "QUEUES": ["default"]})
    with pytest.raises(ImproperlyConfigured, match="PostgreSQL: DATABASES\\['lite'\\] is sqlite"):
        lite.enqueue(add, (1, 2), {})
    with pytest.raises(ImproperlyConfigured, match="unknown keys"):
        FastjobsBackend("x", {"OPTIONS": {"DATABSE": "default"}})


def test_a_connection_that_is_not_psycopg_3_is_refused_clearly(backend, monkeypatch):
    """psycopg2 under Django's postgresql engine: a stand-in DB-API connection in its place."""
    import sqlite3

    wrapper = connections["default"]
    wrapper.ensure_connection()
    stand_in = sqlite3.connect(":memory:")
    monkeypatch.setattr(wrapper, "connection", stand_in)
    try:
        with pytest.raises(ImproperlyConfigured, match=r"through psycopg 3.*instead of psycopg2"):
            add.enqueue(1, 2)
    finally:
        monkeypatch.undo()
        stand_in.close()


# Migrations ---------------------------------------------------------------------


def _applied(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT version FROM fastjobs_migrations ORDER BY version")]


def test_manage_py_migrate_installs_the_schema_and_fastjobs_migrate_then_does_nothing(empty_dsn):
    _point_django_at(empty_dsn)
    try:
        call_command("migrate", verbosity=0)
    finally:
        connections.close_all()
    versions = [m.version for m in schema.migrations()]
    assert _applied(empty_dsn) == versions
    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate(conn) == []


def test_fastjobs_migrate_first_then_manage_py_migrate_does_nothing_to_it(empty_dsn):
    with psycopg.connect(empty_dsn) as conn:
        schema.migrate(conn)
    with psycopg.connect(empty_dsn) as conn:
        before = conn.execute(
            "SELECT version, applied_at FROM fastjobs_migrations ORDER BY version"
        ).fetchall()
    _point_django_at(empty_dsn)
    try:
        call_command("migrate", verbosity=0)
    finally:
        connections.close_all()
    with psycopg.connect(empty_dsn) as conn:
        after = conn.execute(
            "SELECT version, applied_at FROM fastjobs_migrations ORDER BY version"
        ).fetchall()
        recorded = conn.execute(
            "SELECT name FROM django_migrations WHERE app = 'fastjobs' ORDER BY id"
        ).fetchall()
    assert after == before
    assert [r[0] for r in recorded] == [
        "0001_schema",
        "0002_results",
        "0003_queues",
        "0004_samples",
        "0005_keys",
        "0006_fair",
        "0007_key_groups",
        "0008_keyed_queues",
    ]


def test_options_schema_puts_fastjobs_tables_there_for_migrate_and_enqueue(empty_dsn):
    """OPTIONS["SCHEMA"]: `manage.py migrate` creates the schema and fastjobs' tables in it (none
    in public), and a task enqueued on Django's connection lands there."""
    from django.test import override_settings

    tasks = {
        "default": {"BACKEND": "fastjobs.contrib.django.FastjobsBackend", "OPTIONS": {"SCHEMA": "dj_jobs"}}
    }
    _point_django_at(empty_dsn)
    try:
        with override_settings(TASKS=tasks):
            backend = task_backends["default"]
            assert isinstance(backend, FastjobsBackend) and backend.app.schema == "dj_jobs"
            call_command("migrate", verbosity=0)
            with transaction.atomic():
                record.using(backend="default").enqueue(7)
    finally:
        connections.close_all()
    with psycopg.connect(empty_dsn) as conn:
        applied = conn.execute("SELECT version FROM dj_jobs.fastjobs_migrations ORDER BY version").fetchall()
        assert [row[0] for row in applied] == [m.version for m in schema.migrations()]
        assert conn.execute("SELECT to_regclass('public.fastjobs_jobs_all')").fetchone() == (None,)
        assert conn.execute("SELECT kind FROM dj_jobs.fastjobs_jobs_all").fetchall() == [
            ("shop.tasks.record",)
        ]


def test_a_bad_schema_option_is_refused_clearly():
    with pytest.raises(ImproperlyConfigured, match=r"\['SCHEMA'\]: 'bad name' is not a schema name"):
        FastjobsBackend(
            "jobs", {"BACKEND": "fastjobs.contrib.django.FastjobsBackend", "OPTIONS": {"SCHEMA": "bad name"}}
        )


def test_the_django_migrations_keep_step_with_fastjobs_own():
    """A fastjobs migration needs a Django migration naming its version: the last one names the last."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    leaves = loader.graph.leaf_nodes("fastjobs")
    assert len(leaves) == 1
    migration = loader.get_migration(*leaves[0])
    [operation] = migration.operations
    assert operation.code.__qualname__ == f"migrate_to_{len(schema.migrations())}"


# The management command and Django's test runner, as real processes ---------------


def _env(dsn: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FASTJOBS_DJANGO_DSN=dsn, PYTHONPATH=os.pathsep.join([str(PROJECT), str(PROJECT.parent.parent)])
    )
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(extra)
    return env


def _django_sessions(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            # The workers' own sessions carry the same name (their DSN is Django's settings'):
            # Django's are those whose last statement was the task's.
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND query LIKE %s",
            (APP_NAME, '%"shop_run"%'),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("max_age", "threads"), [(0, 0), (600, 0), (0, 3)])
def test_fastjobs_run_runs_the_tasks_and_leaks_no_connection(backend, tmp_path, max_age, threads):
    """100 tasks using the ORM under `manage.py fastjobs_run --processes 2`: with CONN_MAX_AGE=0
    each task's connection is closed after it (none left once they are done), sync tasks on
    threads (`--queues default:3`) included; with a persistent one, each worker process keeps one
    and reuses it (at most 2), never one per task."""
    dsn = backend.dsn()
    stderr = (tmp_path / "stderr").open("w+")
    queues = ["--queues", f"default:{threads},emails:1"] if threads else []
    master = subprocess.Popen(
        [sys.executable, "manage.py", "fastjobs_run", "--processes", "2", "--log-level", "INFO", *queues],
        cwd=PROJECT,
        env=_env(dsn, FASTJOBS_DJANGO_CONN_MAX_AGE=str(max_age)),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
    try:
        for i in range(100):
            record.enqueue(f"r{i}")
        connections.close_all()  # the test's own Django session is not counted
        assert wait_for(lambda: Run.objects.count() == 100 or master.poll() is not None, timeout=60)
        connections.close_all()
        assert master.poll() is None, (tmp_path / "stderr").read_text()
        pids = set(Run.objects.values_list("pid", flat=True))
        connections.close_all()
        assert master.pid not in pids and 1 <= len(pids) <= 2
        if max_age == 0:
            assert wait_for(lambda: _django_sessions(dsn) == 0, timeout=10), _django_sessions(dsn)
        else:
            assert 1 <= _django_sessions(dsn) <= 2
        # The results were kept, through the workers.
        assert {r[4] for r in _jobs(dsn)} <= {"completed"}
    finally:
        os.killpg(master.pid, signal.SIGTERM)
        code = master.wait(30)
        stderr.close()
    assert code == 0, (tmp_path / "stderr").read_text()


def test_fastjobs_run_takes_the_options_of_fastjobs_run():
    out = subprocess.run(
        [sys.executable, "manage.py", "fastjobs_run", "--help"],
        cwd=PROJECT,
        env=_env("postgresql://unused"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in ("--processes", "--queues", "--grace", "--keep-completed", "--rescue-after", "--log-level"):
        assert option in out


def test_django_s_test_runner_with_the_testing_kit(project):
    """`manage.py test` creates its test database with `migrate` (fastjobs' schema included) and
    runs shop/tests.py, which drains with the backend's testing kit."""
    run = subprocess.run(
        [sys.executable, "manage.py", "test", "shop", "--noinput", "-v", "2"],
        cwd=PROJECT,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Ran 2 tests" in run.stderr and "OK" in run.stderr


def test_importing_fastjobs_never_imports_django():
    probe = (
        "import sys, fastjobs, fastjobs.cli; print([m for m in sys.modules if m.split('.')[0] == 'django'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
