"""Maintenance that runs once per cluster: for now the scheduler.

Every service has one shape: a config with defaults and `run_once(conn, now)`
that works in LIMIT-sized batches until a batch comes back short. Until the
leader process exists, idle workers run the scheduler themselves (it is safe
to run concurrently: SKIP LOCKED).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import psycopg

from . import sql


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    batch: int = 10_000
    interval: float = 1.0


def schedule_once(
    conn: psycopg.Connection[Any], now: dt.datetime | None = None, config: SchedulerConfig = SchedulerConfig()
) -> dict[str, int]:
    """Make due scheduled and retryable jobs available; returns the count per queue."""
    counts: dict[str, int] = {}
    with psycopg.RawCursor(conn) as cur:
        while True:
            rows = cur.execute(sql.job_schedule_many, (config.batch, now)).fetchall()
            moved = 0
            for queue, count, _ in rows:
                counts[queue] = counts.get(queue, 0) + count
                moved += count
            if moved < config.batch:
                return counts
