"""What the dashboard's pages read: bounded statements only, estimates where a count would scan."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.types.json import Jsonb

from .. import control, queues, report, scoreboard, stats
from ..maintenance import PeriodicStatus, periodic_status
from ..planner import fast_queues
from ..types import JobState

__all__ = [
    "BOUND",
    "EXACT_BELOW",
    "PAGE",
    "SAMPLE_ROWS",
    "STATES",
    "WINDOW",
    "Engine",
    "Filters",
    "JobsPage",
    "Lane",
    "Overview",
    "QueueRow",
    "depths",
    "engine",
    "estimate",
    "job",
    "jobs_page",
    "lanes",
    "overview",
    "periodic",
    "queue_rows",
]

if TYPE_CHECKING:
    from ..app import App

# Below this many rows (the statistics collector's count) the overview counts
# every job exactly, as `fastjobs stats` does; job_stats_by_queue reads each
# row, about 200 ms per million.
EXACT_BELOW = 200_000
# Above it, each state is counted up to this many jobs (exact when it has fewer)...
BOUND = 5_000
# ... and the states with more are estimated from a sample of about this many rows.
SAMPLE_ROWS = 10_000
# The jobs list reads at most this many of the newest jobs below its cursor per page.
WINDOW = 20_000
PAGE = 50
STATES = tuple(s.value for s in JobState)


@dataclass(slots=True)
class QueueRow:
    """One queue on the overview: its jobs by state, and the oldest available job's age."""

    queue: str
    counts: dict[str, int] = field(default_factory=dict)
    estimated: set[str] = field(default_factory=set)  # the states whose count is an estimate
    oldest_available: float | None = None
    oldest_estimated: bool = False
    below: int = 0  # an estimated state the sample found none of has fewer than about this many
    paused_at: dt.datetime | None = None  # flow control (fastjobs.queues): paused since
    concurrency: int | None = None  # its jobs running at once, cluster-wide, at most
    rate_limit: str | None = None  # its jobs started per period, cluster-wide, at most: "200/s"
    max_backlog: int | None = None
    backlog: int | None = None  # the leader's last count, up to max_backlog
    held_back: int = 0
    completed: list[float] = field(default_factory=list)  # jobs completed per minute, oldest first
    failed: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Overview:
    rows_estimate: int  # jobs in the table, by the statistics collector
    results_estimate: int
    exact: bool  # every count exact (a small table)
    queues: list[QueueRow]
    hosts: list[report.ClusterHost]
    health: report.Health
    warnings: list[str]
    sampled_at: list[dt.datetime]  # the times of the charts' points


def estimate(conn: psycopg.Connection[Any], sql: ModuleType) -> tuple[int, int]:
    """(jobs, kept results) as the statistics collector counts them: no scan."""
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.jobs_estimate).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def depths(conn: psycopg.Connection[Any], rows: int, sql: ModuleType) -> tuple[dict[str, QueueRow], bool]:
    """Jobs per queue and state: exact below EXACT_BELOW rows, else exact for the states with at most
    BOUND jobs and estimated from a TABLESAMPLE for the others (marked in QueueRow.estimated)."""
    queues: dict[str, QueueRow] = {}
    with psycopg.RawCursor(conn) as cur:
        if rows < EXACT_BELOW:
            for d in report.queue_depths(conn, sql):
                q = queues.setdefault(d.queue, QueueRow(d.queue))
                q.counts[d.state] = d.count
                if d.state == "available":
                    q.oldest_available = d.oldest_seconds
            return queues, True
        with conn.transaction():
            cur.execute(sql.depth_by_index)
            bounded = cur.execute(sql.jobs_depth_bounded, (BOUND,)).fetchall()
        per_state: dict[str, int] = {}
        for state, queue, count, oldest in bounded:
            per_state[state] = per_state.get(state, 0) + count
            q = queues.setdefault(queue, QueueRow(queue))
            q.counts[state] = count
            if state == "available":
                q.oldest_available = oldest
        many = {
            state
            for group in sql.DEPTH_GROUPS
            if sum(per_state.get(state, 0) for state in group) >= BOUND
            for state in group
        }
        if many:
            percent = min(100.0, 100.0 * SAMPLE_ROWS / max(rows, 1))
            for q in queues.values():
                for state in many:
                    q.counts.pop(state, None)
                q.estimated |= many
            for queue, state, count, oldest in cur.execute(sql.jobs_depth_sampled, (percent,)):
                if state not in many:
                    continue
                q = queues.setdefault(queue, QueueRow(queue, estimated=set(many)))
                q.counts[state] = round(count * 100.0 / percent)
                if state == "available":
                    q.oldest_available, q.oldest_estimated = oldest, True
            resolution = round(100.0 / percent)
            for q in queues.values():
                q.below = resolution
    return queues, False


