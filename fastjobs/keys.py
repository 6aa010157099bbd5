"""Concurrency and rate limits per key and per kind (migration 009).

A kind declared with `concurrency_key` (an argument's name, or a callable of
the args) and `concurrency_limit` / `rate_limit` stores, on each of its jobs
at enqueue, its key and those limits (sql._LIMIT_COLUMNS); without a key,
`concurrency_limit` / `rate_limit` limit the kind as a whole (key ''). Every
claim, of either lane, hands its candidates that carry a key to fastjobs_take,
which lets it take, per kind and key, no more than the limit less the jobs
running and no more than the key's tokens; a fast-lane batch holds its keys'
groups to its commit, so its jobs in flight, not `running`, are never counted
by another claim.
An operator may set other limits for some keys (`limit`, stored in
fastjobs_limits), read by the next claim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from . import sql
from .enqueue import MAX_LIMIT_KEY, check_kind
from .queues import UNCHANGED, per_second
from .types import KeyLimit

__all__ = ["KeyInfo", "KeyUsage", "declared", "limit", "list_limits", "usage"]


def declared(
    kind: str,
    concurrency_key: str | Callable[[dict[str, Any]], Any] | None,
    concurrency_limit: int | None,
    rate_limit: str | None,
) -> KeyLimit | None:
    """A kind's limits as `@app.job` takes them (None: none); ValueError or TypeError saying why not."""
    if concurrency_key is None and concurrency_limit is None and rate_limit is None:
        return None
    if not (
        concurrency_key is None
        or callable(concurrency_key)
        or (isinstance(concurrency_key, str) and concurrency_key)
    ):
        raise TypeError(
            f"{kind}: concurrency_key must be an argument's name or a callable of the args (a dict),"
            f" not {concurrency_key!r}"
        )
    _check_concurrency(concurrency_limit, "concurrency_limit")
    rate = None if rate_limit is None else per_second(rate_limit)
    return KeyLimit(concurrency_key, concurrency_limit, rate)


def _check_concurrency(value: object, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31):
        raise ValueError(f"{name} must be a positive integer or None, not {value!r}")


def _check_key(key: object) -> str:
    if not isinstance(key, str) or len(key) > MAX_LIMIT_KEY:
        raise ValueError(f"a limit key is a string of at most {MAX_LIMIT_KEY} characters, not {key!r}")
    return key


def limit(
    conn: psycopg.Connection[Any],
    kind: str,
    key: str,
    *,
    concurrency: int | None = UNCHANGED,
    rate_limit: str | None = UNCHANGED,
    sql: ModuleType = sql,
) -> None:
    """Set kind `kind`'s limits for key `key` ('': the kind as a whole), in place of those its jobs
    were enqueued with, from the next claim (None: back to those; UNCHANGED, the default: as it is).

    `concurrency`: at most this many of its jobs with that key running at
    once, cluster-wide; `rate_limit`: at most N of them started per period
    ("10/s", "600/min"). A job of a kind enqueued without a concurrency_key
    (or rate_limit) carries no key, and no limit set here applies to it.
    """
    check_kind(kind)
    _check_key(key)
    _check_concurrency(None if concurrency is UNCHANGED else concurrency, "concurrency")
    if concurrency is UNCHANGED and rate_limit is UNCHANGED:
        raise ValueError("give concurrency=, rate_limit= or both")
    rate = None if rate_limit is UNCHANGED or rate_limit is None else per_second(rate_limit)
    params = (
        kind,
        key,
        None if concurrency is UNCHANGED else concurrency,
        concurrency is not UNCHANGED,
        None if rate_limit is UNCHANGED else rate_limit,
        rate,
        rate_limit is not UNCHANGED,
    )
    with psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        cur.execute(sql.key_limit, params)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A kind and key an operator limited, as `fastjobs queues keys` shows it."""

    kind: str
    key: str  # '': the kind as a whole
    concurrency: int | None
    rate_limit: str | None
    running: int


def list_limits(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[KeyInfo]:
    """The limits set per kind and key, by kind and key."""
    with psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        return [KeyInfo(*row) for row in cur.execute(sql.key_limits)]


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """A kind limited per key, as `fastjobs stats` and the metrics show it (sql.key_usage)."""

    kind: str
    keys_running: int  # keys with jobs of the kind running
    running: int  # those jobs
    keys_at_limit: int  # keys running as many as their concurrency limit lets: their next jobs wait
    longest_waiting_key: str | None  # the key of its job due the longest (of each queue's first 1,000)
    longest_waiting_seconds: float | None  # how long that job has been due


def usage(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[KeyUsage]:
    """The kinds with jobs limited per key running or due, by kind; bounded reads (sql.key_usage)."""
    with psycopg.RawCursor(conn, row_factory=tuple_row) as cur:
        return [KeyUsage(*row) for row in cur.execute(sql.key_usage)]
