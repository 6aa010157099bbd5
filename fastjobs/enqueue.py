"""Enqueueing: an enqueue's options checked, one job's parameters and its INSERT, in fastjobs' transaction
or the caller's (many jobs: fastjobs.bulk's COPY)."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import orjson
import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from . import schema, sql
from .errors import FastjobsError
from .impl import core
from .types import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    MAX_ATTEMPTS_LIMIT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    ArgsSchema,
    JobSpec,
    KeyLimit,
)

__all__ = [
    "FAIR_KEY_MAX",
    "MAX_DELAY",
    "MAX_KEEP_RESULT",
    "MAX_LIMIT_KEY",
    "InsertParams",
    "Options",
    "adapt",
    "adapt_async",
    "check_conn",
    "check_keep_result",
    "check_kind",
    "check_max_attempts",
    "check_priority",
    "check_queue",
    "conn_type_error",
    "dump_meta",
    "fair_key_for",
    "fair_key_of",
    "foreign_conn",
    "insert",
    "insert_async",
    "insert_own",
    "insert_params",
    "is_sqlalchemy",
    "limit_key_for",
    "options",
    "unique_key_for",
]

# The longest delay an enqueue takes: a run_at within Python's datetime (year
# 9999) for the next 6,000 years.
MAX_DELAY = 1000 * 365.25 * 86400


@dataclass(frozen=True, slots=True)
class Options:
    """Validated per-call options of an enqueue, with the spec's defaults applied."""

    kind: str
    queue: str
    priority: int
    max_attempts: int
    run_at: dt.datetime | None
    delay: float | None
    params: frozenset[str] | None
    required: frozenset[str]
    unique_key: str | None = None
    unique: bool | tuple[str, ...] = False
    args_schema: ArgsSchema | None = None
    keep_result: int | None = None  # seconds its outcome is kept in fastjobs_results
    wait_for_room: float | None = None  # seconds to wait while the queue is full (fastjobs.queues)
    limit: KeyLimit | None = None  # the kind's limits per key (fastjobs.keys)
    fair_key: str | None = None  # the call's fairness key, for every job of it
    # The kind's fairness key: an argument's name, or a callable of the args.
    fair_by: str | Callable[[dict[str, Any]], object] | None = None

    @property
    def keyed(self) -> bool:
        """Whether the jobs may have fairness keys (their queue is marked fair: fastjobs.queues)."""
        return self.fair_key is not None or self.fair_by is not None


# The longest limit key: the key is text, indexed with the kind.
MAX_LIMIT_KEY = 512


def limit_key_for(opts: Options, args: dict[str, Any]) -> str | None:
    """The job's limit key (fastjobs.keys): None without limits; '' for limits on the kind as a whole;
    else its key's value: a string as it is, any other value as JSON. ValueError saying what is wrong."""
    limit = opts.limit
    if limit is None:
        return None
    by = limit.key
    if by is None:
        return ""
    if callable(by):
        value = by(args)
    elif by in args:
        value = args[by]
    else:
        raise ValueError(f"{opts.kind}: its concurrency_key is the argument {by!r}, which this job lacks")
    key = value if isinstance(value, str) else orjson.dumps(value).decode()
    if len(key) > MAX_LIMIT_KEY:
        raise ValueError(f"{opts.kind}: limit keys are at most {MAX_LIMIT_KEY} characters, not {len(key)}")
    return key


# The longest fairness key (a longer one is a mistake, an args dict, say, that a key costs an index entry of).
FAIR_KEY_MAX = 256