def _charts(conn: psycopg.Connection[Any], queues: dict[str, QueueRow], sql: ModuleType) -> list[dt.datetime]:
    """Each queue's completed and failed jobs per minute over the last hour, from the leader's samples.

    A sample holds the outcomes counted so far; a point is the difference
    between two, per minute. A sum that fell (a worker restarted or pruned)
    counts as nothing done in that interval.
    """
    with psycopg.RawCursor(conn) as cur:
        since = cur.execute(sql.db_now).fetchone()[0] - dt.timedelta(hours=1)  # type: ignore[index]
        samples = cur.execute(sql.sample_list, (since,)).fetchall()
    times: set[dt.datetime] = set()
    last: dict[str, tuple[dt.datetime, int, int]] = {}
    for at, queue, completed, failed in samples:
        times.add(at)
        before = last.get(queue)
        last[queue] = (at, completed, failed)
        if before is None:
            continue
        minutes = max((at - before[0]).total_seconds(), 1.0) / 60.0
        q = queues.setdefault(queue, QueueRow(queue))
        q.completed.append(max(completed - before[1], 0) / minutes)
        q.failed.append(max(failed - before[2], 0) / minutes)
    return sorted(times)


def queue_rows(conn: psycopg.Connection[Any], rows: int, sql: ModuleType) -> tuple[dict[str, QueueRow], bool]:
    """Every queue holding jobs or acted on (paused, limited): its depths (see `depths`) and its flow
    control, from fastjobs.queues."""
    found, exact = depths(conn, rows, sql)
    for state in queues.states(conn, sql):
        q = found.setdefault(state.name, QueueRow(state.name))
        q.paused_at, q.concurrency, q.rate_limit, q.max_backlog, q.backlog, q.held_back = (
            state.paused_at,
            state.concurrency,
            state.rate_limit,
            state.max_backlog,
            state.backlog,
            state.held_back,
        )
    return found, exact


def overview(conn: psycopg.Connection[Any], dsn: str, sql: ModuleType) -> Overview:
    """The overview's figures, and the warnings `fastjobs stats` gives (the upkeep's from the masters
    on this host)."""
    rows, results = estimate(conn, sql)
    queues, exact = queue_rows(conn, rows, sql)
    times = _charts(conn, queues, sql)
    hosts = report.cluster(conn, sql=sql)
    health = report.health(conn, sql)
    warnings = health.warnings() + _upkeep_warnings(conn, dsn, sql)
    if exact:  # job_kinds groups the whole table: only where that is cheap
        warnings += [u.warning() for u in report.unhandled_kinds(control.kinds(conn, sql), hosts)]
    return Overview(rows, results, exact, [queues[k] for k in sorted(queues)], hosts, health, warnings, times)


def _upkeep_warnings(conn: psycopg.Connection[Any], dsn: str, sql: ModuleType) -> list[str]:
    found, _ = scoreboard.live_masters(scoreboard.database_identity(conn, dsn, sql), remove_stale=False)
    return report.upkeep_warnings(p for m in found for p in m.processes)


@dataclass(frozen=True, slots=True)
class Filters:
    """The jobs list's filters, as the query string gives them (empty: any)."""

    state: str | None = None
    queue: str | None = None
    kind: str | None = None
    args: Any = None  # a JSON value the args must contain (jsonb @>)
    args_text: str = ""  # as typed

    def query(self, **more: Any) -> dict[str, str]:
        """The filters as query parameters (for links), with `more`."""
        found = {"state": self.state, "queue": self.queue, "kind": self.kind, "args": self.args_text or None}
        return {k: str(v) for k, v in {**found, **more}.items() if v not in (None, "")}

    def describe(self) -> str:
        parts = [f"{name} {value}" for name, value in (("state", self.state), ("queue", self.queue))]
        parts += [
            f"kind {self.kind}" if self.kind else "",
            f"args containing {self.args_text}" if self.args_text else "",
        ]
        return ", ".join(p for p in parts if p and not p.endswith(" None")) or "every job"


@dataclass(frozen=True, slots=True)
class JobsPage:
    jobs: list[dict[str, Any]]
    read: int  # jobs the window read
    next_before: int | None  # the cursor of the next page (None: no more)
    window_end: int | None  # the lowest id read, when the window was read through without filling the page


