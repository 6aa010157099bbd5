"""The Prometheus text exposition of the cards, queue depths, MVCC health and the cluster's hosts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from .abc import (
    BUCKETS,
    OUTCOMES,
)
from .report import ROTATION_PROBLEMS, STALE_AFTER, ClusterHost, Health, QueueDepth, engine_events
from .scoreboard import Histogram, KindCounts, Scoreboard
from .stats import LEADER, ROLES, WORKER, Card

__all__ = ["cluster_metrics", "kind_metrics", "prometheus"]

if TYPE_CHECKING:
    from .keys import KeyUsage
    from .queues import QueueState


def prometheus(
    board: Scoreboard,
    depths: list[QueueDepth] | None,
    health: Health | None = None,
    hosts: list[ClusterHost] | None = None,
    steered: Sequence[QueueState] = (),
    keyed: Sequence[KeyUsage] = (),
) -> str:
    """Prometheus text exposition of the counters (and queue depths with the queues an operator
    `steered` and the kinds limited per key, MVCC health and the cluster's hosts when given)."""
    lines = []
    counters = (
        ("claimed", "jobs claimed"),
        ("completed", "jobs completed"),
        ("failed", "attempts that failed"),
        ("retried", "failed attempts scheduled to run again"),
        ("discarded", "jobs discarded after their last attempt"),
    )
    live = [
        (f'role="{ROLES.get(int(d["role"]), "?")}",index="{int(d["index"])}"', d)
        for d in map(Card.as_dict, board)
        if d["role"]
    ]
    now = time.time()

    def family(name: str, kind: str, help_text: str, value: Callable[[dict[str, float]], str]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value(d)}" for labels, d in live)

    for counter, help_text in counters:

        def count(d: dict[str, float], field: str = counter) -> str:
            return str(int(d[field]))

        family(f"fastjobs_jobs_{counter}_total", "counter", help_text, count)
    family(
        "fastjobs_busy_seconds_total", "counter", "time spent running batches", lambda d: f"{d['busy']:.6f}"
    )
    family(
        "fastjobs_heartbeat_age_seconds",
        "gauge",
        "seconds since the process last reported",
        lambda d: f"{now - d['heartbeat']:.3f}",
    )
    leaders = [(labels, d) for labels, d in live if d["role"] == LEADER and d["leading"]]
    lines.extend(_upkeep_metrics(leaders, now))
    live = [(labels, d) for labels, d in live if d["role"] == WORKER]
    family(
        "fastjobs_listener_up",
        "gauge",
        "1 while the worker's LISTEN connection is up",
        lambda d: str(int(d["listening"])),
    )
    family(
        "fastjobs_listener_ok_age_seconds",
        "gauge",
        "seconds since the listener's last working connect or ping",
        lambda d: f"{now - d['listener_ok']:.3f}",
    )
    family(
        "fastjobs_listener_reconnects_total",
        "counter",
        "listener connections lost and made again",
        lambda d: str(int(d["listener_reconnects"])),
    )
    if depths is not None:
        lines.append("# HELP fastjobs_queue_jobs jobs in the table by queue and state")
        lines.append("# TYPE fastjobs_queue_jobs gauge")
        for q in depths:
            lines.append(f'fastjobs_queue_jobs{{queue="{_escape(q.queue)}",state="{q.state}"}} {q.count}')
        lines.append("# HELP fastjobs_queue_oldest_seconds age of the oldest job by queue and state")
        lines.append("# TYPE fastjobs_queue_oldest_seconds gauge")
        for q in depths:
            if q.oldest_seconds is not None:
                labels = f'queue="{_escape(q.queue)}",state="{q.state}"'
                lines.append(f"fastjobs_queue_oldest_seconds{{{labels}}} {q.oldest_seconds:.3f}")
        paused = {q.name for q in steered if q.paused_at}
        lines.append("# HELP fastjobs_queue_paused 1 while the queue is paused (fastjobs queues pause)")
        lines.append("# TYPE fastjobs_queue_paused gauge")
        for name in sorted({q.queue for q in depths} | paused):
            lines.append(f'fastjobs_queue_paused{{queue="{_escape(name)}"}} {int(name in paused)}')
        lines.append(
            "# HELP fastjobs_queue_concurrency the most jobs of the queue running at once, cluster-wide"
        )
        lines.append("# TYPE fastjobs_queue_concurrency gauge")
        lines.extend(
            f'fastjobs_queue_concurrency{{queue="{_escape(q.name)}"}} {q.concurrency}'
            for q in steered
            if q.concurrency is not None
        )
        limited = [q for q in steered if q.max_backlog is not None]
        lines.append("# HELP fastjobs_queue_max_backlog the backlog past which enqueues are held back")
        lines.append("# TYPE fastjobs_queue_max_backlog gauge")
        lines.extend(
            f'fastjobs_queue_max_backlog{{queue="{_escape(q.name)}"}} {q.max_backlog}' for q in limited
        )
        lines.append("# HELP fastjobs_queue_held_back_total enqueues held back by the queue's max_backlog")
        lines.append("# TYPE fastjobs_queue_held_back_total counter")
        lines.extend(
            f'fastjobs_queue_held_back_total{{queue="{_escape(q.name)}"}} {q.held_back}'
            for q in steered
            if q.max_backlog is not None or q.held_back
        )
        lines.extend(_key_metrics(keyed))
    lines.extend(kind_metrics(board.kinds()))
    if health is not None:
        lines.extend(_health_metrics(health))
    if hosts is not None:
        lines.extend(cluster_metrics(hosts))
    return "\n".join(lines) + "\n"


def _upkeep_metrics(leaders: list[tuple[str, dict[str, float]]], now: float) -> list[str]:
    """The leading leader's maintenance health: the rotation's problem and age, failing services."""
    lines = [
        "# HELP fastjobs_rotation_problem 1 for why the leader's last rotation try did not rotate"
        " (privileges, deferred, gave way, failed); all 0 when it rotated",
        "# TYPE fastjobs_rotation_problem gauge",
    ]
    for labels, d in leaders:
        problem = int(d["rotation_problem"])
        lines.extend(
            f'fastjobs_rotation_problem{{{labels},reason="{name}"}} {int(code == problem)}'
            for code, (name, _) in ROTATION_PROBLEMS.items()
        )
    lines += [
        "# HELP fastjobs_rotation_age_seconds seconds since the leader last rotated (-1: not yet)",
        "# TYPE fastjobs_rotation_age_seconds gauge",
    ]
    lines.extend(
        f"fastjobs_rotation_age_seconds{{{labels}}} {now - d['rotated_at'] if d['rotated_at'] else -1.0:.3f}"
        for labels, d in leaders
    )
    lines += [
        "# HELP fastjobs_maintenance_services_failing leader services whose last turn raised",
        "# TYPE fastjobs_maintenance_services_failing gauge",
    ]
    lines.extend(
        f"fastjobs_maintenance_services_failing{{{labels}}} {int(d['services_failing'])}"
        for labels, d in leaders
    )
    lines += [
        "# HELP fastjobs_maintenance_failures_total leader service turns that raised",
        "# TYPE fastjobs_maintenance_failures_total counter",
    ]
    lines.extend(
        f"fastjobs_maintenance_failures_total{{{labels}}} {int(d['service_failures'])}"
        for labels, d in leaders
    )
    return lines


_LE = [*(repr(b) for b in BUCKETS), "+Inf"]


def _key_metrics(keyed: Sequence[KeyUsage]) -> list[str]:
    """The kinds limited per key (fastjobs.keys.usage): a series each, labelled by kind only (a key
    label would make a series per tenant)."""
    lines = []
    families: tuple[tuple[str, str, Callable[[KeyUsage], float | None]], ...] = (
        ("fastjobs_key_keys_running", "keys with jobs of the kind running", lambda k: k.keys_running),
        ("fastjobs_key_jobs_running", "jobs of the kind limited per key running", lambda k: k.running),
        (
            "fastjobs_key_keys_at_limit",
            "keys running as many jobs of the kind as their concurrency limit lets",
            lambda k: k.keys_at_limit,
        ),
        (
            "fastjobs_key_longest_wait_seconds",
            "how long the kind's job due the longest has waited (of each queue's first 1,000 due)",
            lambda k: k.longest_waiting_seconds,
        ),
    )
    for name, help_text, value in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        for k in keyed:
            v = value(k)
            if v is not None:
                number = f"{v:.3f}" if isinstance(v, float) else str(v)
                lines.append(f'{name}{{kind="{_escape(k.kind)}"}} {number}')
    return lines


def kind_metrics(kinds: list[KindCounts]) -> list[str]:
    """The outcome counters and the two histograms per (queue, kind)."""
    lines = [
        "# HELP fastjobs_job_outcomes_total jobs finished by queue, kind and outcome",
        "# TYPE fastjobs_job_outcomes_total counter",
    ]
    labelled = [(f'queue="{_escape(k.queue)}",kind="{_escape(k.kind)}"', k) for k in kinds]
    for labels, k in labelled:
        lines.extend(
            f'fastjobs_job_outcomes_total{{{labels},outcome="{outcome}"}} {n}'
            for outcome, n in k.outcomes.items()
        )
    for name, help_text in (
        ("run", "time the handler took (jobs this worker ran itself, or timed by its executor)"),
        ("pickup", "from when a job was due to when its worker started its batch, by the worker's clock"),
    ):
        family = f"fastjobs_job_{name}_seconds"
        lines.append(f"# HELP {family} {help_text}")
        lines.append(f"# TYPE {family} histogram")
        for labels, k in labelled:
            h: Histogram = getattr(k, f"{name}_seconds")
            lines.extend(
                f'{family}_bucket{{{labels},le="{le}"}} {n}' for le, n in zip(_LE, h.buckets, strict=True)
            )
            lines.append(f"{family}_sum{{{labels}}} {h.sum!r}")
            lines.append(f"{family}_count{{{labels}}} {h.count}")
    return lines


def cluster_metrics(hosts: list[ClusterHost]) -> list[str]:
    """The cluster's hosts, from the workers' heartbeats in the database (the leader's master serves them)."""
    lines = []

    def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, object]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

    tagged = [(f'host="{_escape(h.host)}"', h) for h in hosts]
    family(
        "fastjobs_cluster_workers",
        "gauge",
        "workers registered by host",
        [(t, len(h.workers)) for t, h in tagged],
    )
    family(
        "fastjobs_cluster_workers_stale",
        "gauge",
        f"workers whose last heartbeat is older than {STALE_AFTER:g} s, by host",
        [(t, h.stale) for t, h in tagged],
    )
    family(
        "fastjobs_cluster_heartbeat_age_seconds",
        "gauge",
        "seconds since the freshest heartbeat of the host's workers",
        [(t, f"{h.heartbeat_age:.3f}") for t, h in tagged],
    )
    family(
        "fastjobs_cluster_jobs_per_second",
        "gauge",
        "jobs finished per second by the host's live workers (between their last two heartbeats)",
        [(t, f"{h.rate:.3f}") for t, h in tagged],
    )
    for name in ("completed", "failed", "retried", "discarded"):
        family(
            f"fastjobs_cluster_jobs_{name}_total",
            "counter",
            f"jobs {name} by the host's registered workers (as of their last heartbeats)",
            [(t, h.totals[name]) for t, h in tagged],
        )
    family(
        "fastjobs_cluster_job_outcomes_total",
        "counter",
        "jobs finished by host, queue, kind and outcome (as of the workers' last heartbeats)",
        [
            (f'{t},queue="{_escape(k["queue"])}",kind="{_escape(k["kind"])}",outcome="{outcome}"', k[outcome])
            for t, h in tagged
            for k in h.kinds
            for outcome in OUTCOMES
        ],
    )
    slow, careful = engine_events(hosts)
    by_queue: dict[tuple[str, str], list[int]] = {}
    for e in slow:
        sums = by_queue.setdefault((e.host, e.queue), [0, 0])
        sums[0] += e.slow_jobs
        sums[1] += e.demotions
    queue_tags = [
        (f'host="{_escape(host)}",queue="{_escape(queue)}"', n) for (host, queue), n in by_queue.items()
    ]
    family(
        "fastjobs_cluster_slow_jobs_total",
        "counter",
        "jobs that outran their bound (the guard handed back what their batch held), by host and queue",
        [(t, n[0]) for t, n in queue_tags],
    )
    family(
        "fastjobs_cluster_lane_demotions_total",
        "counter",
        "times a queue left the fast lane for the state lane, by host and queue",
        [(t, n[1]) for t, n in queue_tags],
    )
    family(
        "fastjobs_cluster_workers_careful",
        "gauge",
        "live workers in careful mode (one job per batch after a worker died writing outcomes), by host",
        [(t, sum(c.host == h.host and c.left > 0 for c in careful)) for t, h in tagged],
    )
    return lines