def fair_key_of(value: object) -> str | None:
    """A fairness key as stored: a string (an int's decimal), or None for no key; ValueError or
    TypeError saying why for anything else."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise TypeError(f"a fairness key must be a string or an int, not {type(value).__name__}")
    if not value or len(value) > FAIR_KEY_MAX:
        raise ValueError(f"a fairness key must be 1 to {FAIR_KEY_MAX} characters, not {value!r}")
    return value


def fair_key_for(opts: Options, args: dict[str, Any]) -> str | None:
    """The job's fairness key: the call's, or the one its kind derives from the args (a missing
    argument, or None, gives none)."""
    if opts.fair_key is not None or opts.fair_by is None:
        return opts.fair_key
    by = opts.fair_by
    return fair_key_of(args.get(by) if isinstance(by, str) else by(args))


def unique_key_for(opts: Options, args: dict[str, Any]) -> str | None:
    """The job's unique key: the explicit one, or one derived from the args the kind names."""
    if opts.unique_key is not None or not opts.unique:
        return opts.unique_key
    names = opts.unique
    subset = args if isinstance(names, bool) else {name: args.get(name) for name in names}
    digest = hashlib.sha256(orjson.dumps(subset, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
    return f"{opts.kind}:{digest}"


def options(
    kind: str,
    spec: JobSpec | None,
    *,
    queue: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    run_at: dt.datetime | None = None,
    delay: float | dt.timedelta | None = None,
    unique_key: str | None = None,
    keep_result: float | dt.timedelta | None = None,
    wait_for_room: float | None = None,
    fair_key: str | int | None = None,
) -> Options:
    """Validate everything but the arguments; each bad value raises with its reason."""
    if unique_key is not None and (not isinstance(unique_key, str) or not unique_key):
        raise ValueError(f"unique_key must be a non-empty string, not {unique_key!r}")
    check_kind(kind)
    queue = queue if queue is not None else (spec.queue if spec else DEFAULT_QUEUE)
    priority = priority if priority is not None else (spec.priority if spec else DEFAULT_PRIORITY)
    max_attempts = (
        max_attempts if max_attempts is not None else (spec.max_attempts if spec else DEFAULT_MAX_ATTEMPTS)
    )
    check_queue(queue)
    check_priority(priority)
    check_max_attempts(max_attempts)
    if run_at is not None and delay is not None:
        raise ValueError("pass run_at or delay, not both")
    if run_at is not None:
        if not isinstance(run_at, dt.datetime):
            raise ValueError(f"run_at must be a datetime, not {type(run_at).__name__}")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise ValueError("run_at must carry a timezone (a naive datetime is ambiguous)")
        try:
            run_at.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError(f"run_at {run_at} is outside the years 1 to 9999 in UTC") from None
    seconds: float | None = None
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, dt.timedelta) else delay
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"delay must be seconds or a timedelta, not {type(delay).__name__}")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"delay must be a finite number of seconds >= 0, not {seconds!r}")
        seconds = float(seconds)
        # A run_at past the year 9999 overflows timestamptz or, before that,
        # Python's datetime (enqueue_many computes it; every reader loads it).
        if seconds > MAX_DELAY:
            raise ValueError(
                f"delay must be at most {MAX_DELAY:.0f} seconds (about 1,000 years), not {seconds:g}"
            )
    keep = check_keep_result(keep_result if keep_result is not None else (spec.keep_result if spec else None))
    if wait_for_room is not None and (
        isinstance(wait_for_room, bool)
        or not isinstance(wait_for_room, int | float)
        or not 0 <= wait_for_room < math.inf
    ):
        raise ValueError(f"wait_for_room must be seconds (a finite number >= 0), not {wait_for_room!r}")
    return Options(
        kind,
        queue,
        priority,
        max_attempts,
        run_at,
        seconds,
        spec.params if spec else None,
        spec.required if spec else frozenset(),
        unique_key,
        spec.unique if spec else False,
        spec.args_schema if spec else None,
        keep,
        wait_for_room,
        spec.limit if spec else None,
        fair_key_of(fair_key),
        spec.fair_key if spec else None,
    )


# The longest keep_result: the column is an int4 of seconds.
MAX_KEEP_RESULT = 2**31 - 1


def check_keep_result(keep_result: object) -> int | None:
    """keep_result as whole seconds (rounded up: 0.5 keeps a second), or None; ValueError saying why."""
    if keep_result is None:
        return None
    seconds = keep_result.total_seconds() if isinstance(keep_result, dt.timedelta) else keep_result
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"keep_result must be seconds or a timedelta, not {type(keep_result).__name__}")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_KEEP_RESULT:
        raise ValueError(
            f"keep_result must be a number of seconds > 0 and <= {MAX_KEEP_RESULT}, not {seconds!r}"
        )
    return math.ceil(seconds)


def check_kind(kind: object) -> None:
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"job kind must be a non-empty string, not {kind!r}")
    if len(kind) > 512:
        raise ValueError(f"job kinds are at most 512 characters, this one has {len(kind)}")


def check_queue(queue: object) -> None:
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue must be a non-empty string, not {queue!r}")
    if len(queue) > 128:
        raise ValueError(f"queue names are at most 128 characters, this one has {len(queue)}")


def check_priority(priority: object) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, not {type(priority).__name__}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be between {PRIORITY_MIN} and {PRIORITY_MAX}, not {priority}")


def check_max_attempts(max_attempts: object) -> None:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise ValueError(f"max_attempts must be an integer, not {type(max_attempts).__name__}")
    if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise ValueError(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}, not {max_attempts}")


def foreign_conn(conn: object, wanted: str) -> TypeError:
    """The error for a connection of another driver (or a cursor, a DSN), saying what to pass."""
    return TypeError(
        f"{wanted} (psycopg2 and other drivers are not supported), not "
        f"{type(conn).__module__}.{type(conn).__qualname__}; pass the psycopg connection underneath "
        "(Django: django.db.connection.connection), or a SQLAlchemy Connection or Session of a "
        "postgresql+psycopg:// engine"
    )


