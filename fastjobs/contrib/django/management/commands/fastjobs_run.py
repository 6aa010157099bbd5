"""`python manage.py fastjobs_run --processes N`: `fastjobs run` for the tasks of a Django project."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task_backends

from fastjobs import App, logs
from fastjobs.cli.command import add_log_arguments, add_run_arguments, guarded
from fastjobs.cli.run import run

from ...backend import FastjobsBackend

__all__ = ["Command"]


class Command(BaseCommand):  # type: ignore[misc]  # django has no type information
    help = (
        "Run fastjobs workers for the project's tasks: the options of `fastjobs run`, the app being"
        " the task backend's (Django is set up once, in the master, before it forks)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--backend",
            default=DEFAULT_TASK_BACKEND_ALIAS,
            help="the alias in settings.TASKS of a FastjobsBackend (default %(default)s)",
        )
        add_log_arguments(parser)
        add_run_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        backend = task_backends[options["backend"]]
        if not isinstance(backend, FastjobsBackend):
            raise CommandError(
                f"TASKS[{options['backend']!r}] is a {type(backend).__name__}, not"
                " fastjobs.contrib.django.FastjobsBackend"
            )
        namespace = argparse.Namespace(**options)
        with logs.configured(options["log_level"], options["log_format"]):
            code = guarded(lambda: run(namespace, lambda: _prepared(backend), backend.queues))
        if code:
            raise SystemExit(code)


def _prepared(backend: FastjobsBackend) -> App:
    """The backend's App with every task registered, pointed at the database, and no Django
    connection left open for the forked workers to share: each opens its own on first use."""
    backend.import_tasks()
    app = backend.connect_app()
    FastjobsBackend.close_connections = True
    connections.close_all()
    return app
