"""What `fastjobs stats` and the metrics show beyond the slots: cluster, queue depths, MVCC health, upkeep."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg

from . import sql
from .abc import (
    OUTCOMES,
)
from .stats import LEADER, ROTATION_DEFERRED, ROTATION_FAILED, ROTATION_GAVE_WAY, ROTATION_PRIVILEGES

__all__ = [
    "HORIZON_WARNING",
    "NOTIFY_WARNING",
    "ROTATION_PROBLEMS",
    "STALE_AFTER",
    "CarefulWorker",
    "ClusterHost",
    "ClusterWorker",
    "Health",
    "Horizon",
    "QueueDepth",
    "SlowEvents",
    "TableHealth",
    "UnhandledKind",
    "cluster",
    "engine_events",
    "health",
    "queue_depths",
    "unhandled_kinds",
    "upkeep_warnings",
]

ROTATION_PROBLEMS = {
    ROTATION_PRIVILEGES: (
        "privileges",
        "the role it connects as may not empty the rotating slots: as the tables' owner, run the GRANTs"
        " the leader's log names (docs/operations/upgrades.md, Roles and grants)",
    ),
    ROTATION_DEFERRED: (
        "deferred",
        "the oldest slot holds a backlog, which it moves to slot 0 after RotationConfig.patience;"
        " serve or discard that queue's jobs",
    ),
    ROTATION_GAVE_WAY: (
        "gave way",
        "its lock is not granted in time: a long transaction holds the jobs table (MVCC health names the"
        " oldest); end it",
    ),
    ROTATION_FAILED: ("failed", "its statements fail: the leader's log says why"),
}


def upkeep_warnings(processes: Iterable[dict[str, float]]) -> list[str]:
    """Lines for the operator from the slots of leaders that lead: the rotation, when its last try did
    not rotate, and maintenance services that fail."""
    lines = []
    for p in processes:
        if p["role"] != LEADER or not p["leading"]:
            continue
        problem = int(p["rotation_problem"])
        if problem in ROTATION_PROBLEMS:
            name, hint = ROTATION_PROBLEMS[problem]
            last = (
                f"last rotated {time.time() - p['rotated_at']:,.0f}s ago"
                if p["rotated_at"]
                else "not rotated yet"
            )
            lines.append(
                f"WARNING: the rotation cannot do its work ({name}; {last}): the rotating slots, which"
                f" nothing else cleans, grow until it does. Why and what to do: {hint}."
            )
        if p["services_failing"]:
            lines.append(
                f"WARNING: {int(p['services_failing'])} maintenance service(s) of the leader (pid"
                f" {int(p['pid'])}) failed at their last turn ({int(p['service_failures'])} failures in all);"
                " the others go on. Its log says which and why."
            )
    return lines


# A worker heartbeats every maintenance.HEARTBEAT_INTERVAL (2 s): three missed and
# the cluster view calls it stale (the rescuer waits for --rescue-after, 15 s).
STALE_AFTER = 6.0


@dataclass(frozen=True, slots=True)
class ClusterWorker:
    """One row of fastjobs_workers as the cluster view shows it."""

    id: str
    pid: int
    queues: list[str]
    age: float  # seconds since it registered
    heartbeat_age: float  # seconds since its last heartbeat, by the database's clock
    stale: bool
    rate: float  # jobs finished per second between its last two heartbeats (0 when stale)
    counters: dict[str, Any]  # its heartbeat's (worker_counters); {} from a worker that sends none


@dataclass(frozen=True, slots=True)
class ClusterHost:
    """The workers of one host (host id) against this database, and their sums."""

    host: str
    workers: list[ClusterWorker]
    queues: list[str]
    stale: int  # workers whose heartbeat is older than STALE_AFTER
    heartbeat_age: float  # its freshest worker's
    rate: float
    totals: dict[str, int]  # claimed, completed, failed, retried, discarded over its workers
    kinds: list[dict[str, Any]]  # {queue, kind, and each of OUTCOMES} summed over its workers


def cluster(
    conn: psycopg.Connection[Any], stale_after: float = STALE_AFTER, sql: ModuleType = sql
) -> list[ClusterHost]:
    """Every host with workers registered in this database (from their heartbeats), by host id."""
    with psycopg.RawCursor(conn) as cur:
        rows = cur.execute(sql.worker_list).fetchall()
    by_host: dict[str, list[ClusterWorker]] = {}
    for worker_id, host, pid, queues, age, beat, counters in rows:
        counters = counters if isinstance(counters, dict) else {}
        stale = beat > stale_after
        rate = 0.0 if stale else float(counters.get("rate", 0.0))
        worker = ClusterWorker(worker_id, pid, list(queues), age, beat, stale, rate, counters)
        by_host.setdefault(host, []).append(worker)
    hosts = []
    for host, workers in by_host.items():
        totals = {name: 0 for name in ("claimed", "completed", "failed", "retried", "discarded")}
        kinds: dict[tuple[str, str], dict[str, Any]] = {}
        for w in workers:
            for name in totals:
                totals[name] += int(w.counters.get(name, 0))
            for queue, kind, *outcomes in w.counters.get("kinds", []):
                row = kinds.setdefault(
                    (queue, kind), {"queue": queue, "kind": kind, **dict.fromkeys(OUTCOMES, 0)}
                )
                for name, n in zip(OUTCOMES, outcomes, strict=False):
                    row[name] += int(n)
        hosts.append(
            ClusterHost(
                host,
                workers,
                sorted({q for w in workers for q in w.queues}),
                sum(w.stale for w in workers),
                min(w.heartbeat_age for w in workers),
                sum(w.rate for w in workers),
                totals,
                [kinds[key] for key in sorted(kinds)],
            )
        )
    return hosts


@dataclass(frozen=True, slots=True)
class SlowEvents:
    """A queue's slow-job events on one live worker, from its heartbeat (Planner.events)."""

    host: str
    worker: str
    queue: str
    slow_jobs: int  # its jobs that outran their bound: the guard handed back what their batch held
    demotions: int  # times the queue left the fast lane for the state lane (a slow batch, a hand-over)
    last_age: float  # seconds since the last of either, now
    state_lane_left: float  # seconds the queue still takes the state lane for them, now (0: none)