def is_sqlalchemy(conn: object) -> bool:
    """Whether `conn` is a SQLAlchemy object (told by its module: importing sqlalchemy costs 100 ms)."""
    return type(conn).__module__.startswith("sqlalchemy.")


def adapt(conn: Any) -> Any:
    """The psycopg connection a sync `conn=` stands for: itself, or the one under a SQLAlchemy
    Connection or Session, in its transaction (fastjobs.contrib.sqlalchemy). Anything else is
    returned as it is, for check_conn to refuse."""
    if conn is None or isinstance(conn, psycopg.Connection) or not is_sqlalchemy(conn):
        return conn
    from .contrib import sqlalchemy  # the object is SQLAlchemy's: the library is installed

    return sqlalchemy.driver_connection(conn)


async def adapt_async(conn: Any) -> Any:
    """`adapt` for the async methods: a SQLAlchemy AsyncConnection or AsyncSession."""
    if conn is None or isinstance(conn, psycopg.AsyncConnection) or not is_sqlalchemy(conn):
        return conn
    from .contrib import sqlalchemy

    return await sqlalchemy.driver_connection_async(conn)


def conn_type_error(conn: object, expected: type[Any]) -> TypeError:
    """The error for a `conn=` that is not an `expected` (psycopg.Connection or AsyncConnection)."""
    if isinstance(conn, psycopg.AsyncConnection):
        return TypeError("conn= is a psycopg.AsyncConnection: use enqueue_async or enqueue_many_async")
    if isinstance(conn, psycopg.Connection):
        return TypeError("conn= is a psycopg.Connection: the async methods take an AsyncConnection")
    return foreign_conn(conn, f"conn= must be a psycopg 3 {expected.__name__}")


def check_conn(conn: object, expected: type[Any]) -> None:
    """Refuse a `conn=` that cannot take the jobs, before anything is sent on it.

    `expected` is psycopg.Connection or psycopg.AsyncConnection. A closed
    connection, or one whose transaction failed, would lose the jobs with
    the caller's rollback anyway: better said at the call.
    """
    if not isinstance(conn, expected):
        raise conn_type_error(conn, expected)
    if conn.closed:
        raise ValueError("conn= is closed")
    if conn.pgconn.transaction_status == pq.TransactionStatus.INERROR:  # conn.info's costs 0.7 us
        raise ValueError("conn= is in a failed transaction: roll it back before enqueueing")


class InsertParams(NamedTuple):
    """One job's parameters: sql.job_insert's $1 to $9, in order (sql.job_insert_now takes `now()`)."""

    queue: str
    kind: str
    args: str  # JSON
    priority: int
    max_attempts: int
    run_at: dt.datetime | None
    delay: float | None  # seconds from now, when run_at is None
    unique_key: str | None
    meta: str | None  # JSON
    keep_result: int | None  # seconds
    limit_key: str | None = None  # its limits per key (fastjobs.keys): sql.job_insert's $11 to $13
    limit_concurrency: int | None = None
    limit_rate: float | None = None
    fair_key: str | None = None  # its fairness key: sql.job_insert's $14

    def due_now(self) -> bool:
        """Whether sql.job_insert_now can take the job: due now, no unique, limit or fairness key."""
        return (
            self.run_at is None
            and not self.delay
            and self.unique_key is None
            and self.limit_key is None
            and self.fair_key is None
        )

    def direct(self, sql: ModuleType) -> tuple[str, tuple[Any, ...]] | None:
        """The plain INSERT of a job due now without a unique or limit key and its parameters:
        sql.job_insert_now, or sql.job_insert_now_fair with a fairness key; None for the others
        (sql.job_insert's: keyed jobs live in slot 0)."""
        if self.run_at is not None or self.delay or self.unique_key is not None or self.limit_key is not None:
            return None
        if self.fair_key is None:
            return sql.job_insert_now, self.now()
        return sql.job_insert_now_fair, (*self.now(), self.fair_key)

    def now(self) -> tuple[str, str, str, int, int, str | None, int | None]:
        """sql.job_insert_now's parameters."""
        return (
            self.queue,
            self.kind,
            self.args,
            self.priority,
            self.max_attempts,
            self.meta,
            self.keep_result,
        )


