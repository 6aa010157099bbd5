"""fastjobs' schema as Django migrations: each one runs fastjobs.schema.migrate up to its version.

In each PostgreSQL schema the fastjobs task backends of the database being
migrated name (OPTIONS["SCHEMA"]), or without a schema when none does.

The SQL is fastjobs' own (the package's `migrations/*.sql`, recorded in
fastjobs' migrations table), so `manage.py migrate` and `fastjobs migrate`
agree: whichever runs second finds the versions applied and does nothing.
A fastjobs release that adds a migration adds a Django migration here that
names its version (tests/test_django.py checks they keep step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from django.core.exceptions import ImproperlyConfigured

from fastjobs import schema

__all__ = ["migrate_to"]


def _schemas(alias: str) -> list[str | None]:
    """The schemas of the fastjobs task backends whose database is `alias`, in settings order;
    [None] (no schema) when no backend names one, as before schemas."""
    from django.conf import settings
    from django.tasks import task_backends

    from .backend import FastjobsBackend

    found: list[str | None] = []
    for name in getattr(settings, "TASKS", {}):
        backend = task_backends[name]
        if (
            isinstance(backend, FastjobsBackend)
            and backend.database == alias
            and backend.app.schema not in found
        ):
            found.append(backend.app.schema)
    return found or [None]


def migrate_to(version: int) -> Callable[[Any, Any], None]:
    """A RunPython function bringing fastjobs' schema to `version` on the database being migrated.

    Its migration is not atomic: fastjobs' steps run in transactions of their
    own, and its index builds (CREATE INDEX CONCURRENTLY) outside any. A
    database that is not PostgreSQL is left alone (a project's other databases).
    """

    def forwards(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        connection.ensure_connection()
        raw = connection.connection
        if not isinstance(raw, psycopg.Connection):
            raise ImproperlyConfigured(
                "fastjobs' schema is installed through psycopg 3: install psycopg (psycopg[c]), not psycopg2"
            )
        for name in _schemas(connection.alias):
            schema.migrate(raw, target=version, schema=name)

    forwards.__qualname__ = f"migrate_to_{version}"
    return forwards