def jobs_page(
    conn: psycopg.Connection[Any], filters: Filters, before: int | None, sql: ModuleType
) -> JobsPage:
    """Up to PAGE jobs matching `filters` below id `before`, newest first, among the WINDOW newest."""
    args = None if filters.args is None else Jsonb(filters.args)
    params = (
        before if before is not None else 2**63 - 1,
        WINDOW,
        filters.queue,
        filters.state,
        filters.kind,
        args,
        PAGE,
    )
    with control.inspecting(conn) as cur:
        rows = cur.execute(sql.job_page, params).fetchall()
    read = int(rows[0]["n"]) if rows else 0
    low = rows[0]["low"] if rows else None
    jobs = [r for r in rows if r["id"] is not None]
    if len(jobs) == PAGE:
        return JobsPage(jobs, read, jobs[-1]["id"], None)
    if read == WINDOW and low is not None:
        return JobsPage(jobs, read, low, low)
    return JobsPage(jobs, read, None, None)


def job(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType) -> dict[str, Any]:
    """Every column of one job and its kept outcome (control.show); JobNotFound when there is none."""
    return control.show(conn, job_id, sql)


def periodic(conn: psycopg.Connection[Any], app: App) -> tuple[list[PeriodicStatus], list[tuple[str, Any]]]:
    """The app's periodic jobs with schedule and next tick; and the kinds the database records ticks
    of that the app does not register (another application's, or one removed)."""
    specs = [s for s in app.jobs.values() if s.cron]
    found = periodic_status(conn, specs, sql=app.sql)
    with psycopg.RawCursor(conn) as cur:
        recorded = cur.execute(app.sql.periodic_list).fetchall()
    known = {s.kind for s in specs}
    return found, [(kind, tick) for kind, tick in recorded if kind not in known]


@dataclass(frozen=True, slots=True)
class Lane:
    queue: str
    lane: str  # "fast" or "state"
    why: str


def lanes(app: App) -> list[Lane]:
    """Each registered queue's lane by the hot loops' own rule (planner.fast_queues), and why; each
    worker then takes the fast lane per batch (a backlog, batches run quickly)."""
    names = sorted({spec.queue for spec in app.jobs.values()})
    allowed = fast_queues(app.jobs, names, fast_lane=True, keep_completed=False)
    found = []
    for queue, fast in zip(names, allowed, strict=True):
        if fast:
            why = (
                "every kind is sync without a timeout: a backlog takes it once a batch ran in under 0.05 s"
                " (not with --keep-completed, --no-fast-lane or threads for the queue)"
            )
        else:
            slow = [
                s for s in app.jobs.values() if s.queue == queue and (s.is_async or s.timeout is not None)
            ]
            why = ", ".join(
                f"{s.kind} is {'async' if s.is_async else f'timeout={s.timeout:g}'}" for s in slow
            )
        found.append(Lane(queue, "fast" if fast else "state", why))
    return found


@dataclass(frozen=True, slots=True)
class Engine:
    masters: list[dict[str, Any]]  # this host's live masters of this database: their processes
    warnings: list[str]
    current_slot: int
    rotating_bytes: int
    health: report.Health
    results_estimate: int
    results: list[dict[str, Any]]
    slow: list[report.SlowEvents]  # every live worker's, from its heartbeat
    careful: list[report.CarefulWorker]


def engine(conn: psycopg.Connection[Any], dsn: str, sql: ModuleType) -> Engine:
    found, _ = scoreboard.live_masters(scoreboard.database_identity(conn, dsn, sql), remove_stale=False)
    now = time.time()
    masters = [
        {
            "pid": m.master_pid,
            "processes": [
                {
                    **p,
                    "role_name": stats.ROLES.get(int(p["role"]), "?"),
                    "beat_age": now - p["heartbeat"],
                    "listener_age": now - p["listener_ok"],
                    "rotated_age": now - p["rotated_at"] if p["rotated_at"] else None,
                    "problem": report.ROTATION_PROBLEMS.get(int(p["rotation_problem"]), ("", ""))[0],
                }
                for p in m.processes
            ],
        }
        for m in found
    ]
    warnings = report.upkeep_warnings(p for m in found for p in m.processes)
    health = report.health(conn, sql)
    warnings += health.warnings()
    with psycopg.RawCursor(conn) as plain:
        usage = plain.execute(sql.slot_usage).fetchone()
    with control.inspecting(conn) as cur:
        results = cur.execute(sql.result_list, (20,)).fetchall()
    _, kept = estimate(conn, sql)
    slow, careful = report.engine_events(report.cluster(conn, sql=sql))
    assert usage is not None
    return Engine(masters, warnings, int(usage[0]), int(usage[1]), health, kept, results, slow, careful)