def insert_params(opts: Options, args: Any, meta: bytes | None = None) -> InsertParams:
    """Parameters of sql.job_insert; raises TypeError for arguments that cannot be stored."""
    args = {} if args is None else args
    if opts.args_schema is not None:
        args = opts.args_schema.encode(args)
    data = core.dump_args(opts.kind, args, opts.params, opts.required)
    key = unique_key_for(opts, args) if opts.unique_key or opts.unique else None
    limit = opts.limit
    fair = fair_key_for(opts, args) if opts.keyed else None
    return InsertParams(
        opts.queue,
        opts.kind,
        data.decode(),
        opts.priority,
        opts.max_attempts,
        opts.run_at,
        opts.delay,
        key,
        None if meta is None else meta.decode(),
        opts.keep_result,
        limit_key_for(opts, args),
        None if limit is None else limit.concurrency,
        None if limit is None else limit.rate,
        fair,
    )


def dump_meta(meta: dict[str, Any]) -> bytes | None:
    """A job's meta as JSON (None when empty); TypeError, naming it, when it is not JSON-serialisable."""
    if not isinstance(meta, dict):
        raise TypeError(f"a job's meta must be a dict, not {type(meta).__name__}")
    if not meta:
        return None
    try:
        return orjson.dumps(meta)
    except TypeError as exc:
        raise TypeError(f"a job's meta must be JSON-serialisable: {exc}") from None


# A unique insert that found the key taken looks the holder up; if the holder
# finished in between, the insert is tried again.
_UNIQUE_TRIES = 5


# fastjobs' own pooled connections on which job_insert_now is prepared.
_prepared: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
_INSERT_NOW = b"fastjobs_job_insert_now"


def insert_own(conn: psycopg.Connection[Any], params: InsertParams, sql: ModuleType = sql) -> int:
    """`insert` on one of fastjobs' own autocommit connections: a job due now goes straight through libpq.

    Web applications enqueue one job per request from many processes, and on
    a small machine the client's CPU is part of every commit's cost: a
    psycopg cursor spends some 40 us a job on what libpq does in 8 (a cursor
    made, parameters adapted, the result wrapped). Only on an autocommit
    connection no one else uses: psycopg keeps no transaction state to
    track there. Any other job takes `insert`.
    """
    if not params.due_now():
        return insert(conn, params, sql)
    pgconn = conn.pgconn
    with schema.required(sql.SCHEMA):
        if conn not in _prepared:
            # job_insert_now would run on any schema since 001: the connection's first enqueue
            # checks the schema's version once, so an out-of-date one says to migrate.
            schema.check(conn, sql)
            res = pgconn.prepare(_INSERT_NOW, sql.job_insert_now.encode())
            if res.status != pq.ExecStatus.COMMAND_OK:
                raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
            _prepared.add(conn)
        values: list[bytes | None] = [
            params.queue.encode(),
            params.kind.encode(),
            params.args.encode(),
            b"%d" % params.priority,
            b"%d" % params.max_attempts,
            None if params.meta is None else params.meta.encode(),
            None if params.keep_result is None else b"%d" % params.keep_result,
        ]
        res = pgconn.exec_prepared(_INSERT_NOW, values)  # type: ignore[arg-type]  # None is NULL to libpq
        if res.status != pq.ExecStatus.TUPLES_OK:
            raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
        value = res.get_value(0, 0)
    assert value is not None
    return int(value)


def insert(conn: psycopg.Connection[Any], params: InsertParams, sql: ModuleType = sql) -> int:
    """Run sql.job_insert with `insert_params`' parameters; the job's id (or the unique key holder's).
    `sql`: the catalogue of the App's schema (fastjobs.sql.of), as for every function here."""
    # Tuples whatever the caller's connection's row factory (dict_row made
    # row[0] a KeyError after the INSERT ran: a caller retrying enqueued twice).
    with schema.required(sql.SCHEMA), psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        direct = params.direct(sql)
        if direct is not None:
            row = cur.execute(*direct).fetchone()
            assert row is not None
            return int(row[0])
        for _ in range(_UNIQUE_TRIES):
            row = cur.execute(sql.job_insert, params).fetchone()
            if row is None:
                row = cur.execute(sql.job_get_unique, (params.unique_key,)).fetchone()
            if row is not None:
                return int(row[0])
    raise FastjobsError(f"unique key {params.unique_key!r} kept changing hands; enqueue not done")


async def insert_async(
    conn: psycopg.AsyncConnection[Any], params: InsertParams, sql: ModuleType = sql
) -> int:
    with schema.required(sql.SCHEMA):
        async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
            direct = params.direct(sql)
            if direct is not None:
                await cur.execute(*direct)
                row = await cur.fetchone()
                assert row is not None
                return int(row[0])
            for _ in range(_UNIQUE_TRIES):
                await cur.execute(sql.job_insert, params)
                row = await cur.fetchone()
                if row is None:
                    await cur.execute(sql.job_get_unique, (params.unique_key,))
                    row = await cur.fetchone()
                if row is not None:
                    return int(row[0])
    raise FastjobsError(f"unique key {params.unique_key!r} kept changing hands; enqueue not done")
