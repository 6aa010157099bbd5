"""Queues steered at run time: pause, resume, list (the fastjobs_queues table, migration 007).

A paused queue keeps its jobs and takes enqueues; no claim of any worker
takes its jobs from the statement after the pause commits (the claims read
the table: sql._Choice.where), so jobs already claimed finish and no new one
starts. Resuming wakes the queue's sleeping workers at commit.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from . import sql
from .enqueue import check_queue

__all__ = ["QueueInfo", "list_queues", "pause", "paused", "resume"]


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One queue as `fastjobs queues list` shows it."""

    name: str
    paused_at: dt.datetime | None  # None: running
    waiting: int  # available, scheduled or retryable
    running: int  # on the state lane (a fast-lane batch's jobs stay 'available' until it commits)

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.RawCursor[tuple[Any, ...]]:
    return psycopg.RawCursor(conn, row_factory=tuple_row)


def pause(conn: psycopg.Connection[Any], queue: str) -> dt.datetime:
    """Pause `queue` (effective when `conn`'s transaction commits); when it was paused, already or now."""
    check_queue(queue)
    with _cursor(conn) as cur:
        row = cur.execute(sql.queue_pause, (queue,)).fetchone()
    assert row is not None
    paused_at: dt.datetime = row[0]
    return paused_at


def resume(conn: psycopg.Connection[Any], queue: str) -> bool:
    """Resume `queue` and wake its workers (at commit); False when it was not paused."""
    check_queue(queue)
    with _cursor(conn) as cur:
        return cur.execute(sql.queue_resume, (queue,)).fetchone() is not None


def list_queues(conn: psycopg.Connection[Any]) -> list[QueueInfo]:
    """Every queue acted on or holding jobs, by name."""
    with _cursor(conn) as cur:
        return [QueueInfo(*row) for row in cur.execute(sql.queue_list)]


def paused(conn: psycopg.Connection[Any]) -> dict[str, dt.datetime]:
    """The paused queues and since when."""
    with _cursor(conn) as cur:
        return dict(cur.execute(sql.queue_paused).fetchall())