@dataclass(frozen=True, slots=True)
class CarefulWorker:
    """A live worker that started in careful mode (its predecessor died writing several failed jobs'
    outcomes: one job per batch for worker.CAREFUL_FOR seconds, to find the job that kills it)."""

    host: str
    worker: str
    age: float  # seconds since its careful mode began, now
    left: float  # seconds of careful mode left, now (0: over)


def engine_events(hosts: list[ClusterHost]) -> tuple[list[SlowEvents], list[CarefulWorker]]:
    """The slow-job and careful-mode events the live workers' heartbeats carry, the latest first."""
    slow: list[SlowEvents] = []
    careful: list[CarefulWorker] = []
    for h in hosts:
        for w in h.workers:
            if w.stale:
                continue
            later = w.heartbeat_age
            for e in w.counters.get("slow", []):
                slow.append(
                    SlowEvents(
                        h.host,
                        w.id,
                        str(e["queue"]),
                        int(e["slow_jobs"]),
                        int(e["demotions"]),
                        float(e["last_ago"]) + later,
                        max(float(e["state_lane_left"]) - later, 0.0),
                    )
                )
            c = w.counters.get("careful")
            if c:
                careful.append(
                    CarefulWorker(h.host, w.id, float(c["ago"]) + later, max(float(c["left"]) - later, 0.0))
                )
    slow.sort(key=lambda e: e.last_age)
    careful.sort(key=lambda c: c.age)
    return slow, careful


