"""Bulk enqueue: many jobs of one kind in one binary COPY, straight into the jobs table or, for jobs
with keys of their own, through a staging table."""

from __future__ import annotations

import contextlib
import datetime as dt
import struct
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import psycopg
from psycopg import pq

from . import schema, sql
from .abc import PG_EPOCH
from .enqueue import Options, fair_key_for, limit_key_for, unique_key_for
from .impl import core

__all__ = ["COPY_CHUNK", "COPY_HEADER", "COPY_TRAILER", "copy_layout", "copy_many", "copy_many_async"]

# Rows encoded per write to the COPY stream: bounded memory for any iterable,
# large enough that the per-write cost vanishes.
COPY_CHUNK = 8192

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, extension length
COPY_TRAILER = b"\xff\xff"


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def copy_layout(
    opts: Options, now: dt.datetime, meta: bytes | None = None, sql: ModuleType = sql
) -> tuple[str, bytes, bytes]:
    """The COPY statement and the bytes before and after each row's args.

    A delayed bulk enqueue is computed against the client's clock; the claim
    also requires run_at <= now(), so a skewed clock can only delay a job.
    The call's keep_result and meta are the same for every row: they end the suffix.
    """
    statement, prefix, suffix = _layout(opts, now, sql)
    return statement, prefix, suffix + _keep_field(opts) + _jsonb_field(meta)


def _layout(opts: Options, now: dt.datetime, sql: ModuleType = sql) -> tuple[str, bytes, bytes]:
    """copy_layout's without the keep_result and meta fields that end its suffix (the field count
    includes them)."""
    run_at = opts.run_at
    if run_at is None and opts.delay:
        run_at = now + dt.timedelta(seconds=opts.delay)
    fields = 7 if run_at is None else 9
    prefix = fields.to_bytes(2, "big") + _field(opts.queue.encode()) + _field(opts.kind.encode())
    suffix = _field(opts.priority.to_bytes(2, "big", signed=True)) + _field(
        opts.max_attempts.to_bytes(2, "big")
    )
    if run_at is None:
        return sql.job_copy, prefix, suffix
    state = b"scheduled" if run_at > now else b"available"
    micros = (run_at - PG_EPOCH) // dt.timedelta(microseconds=1)
    suffix += _field(state) + _field(micros.to_bytes(8, "big", signed=True))
    return sql.job_copy_at, prefix, suffix


def _keep_field(opts: Options) -> bytes:
    """A binary COPY int4 field: the jobs' keep_result, or NULL."""
    return _NULL if opts.keep_result is None else _field(opts.keep_result.to_bytes(4, "big", signed=True))


def _jsonb_field(data: bytes | None) -> bytes:
    """A binary COPY jsonb field: NULL, or the format version and the JSON text."""
    return _NULL if data is None else _field(b"\x01" + data)


def _chunks(opts: Options, rows: Iterable[Any], prefix: bytes, suffix: bytes) -> Iterator[tuple[bytes, int]]:
    it = iter(rows) if opts.args_schema is None else opts.args_schema.encode_rows(rows)
    while True:
        data, count = core.encode_copy_rows(
            opts.kind, it, prefix, suffix, COPY_CHUNK, opts.params, opts.required
        )
        if not count:
            return
        yield data, count


