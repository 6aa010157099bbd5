"""fastjobs' schema as Django migrations: each one runs fastjobs.schema.migrate up to its version.

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
        schema.migrate(raw, target=version)

    forwards.__qualname__ = f"migrate_to_{version}"
    return forwards