@dataclass(frozen=True, slots=True)
class UnhandledKind:
    """A kind with pending jobs on a queue that live workers serve, none of which has its handler."""

    queue: str
    kind: str
    pending: int
    workers: int  # the live workers serving the queue, each failing the kind's jobs when it claims them

    def warning(self) -> str:
        jobs = f"{self.pending:,} pending job{'' if self.pending == 1 else 's'}"
        return (
            f"WARNING: {jobs} of kind {self.kind!r} on queue {self.queue!r}, and no live worker handles"
            f" that kind: the {self.workers} serving the queue fail each with 'no handler registered'"
            " and it retries. Deploy workers whose application imports its handler, or `fastjobs jobs"
            f" discard --kind {self.kind}`."
        )


def unhandled_kinds(kinds: Iterable[tuple[str, str, int]], hosts: list[ClusterHost]) -> list[UnhandledKind]:
    """The (queue, kind, pending) of `kinds` with pending jobs that no live worker handles.

    Only queues that live workers serve, and whose workers all say what they
    handle (a heartbeat's "handles"; older workers' do not) are judged: a
    queue nobody serves is another matter. The jobs are left to retry, since a
    rolling deploy may bring their handler.
    """
    live = [w for h in hosts for w in h.workers if not w.stale]
    found = []
    for queue, kind, pending in kinds:
        serving = [w for w in live if queue in w.queues]
        if not pending or not serving or any("handles" not in w.counters for w in serving):
            continue
        if not any(kind in w.counters["handles"] for w in serving):
            found.append(UnhandledKind(queue, kind, pending, len(serving)))
    return found


@dataclass(frozen=True, slots=True)
class QueueDepth:
    queue: str
    state: str
    count: int
    oldest_seconds: float | None


def queue_depths(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[QueueDepth]:
    with psycopg.RawCursor(conn) as cur:
        return [QueueDepth(*row) for row in cur.execute(sql.job_stats_by_queue)]


# `fastjobs stats` warns about a transaction pinning the horizon this long:
# at 100k jobs/s a minute leaves millions of dead rows behind the claim index.
HORIZON_WARNING = 60.0
NOTIFY_WARNING = 0.05


@dataclass(frozen=True, slots=True)
class Horizon:
    """The oldest snapshot holding back cleanup of this database's dead rows."""

    source: str  # backend, prepared transaction or replication slot
    ident: str  # its pid, gid or slot name
    seconds: float | None  # how long its transaction has been open (None for a slot)
    xid_age: int | None  # transactions since its snapshot
    detail: str


@dataclass(frozen=True, slots=True)
class TableHealth:
    table: str
    live: int
    dead: int
    table_bytes: int
    index_bytes: int
    last_autovacuum: float | None  # epoch seconds
    last_vacuum: float | None
    autovacuums: int
    last_autoanalyze: float | None


@dataclass(frozen=True, slots=True)
class Health:
    """MVCC health: what keeps dead rows from being removed, and how many there are."""

    horizon: Horizon | None
    tables: list[TableHealth]
    notify_queue: float  # fraction of the NOTIFY queue in use

    def warnings(self, pinned_after: float = HORIZON_WARNING) -> list[str]:
        """Lines for the operator: a horizon pinned longer than `pinned_after` s, a filling NOTIFY queue."""
        lines = []
        h = self.horizon
        if h is not None and h.seconds is not None and h.seconds > pinned_after:
            dead = sum(t.dead for t in self.tables)
            lines.append(
                f"WARNING: cleanup horizon pinned for {h.seconds:,.0f}s by {h.source} {h.ident} ({h.detail}):"
                f" VACUUM cannot remove dead rows newer than it ({dead:,} dead in fastjobs tables)."
                " End or kill that transaction."
            )
        if self.notify_queue >= NOTIFY_WARNING:
            lines.append(
                f"WARNING: the NOTIFY queue is {self.notify_queue:.0%} full: a listening session is stuck"
                " in a transaction; enqueues fail when it is full."
            )
        return lines


def health(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> Health:
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.mvcc_horizon).fetchone()
        tables = [TableHealth(*r) for r in cur.execute(sql.mvcc_tables)]
        usage = cur.execute(sql.notify_queue_usage).fetchone()
    return Health(Horizon(*row) if row else None, tables, float(usage[0]) if usage else 0.0)