def _health_metrics(health: Health) -> list[str]:
    lines = []

    def gauge(name: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(
            f"{name}{{{labels}}} {float(value)!r}" if labels else f"{name} {float(value)!r}"
            for labels, value in samples
        )

    h = health.horizon
    gauge(
        "fastjobs_mvcc_horizon_age_seconds",
        "how long the oldest open snapshot of this database has held back cleanup (0: none)",
        [("", h.seconds or 0.0 if h is not None else 0.0)],
    )
    gauge(
        "fastjobs_mvcc_horizon_xid_age",
        "transactions since the oldest open snapshot (0: none)",
        [("", float(h.xid_age or 0) if h is not None else 0.0)],
    )
    gauge(
        "fastjobs_notify_queue_usage_ratio",
        "fraction of the NOTIFY queue in use",
        [("", health.notify_queue)],
    )
    tables = [(f'table="{t.table}"', t) for t in health.tables]
    gauge("fastjobs_table_live_rows", "live rows (statistics estimate)", [(k, t.live) for k, t in tables])
    gauge(
        "fastjobs_table_dead_rows", "dead rows not yet vacuumed (estimate)", [(k, t.dead) for k, t in tables]
    )
    gauge(
        "fastjobs_table_bytes",
        "size of the table and of its indexes",
        [(f'{k},part="table"', t.table_bytes) for k, t in tables]
        + [(f'{k},part="indexes"', t.index_bytes) for k, t in tables],
    )
    gauge(
        "fastjobs_table_last_autovacuum_timestamp_seconds",
        "when autovacuum last finished on the table (0: never)",
        [(k, t.last_autovacuum or 0.0) for k, t in tables],
    )
    gauge(
        "fastjobs_table_last_vacuum_timestamp_seconds",
        "when a VACUUM other than autovacuum (the leader's, say) last finished on the table (0: never)",
        [(k, t.last_vacuum or 0.0) for k, t in tables],
    )
    gauge(
        "fastjobs_table_autovacuums", "autovacuum runs on the table", [(k, t.autovacuums) for k, t in tables]
    )
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