def _atomic(conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[Any]:
    """A savepoint inside the caller's transaction, a transaction in autocommit.

    On an idle non-autocommit connection the COPY simply opens the caller's
    transaction: a `conn.transaction()` there would commit it behind their back.
    """
    if conn.autocommit or conn.info.transaction_status == pq.TransactionStatus.INTRANS:
        return conn.transaction()
    return contextlib.nullcontext()


_NULL = (-1).to_bytes(4, "big", signed=True)


def _text_field(text: str | None) -> bytes:
    """A binary COPY text field: NULL, or the text."""
    return _NULL if text is None else _field(text.encode())


def _row_chunks(
    opts: Options, rows: Iterable[Any], prefix: bytes, fields: Callable[[dict[str, Any], bytes], list[bytes]]
) -> Iterator[tuple[bytes, int]]:
    """COPY data of rows built here, one by one: each is `prefix` then what `fields` makes of its
    args and their JSON (for the columns that differ from row to row, computed from the args)."""
    parts: list[bytes] = []
    count = 0
    for args in rows if opts.args_schema is None else opts.args_schema.encode_rows(rows):
        data = core.dump_args(opts.kind, args, opts.params, opts.required)
        parts.append(prefix)
        parts += fields(dict(args), data)
        count += 1
        if count == COPY_CHUNK:
            yield b"".join(parts), count
            parts, count = [], 0
    if count:
        yield b"".join(parts), count


def _args_field(data: bytes) -> list[bytes]:
    """The binary COPY jsonb field of a row's args, in parts."""
    return [(len(data) + 1).to_bytes(4, "big"), b"\x01", data]


def _staged_chunks(opts: Options, rows: Iterable[Any], meta: bytes | None) -> Iterator[tuple[bytes, int]]:
    """COPY data for fastjobs_staged: like copy_layout's, plus each row's unique key, limits per key
    and fairness key."""
    _, prefix, suffix = _layout(opts, dt.datetime.now(dt.UTC))
    prefix = (14).to_bytes(2, "big") + prefix[2:]
    if len(suffix) == 12:  # priority and max_attempts only: state and run_at are NULL (defaults)
        suffix += _NULL + _NULL
    meta_field = _keep_field(opts) + _jsonb_field(meta)
    limit = opts.limit
    limits = _NULL + _NULL  # limit_concurrency and limit_rate, after each row's limit_key
    if limit is not None:
        limits = (_NULL if limit.concurrency is None else _field(limit.concurrency.to_bytes(4, "big"))) + (
            _NULL if limit.rate is None else _field(struct.pack(">d", limit.rate))
        )

    def fields(args: dict[str, Any], data: bytes) -> list[bytes]:
        key = _text_field(unique_key_for(opts, args))
        limit_key = _text_field(limit_key_for(opts, args))
        fair = _text_field(fair_key_for(opts, args))
        return [*_args_field(data), suffix, key, meta_field, limit_key, limits, fair]

    return _row_chunks(opts, rows, prefix, fields)


def _fair_copy(
    opts: Options, rows: Iterable[Any], meta: bytes | None, sql: ModuleType
) -> tuple[str, Iterator[tuple[bytes, int]]]:
    """The COPY of jobs with a fairness key (sql.job_copy_fair, job_copy_at_fair) and its data: a
    call's own key ends every row's suffix; a kind's is computed from each row's args."""
    statement, prefix, suffix = copy_layout(opts, dt.datetime.now(dt.UTC), meta, sql)
    statement = sql.job_copy_fair if statement == sql.job_copy else sql.job_copy_at_fair
    prefix = (int.from_bytes(prefix[:2], "big") + 1).to_bytes(2, "big") + prefix[2:]
    if opts.fair_key is not None or opts.fair_by is None:
        return statement, _chunks(opts, rows, prefix, suffix + _text_field(opts.fair_key))

    def fields(args: dict[str, Any], data: bytes) -> list[bytes]:
        return [*_args_field(data), suffix, _text_field(fair_key_for(opts, args))]

    return statement, _row_chunks(opts, rows, prefix, fields)


def _copy_of(
    opts: Options, rows: Iterable[Any], meta: bytes | None, sql: ModuleType
) -> tuple[str, Iterator[tuple[bytes, int]]]:
    """The COPY statement of a bulk enqueue without unique keys, and its data."""
    if opts.keyed:
        return _fair_copy(opts, rows, meta, sql)
    statement, prefix, suffix = copy_layout(opts, dt.datetime.now(dt.UTC), meta, sql)
    return statement, _chunks(opts, rows, prefix, suffix)


def copy_many(
    conn: psycopg.Connection[Any],
    opts: Options,
    rows: Iterable[Any],
    meta: bytes | None = None,
    sql: ModuleType = sql,
) -> int:
    if opts.unique or opts.limit:  # each row's own key: through the staging table
        return _copy_staged(conn, opts, rows, meta, sql)
    statement, chunks = _copy_of(opts, rows, meta, sql)
    first = next(chunks, None)  # bad args in the first chunk fail before the COPY starts
    if first is None:
        return 0
    total = 0
    with schema.required(sql.SCHEMA), _atomic(conn), conn.cursor() as cur, cur.copy(statement) as copy:
        copy.write(COPY_HEADER)
        for data, count in _prepend(first, chunks):
            copy.write(data)
            total += count
        copy.write(COPY_TRAILER)
    return total


def _copy_staged(
    conn: psycopg.Connection[Any], opts: Options, rows: Iterable[Any], meta: bytes | None, sql: ModuleType
) -> int:
    """Unique jobs in bulk: COPY into a temporary table, then one INSERT that skips taken keys.

    Returns how many were inserted (duplicates, in the table or the call, are not).
    """
    chunks = _staged_chunks(opts, rows, meta)
    first = next(chunks, None)
    if first is None:
        return 0
    with schema.required(sql.SCHEMA), _atomic(conn), psycopg.RawCursor(conn) as cur:
        cur.execute(sql.job_stage_create)
        with cur.copy(sql.job_copy_staged) as copy:
            copy.write(COPY_HEADER)
            for data, _ in _prepend(first, chunks):
                copy.write(data)
            copy.write(COPY_TRAILER)
        inserted = cur.execute(sql.job_insert_staged).rowcount
        cur.execute(sql.job_stage_clear)
    return inserted


async def _copy_staged_async(
    conn: psycopg.AsyncConnection[Any],
    opts: Options,
    rows: Iterable[Any],
    meta: bytes | None,
    sql: ModuleType,
) -> int:
    chunks = _staged_chunks(opts, rows, meta)
    first = next(chunks, None)
    if first is None:
        return 0
    with schema.required(sql.SCHEMA):
        async with _atomic_async(conn), psycopg.AsyncRawCursor(conn) as cur:
            await cur.execute(sql.job_stage_create)
            async with cur.copy(sql.job_copy_staged) as copy:
                await copy.write(COPY_HEADER)
                for data, _ in _prepend(first, chunks):
                    await copy.write(data)
                await copy.write(COPY_TRAILER)
            await cur.execute(sql.job_insert_staged)
            inserted = cur.rowcount
            await cur.execute(sql.job_stage_clear)
    return inserted


def _atomic_async(conn: psycopg.AsyncConnection[Any]) -> contextlib.AbstractAsyncContextManager[Any]:
    if conn.autocommit or conn.info.transaction_status == pq.TransactionStatus.INTRANS:
        return conn.transaction()
    return contextlib.nullcontext()


async def copy_many_async(
    conn: psycopg.AsyncConnection[Any],
    opts: Options,
    rows: Iterable[Any],
    meta: bytes | None = None,
    sql: ModuleType = sql,
) -> int:
    if opts.unique or opts.limit:
        return await _copy_staged_async(conn, opts, rows, meta, sql)
    statement, chunks = _copy_of(opts, rows, meta, sql)
    first = next(chunks, None)
    if first is None:
        return 0
    total = 0
    with schema.required(sql.SCHEMA):
        async with _atomic_async(conn), conn.cursor() as cur, cur.copy(statement) as copy:
            await copy.write(COPY_HEADER)
            for data, count in _prepend(first, chunks):
                await copy.write(data)
                total += count
            await copy.write(COPY_TRAILER)
    return total


def _prepend(first: tuple[bytes, int], rest: Iterator[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
    yield first
    yield from rest
