"""FastjobsBackend: Django's task backend contract on a fastjobs App of the backend's own.

A Django task is a fastjobs job whose kind is the task's module path and
whose args are `{"args": [...], "kwargs": {...}}` (Django passes both). The
backend registers each task on its App when Django validates it, which
happens when the `@task` decorator runs: a worker knows every task whose
module it imported (`manage.py fastjobs_run` imports each installed app's
`tasks` module, and the modules of OPTIONS["MODULES"], before forking).

An enqueue runs on Django's own connection of OPTIONS["DATABASE"], so it
joins the `transaction.atomic()` block open there: the job exists if and
only if that block commits. Outside a block Django's connection is in
autocommit and the job is committed at once.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connections
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.module_loading import autodiscover_modules, import_string
from psycopg.conninfo import make_conninfo

import fastjobs
from fastjobs import errors

if TYPE_CHECKING:
    from fastjobs.testing import Mode, Testing

__all__ = ["FastjobsBackend", "django_dsn"]

# Django's connection parameters that are psycopg's, not libpq's: left out of the workers' DSN.
_NOT_LIBPQ = frozenset({"context", "cursor_factory", "prepare_threshold"})

# What a Django task's result says for each fastjobs state.
STATUS = {
    "available": TaskResultStatus.READY,
    "scheduled": TaskResultStatus.READY,
    "retryable": TaskResultStatus.READY,  # failed, and will run again: Django has no such status
    "running": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "discarded": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def django_dsn(alias: str = DEFAULT_DB_ALIAS) -> str:
    """A libpq DSN for Django's database `alias`, as its settings stand (the test database in tests)."""
    connection = connections[alias]
    _check_vendor(connection, alias)
    params = connection.get_connection_params()
    return make_conninfo(
        "", **{k: v for k, v in params.items() if k not in _NOT_LIBPQ and isinstance(v, str | int)}
    )


def _check_vendor(connection: Any, alias: str) -> None:
    if connection.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"fastjobs keeps its jobs in PostgreSQL: DATABASES[{alias!r}] is {connection.vendor}"
            " (give the task backend OPTIONS['DATABASE'] the alias of a PostgreSQL database)"
        )


