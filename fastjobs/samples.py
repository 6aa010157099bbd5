"""The leader's periodic samples of throughput per queue (fastjobs_samples), for the dashboard's charts."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg

from . import sql
from .report import cluster

__all__ = ["FAILED", "SamplesConfig", "run_once", "turn"]

# The outcomes a sample counts as failed: attempts that raised (retried) or ended the job (discarded).
FAILED = ("retried", "discarded")


@dataclass(frozen=True, slots=True)
class SamplesConfig:
    """One sample per queue every `interval` seconds, kept `retention` seconds.

    The counts come from the workers' heartbeats (report.cluster), which
    the workers write anyway: a sample costs one small INSERT and no scan of
    the jobs table. At the defaults the table holds 720 rows per queue.
    """

    interval: float = 10.0
    retention: float = 2 * 3600.0


def run_once(
    conn: psycopg.Connection[Any],
    now: dt.datetime | None = None,
    config: SamplesConfig = SamplesConfig(),
    sql: ModuleType = sql,
) -> dict[str, int]:
    """Write one sample per queue of the outcomes counted so far, prune the old ones; counts of each.

    A sample sums every registered worker's heartbeat, stale ones included
    (a dead worker's jobs were done); a worker pruned or restarted makes the
    sum fall, which a chart reads as no work in that interval.
    """
    totals: dict[str, list[int]] = {}
    for host in cluster(conn, sql=sql):
        for row in host.kinds:
            counts = totals.setdefault(row["queue"], [0, 0])
            counts[0] += int(row["completed"])
            counts[1] += sum(int(row[name]) for name in FAILED)
    with psycopg.RawCursor(conn) as cur:
        at = now or cur.execute(sql.db_now).fetchone()[0]  # type: ignore[index]
        queues = sorted(totals)
        written = cur.execute(
            sql.sample_write,
            (at, queues, [totals[q][0] for q in queues], [totals[q][1] for q in queues]),
        ).rowcount
        pruned = cur.execute(sql.sample_prune, (at - dt.timedelta(seconds=config.retention),)).rowcount
    return {"written": max(written, 0), "pruned": max(pruned, 0)}


def turn(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> None:
    """The leader's turn of this service: a sample is routine, so nothing is returned to log."""
    run_once(conn, sql=sql)
