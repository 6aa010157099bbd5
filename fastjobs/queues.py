"""Queues steered at run time: pause, resume, limit, list (the fastjobs_queues table, migration 007).

A paused queue keeps its jobs and takes enqueues; no claim of any worker
takes its jobs from the statement after the pause commits (the claims read
the table: sql._Choice.where), so jobs already claimed finish and no new one
starts. Resuming wakes the queue's sleeping workers at commit.

A queue with a max_backlog holds producers back while its backlog is at the
limit: the leader counts each such backlog every second (count_backlogs, up
to the limit), and each producer process reads which queues are full at most
once a second (Backpressure), so an enqueue costs no count and, while no
queue is full, nothing but a clock read.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from . import schema, sql
from .enqueue import check_queue
from .errors import ConfigurationError, DatabaseUnavailable, QueueFull

__all__ = [
    "Backpressure",
    "QueueInfo",
    "QueueState",
    "count_backlogs",
    "limit",
    "list_queues",
    "pause",
    "resume",
    "states",
]

logger = logging.getLogger(__name__)

# How often the leader counts the backlogs of queues with a max_backlog (at
# least: a count that takes long is paced to 10% of the leader's time).
COUNT_INTERVAL = 1.0
# How often a producer reads which queues are full, and how often one waiting
# for room looks again; a count the leader made longer ago than FRESH_FOR
# (no leader) holds no producer back.
REFRESH = 1.0
WAIT_STEP = 0.25
FRESH_FOR = 30.0
# An App without a DSN of its own (ConfigurationError), or whose own connection cannot be had or
# breaks (the server at max_connections, restarting; another DSN): a producer that passed its
# connection reads the full queues, and marks a fair queue, through that one instead, so its
# enqueue fails only as its own connection does.
_OWN_UNAVAILABLE = (ConfigurationError, DatabaseUnavailable, psycopg.OperationalError)
# After the own connection failed so, how long such a producer goes through its connection at once
# (a host that does not answer would cost a connect attempt at every read).
OWN_RETRY = 10.0


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One queue as `fastjobs queues list` shows it."""

    name: str
    paused_at: dt.datetime | None  # None: running
    waiting: int  # available, scheduled or retryable
    running: int  # on the state lane (a fast-lane batch's jobs stay 'available' until it commits)
    concurrency: int | None = None  # at most this many of its jobs run at once, cluster-wide
    rate_limit: str | None = None  # at most this many of its jobs start per period ("200/s"), cluster-wide
    max_backlog: int | None = None  # enqueues are held back while this many jobs wait
    held_back: int = 0  # enqueues held back by max_backlog so far (reported once a second)
    fair: bool = False  # marked fair: given jobs with a fairness key, its claims take them round-robin

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.RawCursor[tuple[Any, ...]]:
    return psycopg.RawCursor(conn, row_factory=tuple_row)


def pause(conn: psycopg.Connection[Any], queue: str, sql: ModuleType = sql) -> dt.datetime:
    """Pause `queue` (effective when `conn`'s transaction commits); when it was paused, already or now.
    `sql`: the catalogue of the App's schema (fastjobs.sql.of), as for every function here."""
    check_queue(queue)
    with _cursor(conn) as cur:
        row = cur.execute(sql.queue_pause, (queue,)).fetchone()
    assert row is not None
    paused_at: dt.datetime = row[0]
    return paused_at


def resume(conn: psycopg.Connection[Any], queue: str, sql: ModuleType = sql) -> bool:
    """Resume `queue` and wake its workers (at commit); False when it was not paused."""
    check_queue(queue)
    with _cursor(conn) as cur:
        return cur.execute(sql.queue_resume, (queue,)).fetchone() is not None


def list_queues(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[QueueInfo]:
    """Every queue acted on or holding jobs, by name."""
    with _cursor(conn) as cur:
        return [QueueInfo(*row) for row in cur.execute(sql.queue_list)]


class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()  # a limit left as it is


def limit(
    conn: psycopg.Connection[Any],
    queue: str,
    *,
    concurrency: int | None = UNCHANGED,
    max_backlog: int | None = UNCHANGED,
    rate_limit: str | None = UNCHANGED,
    sql: ModuleType = sql,
) -> None:
    """Set queue `queue`'s limits (None: none; UNCHANGED, the default: as it is).

    `concurrency`: at most this many of its jobs running at once, cluster-wide,
    from the next claim; `rate_limit`: at most N of its jobs started per
    period ("200/s", "1000/min", "50/h"), cluster-wide; `max_backlog`:
    producers held back while this many wait, from the leader's next count.
    """
    check_queue(queue)
    for name, value in (("concurrency", concurrency), ("max_backlog", max_backlog)):
        if (
            value is not UNCHANGED
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31)
        ):
            raise ValueError(f"{name} must be a positive integer or None, not {value!r}")
    if concurrency is UNCHANGED and max_backlog is UNCHANGED and rate_limit is UNCHANGED:
        raise ValueError("give concurrency=, rate_limit=, max_backlog= or several")
    rate = None if rate_limit is UNCHANGED or rate_limit is None else per_second(rate_limit)
    params = (
        queue,
        None if concurrency is UNCHANGED else concurrency,
        concurrency is not UNCHANGED,
        None if max_backlog is UNCHANGED else max_backlog,
        max_backlog is not UNCHANGED,
        None if rate_limit is UNCHANGED else rate_limit,
        rate,
        rate_limit is not UNCHANGED,
    )
    with _cursor(conn) as cur:
        cur.execute(sql.queue_limit, params)


_PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def per_second(rate_limit: str) -> float:
    """A rate limit ("200/s", "1000/min", "50/hour") in jobs per second; ValueError saying the form."""
    count, _, period = rate_limit.partition("/") if isinstance(rate_limit, str) else ("", "", "")
    seconds = _PERIODS.get(period.strip().lower())
    try:
        n = int(count.strip().replace("_", ""))
    except ValueError:
        n = 0
    if seconds is None or n < 1:
        raise ValueError(
            f"rate_limit must read N/PERIOD with N a positive integer and PERIOD s, min or h"
            f" (200/s, 1000/min), not {rate_limit!r}"
        )
    return n / seconds


@dataclass(frozen=True, slots=True)
class QueueState:
    """What an operator set on a queue, and the leader's last backlog count, for stats and metrics."""

    name: str
    paused_at: dt.datetime | None
    concurrency: int | None
    rate_limit: str | None
    max_backlog: int | None
    backlog: int | None  # counted up to max_backlog
    held_back: int


def states(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[QueueState]:
    """The queues an operator acted on, by name."""
    with _cursor(conn) as cur:
        return [QueueState(*row) for row in cur.execute(sql.queue_states)]


def count_backlogs(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> int:
    """The leader's service: count the backlog of each queue with a max_backlog; how many it counted."""
    with _cursor(conn) as cur:
        return cur.execute(sql.queue_count_backlogs).rowcount


class Backpressure:
    """A producer process's view of the full queues, read at most once a second.

    `check(queue, wait)` returns at once unless `queue` is full; then it
    waits up to `wait` seconds for room, looking again every WAIT_STEP, and
    raises QueueFull if none came. The enqueues held back are counted and
    added to the queue's held_back at the next read, or at once when the
    producer gives up. With `fair` (the enqueue's jobs have fairness keys) it
    also marks the queue fair, once per queue and process (sql.queue_fair).
    """

    def __init__(
        self,
        connection: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
        connection_async: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]],
        sql: ModuleType = sql,
    ) -> None:
        self.sql = sql  # the catalogue of the App's schema
        self._connection = connection
        self._connection_async = connection_async
        self._full: dict[str, tuple[int, int]] = {}  # queue: (backlog, max_backlog)
        self._read_at = -REFRESH
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._fair: set[str] = set()  # the queues this process marked fair
        self._own_down_until = 0.0  # time.monotonic() until which callers' connections go first
        self._dsnless = False  # the App has no DSN: callers' connections are its only way

    def check(
        self, queue: str, wait: float | None, conn: psycopg.Connection[Any] | None = None, fair: bool = False
    ) -> None:
        """Return once `queue` has room (at once unless it is full); QueueFull after `wait` seconds.

        The read goes through fastjobs' own pool, or through `conn` (the
        caller's) when the App has no DSN of its own or its own connection
        cannot be had (_OWN_UNAVAILABLE); so does the mark of a fair queue.
        """
        if fair and queue not in self._fair:
            self._mark(queue, conn)
        if time.monotonic() - self._read_at >= REFRESH:
            self._refresh(conn, force=False)
        if queue not in self._full:
            return
        with self._lock:
            self._held[queue] += 1
        try:
            for step in _steps(queue, wait, lambda: self._full):
                time.sleep(step)
                self._refresh(conn, force=True)
        except QueueFull:
            self._refresh(
                conn, force=True
            )  # reports the count: a producer that gives up may never read again
            raise

    async def check_async(
        self,
        queue: str,
        wait: float | None,
        conn: psycopg.AsyncConnection[Any] | None = None,
        fair: bool = False,
    ) -> None:
        """`check` for coroutines; two concurrent reads may both go to the database."""
        if fair and queue not in self._fair:
            await self._mark_async(queue, conn)
        if time.monotonic() - self._read_at >= REFRESH:
            await self._refresh_async(conn)
        if queue not in self._full:
            return
        with self._lock:
            self._held[queue] += 1
        try:
            for step in _steps(queue, wait, lambda: self._full):
                await asyncio.sleep(step)
                await self._refresh_async(conn)
        except QueueFull:
            await self._refresh_async(conn)
            raise

    def _refresh(self, caller: psycopg.Connection[Any] | None, force: bool) -> None:
        with self._lock:
            if not force and time.monotonic() - self._read_at < REFRESH:
                return  # another thread read meanwhile
            self._through(caller, self._read)

    def _mark(self, queue: str, caller: psycopg.Connection[Any] | None) -> None:
        def mark(conn: psycopg.Connection[Any]) -> None:
            with _cursor(conn) as cur:
                cur.execute(self.sql.queue_fair, (queue,))

        if self._through(caller, mark):
            self._fair.add(queue)

    async def _mark_async(self, queue: str, caller: psycopg.AsyncConnection[Any] | None) -> None:
        async def mark(conn: psycopg.AsyncConnection[Any]) -> None:
            async with psycopg.AsyncRawCursor(conn) as cur:
                await cur.execute(self.sql.queue_fair, (queue,))

        if await self._through_async(caller, mark):
            self._fair.add(queue)

    def _through(
        self, caller: psycopg.Connection[Any] | None, action: Callable[[psycopg.Connection[Any]], None]
    ) -> bool:
        """`action` on one of the App's own connections; on the caller's instead when the App has
        none or cannot have one (_OWN_UNAVAILABLE): in a savepoint of its transaction (a failed one
        leaves it be), or a transaction of its own when none is open. Whether that is its usual
        way: a mark made through the caller's connection while the App's own is down is made again
        at the next enqueue (the caller's transaction may roll it back); an App without a DSN has
        no other way."""
        with schema.required(self.sql.SCHEMA):
            if caller is None or time.monotonic() >= self._own_down_until:
                try:
                    with self._connection() as own:
                        action(own)
                    return True
                except _OWN_UNAVAILABLE as exc:
                    if caller is None:
                        raise
                    self._own_failed(exc)
            with caller.transaction():
                action(caller)
            return self._dsnless

    async def _through_async(
        self,
        caller: psycopg.AsyncConnection[Any] | None,
        action: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]],
    ) -> bool:
        """`_through` on async connections."""
        with schema.required(self.sql.SCHEMA):
            if caller is None or time.monotonic() >= self._own_down_until:
                try:
                    async with self._connection_async() as own:
                        await action(own)
                    return True
                except _OWN_UNAVAILABLE as exc:
                    if caller is None:
                        raise
                    self._own_failed(exc)
            async with caller.transaction():
                await action(caller)
            return self._dsnless

    def _own_failed(self, exc: Exception) -> None:
        """Callers' connections first for OWN_RETRY seconds; said once per failure (a DSN-less App's
        ConfigurationError is its normal way, not a failure)."""
        self._own_down_until = time.monotonic() + OWN_RETRY
        self._dsnless = isinstance(exc, ConfigurationError)
        if not self._dsnless:
            logger.warning(
                "fastjobs' own connection failed (%s): enqueues given conn= read the full queues"
                " through it for the next %gs",
                str(exc).strip(),
                OWN_RETRY,
            )

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        """Read the full queues, and report the enqueues held back since the last read (under the lock)."""
        with _cursor(conn) as cur:
            rows = cur.execute(self.sql.queue_full, (FRESH_FOR,)).fetchall()
            held, self._held = self._held, Counter()
            for queue, count in held.items():
                cur.execute(self.sql.queue_held_back, (queue, count))
        self._full = {name: (backlog, most) for name, backlog, most in rows}
        self._read_at = time.monotonic()

    async def _refresh_async(self, caller: psycopg.AsyncConnection[Any] | None) -> None:
        await self._through_async(caller, self._read_async)

    async def _read_async(self, conn: psycopg.AsyncConnection[Any]) -> None:
        async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
            rows = await (await cur.execute(self.sql.queue_full, (FRESH_FOR,))).fetchall()
            with self._lock:
                held, self._held = self._held, Counter()
            for queue, count in held.items():
                await cur.execute(self.sql.queue_held_back, (queue, count))
        self._full = {name: (backlog, most) for name, backlog, most in rows}
        self._read_at = time.monotonic()


def _steps(queue: str, wait: float | None, full: Callable[[], dict[str, tuple[int, int]]]) -> Iterator[float]:
    """The sleeps of a producer waiting for room in `queue` (the caller reads the full queues again
    after each); QueueFull once `wait` seconds passed with the queue still full."""
    began = time.monotonic()
    while queue in full():
        left = began + (wait or 0.0) - time.monotonic()
        if left <= 0:
            backlog, most = full()[queue]
            raise QueueFull(queue, backlog, most, waited=wait or 0.0)
        yield min(left, WAIT_STEP)