class FastjobsBackend(BaseTaskBackend):  # type: ignore[misc]  # django has no type information
    """Django's task backend on fastjobs (BACKEND "fastjobs.contrib.django.FastjobsBackend").

    OPTIONS (all optional): "DATABASE", the alias whose connection enqueues
    join and whose database holds the jobs (default "default"); "DSN", the
    workers' DSN when it differs from that database's settings (a pooler in
    between, say); "MAX_ATTEMPTS", attempts of a task before it is FAILED
    (default 1: a Django task that raises is failed, as Django's own
    backends have it; more makes fastjobs retry it with its backoff,
    `READY` in between); "MODULES", modules holding tasks that are not in an
    installed app's `tasks` module, imported by `manage.py fastjobs_run`;
    "KEEP_RESULT", seconds a finished task's outcome is kept for
    `get_result` (default a day; fastjobs' results table, cleaned by the
    leader); "SCHEMA", the PostgreSQL schema of fastjobs' tables in that
    database (default FASTJOBS_SCHEMA, else none: the search_path's), which
    `manage.py migrate` creates and migrates (docs/operations/schemas.md).

    Priorities are Django's -100..100, stored as they are: fastjobs runs a
    higher priority first, as Django means it, and a job of fastjobs' own at
    its default priority 0 ranks with Django's default 0.
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    # The management command sets it in the workers' master: close_old_connections() then runs
    # before and after each task, as Django does around a request. Not in tests, where the testing
    # kit drains on the test's own thread and its connection is the test's (Django's test client
    # disconnects close_old_connections for the same reason).
    close_connections: ClassVar[bool] = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = self.options
        unknown = set(options) - {"DATABASE", "DSN", "KEEP_RESULT", "MAX_ATTEMPTS", "MODULES", "SCHEMA"}
        if unknown:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {sorted(unknown)}")
        self.database: str = options.get("DATABASE", DEFAULT_DB_ALIAS)
        self.max_attempts: int = options.get("MAX_ATTEMPTS", 1)
        self.keep_result: float = options.get("KEEP_RESULT", KEEP_RESULT)
        self.modules: list[str] = list(options.get("MODULES", []))
        self._dsn: str | None = options.get("DSN")
        # The App has no DSN until a worker or a test needs one (connect_app): enqueues go
        # through Django's connection.
        try:
            self.app = fastjobs.App(self._dsn, schema=options.get("SCHEMA"))
        except errors.ConfigurationError as exc:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]['OPTIONS']['SCHEMA']: {exc}") from None
        self.tasks: dict[str, Task] = {}

    # -- the task registry

    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        if task.module_path not in self.tasks:
            self._register(task)

    def _register(self, task: Task) -> None:
        kind = task.module_path
        backend = self
        if inspect.iscoroutinefunction(task.func):

            async def run_async(args: Any, kwargs: Any) -> Any:
                if backend.close_connections:
                    await sync_to_async(close_old_connections)()
                try:
                    return await backend._call_async(kind, args, kwargs)
                finally:
                    if backend.close_connections:
                        await sync_to_async(close_old_connections)()

            handler: Callable[..., Any] = run_async
        else:

            def run(args: Any, kwargs: Any) -> Any:
                if backend.close_connections:
                    close_old_connections()
                try:
                    return backend._call(kind, args, kwargs)
                finally:
                    if backend.close_connections:
                        close_old_connections()

            handler = run
        register = self.app.job(
            kind, queue=task.queue_name, max_attempts=self.max_attempts, keep_result=self.keep_result
        )
        register(handler)
        self.tasks[kind] = task

    def _started(self, kind: str, args: list[Any], kwargs: dict[str, Any]) -> TaskResult:
        job = fastjobs.current_job()
        assert job is not None
        now = timezone.now()
        result = TaskResult(
            task=self.tasks[kind],
            id=str(job.id),
            status=TaskResultStatus.RUNNING,
            enqueued_at=None,
            started_at=now,
            last_attempted_at=now,
            finished_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[_WORKER] * job.attempt,
        )
        task_started.send(type(self), task_result=result)
        return result

    def _finished(self, result: TaskResult, status: TaskResultStatus) -> None:
        object.__setattr__(result, "status", status)
        object.__setattr__(result, "finished_at", timezone.now())
        task_finished.send(type(self), task_result=result)

    def _call(self, kind: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        result = self._started(kind, args, kwargs)
        task = result.task
        try:
            if task.takes_context:
                value = task.func(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = task.func(*args, **kwargs)
        except BaseException:
            self._finished(result, TaskResultStatus.FAILED)  # in the handler: the signal logs exc_info
            raise
        self._finished(result, TaskResultStatus.SUCCESSFUL)
        return value

    async def _call_async(self, kind: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        result = self._started(kind, args, kwargs)
        task = result.task
        try:
            if task.takes_context:
                value = await task.func(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = await task.func(*args, **kwargs)
        except BaseException:
            self._finished(result, TaskResultStatus.FAILED)
            raise
        self._finished(result, TaskResultStatus.SUCCESSFUL)
        return value

    def import_tasks(self) -> None:
        """Import every installed app's `tasks` module and OPTIONS["MODULES"]: their tasks register."""
        autodiscover_modules("tasks")
        for name in self.modules:
            importlib.import_module(name)

    # -- the database

    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg 3 connection under Django's connection of OPTIONS["DATABASE"], opened if need be."""
        connection = connections[self.database]
        _check_vendor(connection, self.database)
        connection.ensure_connection()
        raw = connection.connection
        if not isinstance(raw, psycopg.Connection):
            raise ImproperlyConfigured(
                f"fastjobs enqueues on Django's connection through psycopg 3; DATABASES[{self.database!r}]"
                f" runs on {type(raw).__module__} (install psycopg, psycopg[c], instead of psycopg2)"
            )
        return raw

    def dsn(self) -> str:
        """The workers' DSN: OPTIONS["DSN"], else OPTIONS["DATABASE"]'s settings as they stand now."""
        return self._dsn or django_dsn(self.database)

    def connect_app(self) -> fastjobs.App:
        """The backend's App, pointed at `dsn()` (what the workers and the testing kit use)."""
        dsn = self.dsn()
        if self.app._dsn != dsn:
            self.app.configure(dsn=dsn)
        return self.app

    def testing(self, mode: Mode = "manual") -> Testing:
        """fastjobs' testing kit on this backend's App and Django's (test) database.

        Use it in a TransactionTestCase (or pytest-django's `transaction=True`):
        `drain()` runs the jobs on a connection of its own, which sees only
        committed ones, and a TestCase never commits. Manual mode only: the
        inline mode runs a job enqueued in a transaction while that
        transaction's connection commits, and here that connection is
        Django's, which a task using the ORM would wait on forever.
        """
        if mode != "manual":
            raise ValueError(
                "the Django backend's testing kit runs in manual mode only (drain() after the commit):"
                " inline runs would use Django's connection while it commits"
            )
        return self.app.testing(mode, dsn=self.dsn())

    # -- Django's contract

    def enqueue(self, task: Task, args: Iterable[Any], kwargs: dict[str, Any]) -> TaskResult:
        """Insert the task's job in Django's connection, in its transaction: see the module docstring."""
        self.validate_task(task)
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # USE_TZ = False: the current time zone's
            run_at = timezone.make_aware(run_at)
        args = list(args)
        job_id = self.app.enqueue(
            task.module_path,
            {"args": args, "kwargs": kwargs},
            conn=self.connection(),
            queue=task.queue_name,
            priority=task.priority,
            run_at=run_at,
        )
        result = TaskResult(
            task=task,
            id=str(int(job_id)),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's result as it stands, read through Django's connection (so a task enqueued in
        the current transaction is found); TaskResultDoesNotExist for an unknown or expired id."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        try:
            status = self.app.status(job_id, conn=self.connection())
        except fastjobs.JobNotFound as exc:
            raise TaskResultDoesNotExist(result_id) from exc
        task = _task_for(self, status.kind)
        if task is None:
            raise TaskResultDoesNotExist(f"{result_id} is a fastjobs job of kind {status.kind!r}, not a task")
        if (status.queue, status.priority) != (task.queue_name, task.priority):
            task = task.using(queue_name=status.queue, priority=status.priority)
        stored = status.args
        result = TaskResult(
            task=task,
            id=str(status.job_id),
            status=STATUS[status.state],
            enqueued_at=status.enqueued_at,
            started_at=status.started_at,
            last_attempted_at=status.started_at,
            finished_at=status.finished_at,
            args=list(stored.get("args", [])),
            kwargs=dict(stored.get("kwargs", {})),
            backend=self.alias,
            errors=[
                TaskError(
                    exception_class_path=e.get("class")
                    or _exception_path(e.get("traceback"), e.get("error", "")),
                    traceback=e.get("traceback") or e.get("error", ""),
                )
                for e in status.errors
            ],
            worker_ids=[_WORKER] * status.attempt,
        )
        object.__setattr__(result, "_return_value", status.value)
        return result

    def check(self, **kwargs: Any) -> list[Any]:
        return []


# How long a finished task's outcome is kept for get_result, by default: a day.
KEEP_RESULT = 86400.0

# What TaskResult.worker_ids holds, one per attempt: fastjobs records the worker of the last
# attempt only, and Django counts attempts by the length of this list.
_WORKER = "fastjobs"


def _exception_path(traceback: str | None, message: str) -> str:
    """The exception's class path as Django's TaskError has it (`builtins.ValueError`), for an
    error record without its "class" (written before fastjobs kept it, or by fastjobs itself, as
    a timeout's): read from the last line of the traceback, or of the message, where Python writes
    a class with its module unless it is a builtin."""
    last = (traceback or message or "").strip().splitlines()[-1:] or [""]
    name = last[0].split(":", 1)[0].strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        return "builtins.Exception"  # a message of fastjobs' own, naming no class
    if "." in name:
        return name
    if isinstance(getattr(builtins, name, None), type):
        return f"builtins.{name}"
    if isinstance(getattr(errors, name, None), type):
        return f"fastjobs.errors.{name}"  # JobTimeout and the like
    return "builtins.Exception"  # a class of __main__, which a worker cannot import


def _task_for(backend: FastjobsBackend, kind: str) -> Task | None:
    task = backend.tasks.get(kind)
    if task is not None:
        return task
    try:
        found = import_string(kind)
    except ImportError:
        return None
    return found if isinstance(found, Task) else None
