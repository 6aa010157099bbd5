"""`fastjobs stats`: this host's processes, the cluster, queue depths, per-kind counts and MVCC health."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import control, database, keys, logs, queues, report, schema, scoreboard, sql, stats
from ..abc import OUTCOMES
from .table import Column, echo, safe, size, table, when

__all__ = ["stats_command"]

logger = logging.getLogger("fastjobs.cli")

_QUEUE_COLUMNS: list[Column[report.QueueDepth]] = [
    Column("queue", lambda d: safe(d.queue)),
    Column("state", lambda d: d.state),
    Column("jobs", lambda d: f"{d.count:,}", ">"),
    Column("oldest", lambda d: "" if d.oldest_seconds is None else f"{d.oldest_seconds:,.1f}s", ">"),
]


def _process_columns(now: float) -> list[Column[dict[str, Any]]]:
    """The columns of a master's processes (a card's fields, as `_process_json` gives them)."""
    return [
        Column("process", lambda p: f"{stats.ROLES.get(p['role'], '?')} {p['index'] + 1}"),
        Column("pid", lambda p: str(p["pid"]), ">"),
        Column("jobs/s", lambda p: f"{p['rate']:,.0f}", ">"),
        Column("completed", lambda p: f"{p['completed']:,}", ">"),
        Column("failed", lambda p: f"{p['failed']:,}", ">"),
        Column("retried", lambda p: f"{p['retried']:,}", ">"),
        Column("discarded", lambda p: f"{p['discarded']:,}", ">"),
        Column("beat", lambda p: f"{now - p['heartbeat']:.1f}s", ">"),
        Column("listener", lambda p: _listener(p, now)),
    ]


def _table_columns(now: float) -> list[Column[report.TableHealth]]:
    def vacuumed(t: report.TableHealth) -> str:
        last = max((v for v in (t.last_vacuum, t.last_autovacuum) if v is not None), default=None)
        when = "never" if last is None else f"{now - last:,.0f}s ago"
        return f"{when} ({t.autovacuums:,} autovacuums)"

    return [
        Column("table", lambda t: t.table),
        Column("live", lambda t: f"{t.live:,}", ">"),
        Column("dead", lambda t: f"{t.dead:,}", ">"),
        Column("table", lambda t: size(t.table_bytes), ">"),
        Column("indexes", lambda t: size(t.index_bytes), ">"),
        Column("last vacuum", vacuumed),
    ]


def _process_json(p: dict[str, float]) -> dict[str, Any]:
    """A card's fields for people and machines: counts and pids as integers, times as floats."""
    return {name: int(value) if name in stats.INTEGER_FIELDS else value for name, value in p.items()}


def stats_command(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    statements = sql.of(database.resolve_schema(args.schema))
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn, statements)
        depths = report.queue_depths(conn, statements)
        steered = queues.states(conn, statements)
        keyed = keys.usage(conn, statements)
        health = report.health(conn, statements)
        identity = scoreboard.database_identity(conn, dsn, statements)
        hosts = report.cluster(conn, sql=statements)
        slow, careful = report.engine_events(hosts)
        unhandled = report.unhandled_kinds(control.kinds(conn, statements), hosts)
    warnings = health.warnings(args.horizon_warning) + [u.warning() for u in unhandled]
    found, skipped = scoreboard.live_masters(None if args.all_masters else identity)
    for skip in skipped:
        removed = " (removed)" if skip.stale and skip.ours else ""
        logger.warning("skipped %s: %s%s", skip.path, skip.reason, removed)
    # This database's masters first; others only with --all-masters, marked as such.
    found.sort(key=lambda m: m.database != identity)
    masters: list[dict[str, Any]] = [
        {
            "master_pid": m.master_pid,
            "database": m.database,
            "this_database": m.database == identity,
            "file": str(m.path),
            "processes": [_process_json(p) for p in m.processes],
            "kinds": [dataclasses.asdict(k) for k in m.kinds],
        }
        for m in found
    ]
    warnings += report.upkeep_warnings(p for m in found if m.database == identity for p in m.processes)
    if args.json:
        doc = {
            "database": identity,
            "queues": [dataclasses.asdict(d) for d in depths],
            "paused_queues": {q.name: q.paused_at.isoformat() for q in steered if q.paused_at},
            "queue_limits": [dataclasses.asdict(q) for q in steered if q.max_backlog is not None],
            "keys": [dataclasses.asdict(k) for k in keyed],
            "masters": masters,
            "health": dataclasses.asdict(health),
            "warnings": warnings,
            "cluster": [dataclasses.asdict(h) for h in hosts],
            "unhandled_kinds": [dataclasses.asdict(u) for u in unhandled],
            "slow_jobs": [dataclasses.asdict(e) for e in slow],
            "careful_workers": [dataclasses.asdict(c) for c in careful],
        }
        echo(json.dumps(doc, indent=2))
        return 0
    if depths:
        table(_QUEUE_COLUMNS, depths)
    else:
        echo("(no jobs)")
    for q in steered:
        if q.paused_at:
            echo(
                safe(
                    f"paused: queue {q.name!r} since {when(q.paused_at)} (`fastjobs queues resume {q.name}`)"
                )
            )
        if q.concurrency is not None:
            echo(safe(f"concurrency: queue {q.name!r} runs at most {q.concurrency:,} jobs at once"))
        if q.rate_limit is not None:
            echo(safe(f"rate limit: queue {q.name!r} starts at most {q.rate_limit} jobs"))
        if q.max_backlog is not None:
            if q.backlog is None:
                counted = "not counted yet"
            elif q.backlog >= q.max_backlog:  # counted up to the limit
                counted = f"at least {q.backlog:,} waiting: FULL, enqueues held back"
            else:
                counted = f"{q.backlog:,} waiting"
            held = f"{q.held_back:,} held back so far"
            line = f"max_backlog: queue {q.name!r} {q.max_backlog:,} ({counted}; {held})"
            echo(safe(line))
    for k in keyed:
        echo(safe(_key_line(k)))
    now = time.time()
    for m in masters:
        other = "" if m["this_database"] else f" (ANOTHER DATABASE: {safe(m['database'])})"
        echo(f"\nmaster pid {m['master_pid']} on this host{other}")
        table(_process_columns(now), m["processes"])
        _print_kinds(m["kinds"])
    _print_cluster(hosts)
    _print_events(slow, careful)
    _print_health(health, now)
    for line in warnings:
        echo(f"\n{safe(line)}")
    return 0


def _key_line(k: keys.KeyUsage) -> str:
    """A kind limited per key: its keys running, at their limit, and the one waiting longest."""
    line = (
        f"keys: kind {k.kind!r} runs {k.running:,} jobs of {k.keys_running:,} keys,"
        f" {k.keys_at_limit:,} at their concurrency limit"
    )
    if k.longest_waiting_key is not None and k.longest_waiting_seconds is not None:
        line += f"; longest waiting: key {k.longest_waiting_key!r}, due {k.longest_waiting_seconds:,.1f}s"
    return line


def _mean(histogram: dict[str, Any]) -> str:
    if not histogram["count"]:
        return "-"
    value = histogram["sum"] / histogram["count"]
    return f"{value * 1000:.2f}ms" if value < 1 else f"{value:.1f}s"


def _outcome_cell(outcome: str) -> Callable[[dict[str, Any]], str]:
    return lambda k: f"{k['outcomes'][outcome]:,}"


_KIND_COLUMNS: list[Column[dict[str, Any]]] = [
    Column("queue", lambda k: safe(k["queue"])),
    Column("kind", lambda k: safe(k["kind"])),
    *(Column(o, _outcome_cell(o), ">") for o in OUTCOMES),
    Column("run", lambda k: _mean(k["run_seconds"]), ">"),
    Column("pickup", lambda k: _mean(k["pickup_seconds"]), ">"),
]
_HOST_COLUMNS: list[Column[report.ClusterHost]] = [
    Column("host", lambda h: safe(h.host)),
    Column("workers", lambda h: str(len(h.workers)), ">"),
    Column("stale", lambda h: str(h.stale), ">"),
    Column("jobs/s", lambda h: f"{h.rate:,.0f}", ">"),
    Column("completed", lambda h: f"{h.totals['completed']:,}", ">"),
    Column("failed", lambda h: f"{h.totals['failed']:,}", ">"),
    Column("beat", lambda h: f"{h.heartbeat_age:.1f}s", ">"),
    Column("queues", lambda h: safe(",".join(h.queues))),
]
_CLUSTER_WORKER_COLUMNS: list[Column[report.ClusterWorker]] = [
    Column("worker", lambda w: safe(w.id)),
    Column("pid", lambda w: str(w.pid), ">"),
    Column("jobs/s", lambda w: f"{w.rate:,.0f}", ">"),
    Column("beat", lambda w: f"{w.heartbeat_age:.1f}s", ">"),
    Column("queues", lambda w: safe(",".join(w.queues))),
    Column("", lambda w: "STALE" if w.stale else ""),
]


def _print_kinds(kinds: list[dict[str, Any]]) -> None:
    """A master's counts per (queue, kind), with the mean run time and pickup latency."""
    if kinds:
        table(_KIND_COLUMNS, kinds)


def _print_cluster(hosts: list[report.ClusterHost]) -> None:
    """Every host's workers against this database, from their heartbeats (stale ones flagged)."""
    echo(f"\ncluster: {logs.plural(len(hosts), 'host')} with workers registered in this database")
    if not hosts:
        return
    table(_HOST_COLUMNS, hosts)
    for h in hosts:
        echo(f"\n  workers of {safe(h.host)}")
        table(_CLUSTER_WORKER_COLUMNS, h.workers, indent="  ")


_SLOW_COLUMNS: list[Column[report.SlowEvents]] = [
    Column("queue", lambda e: safe(e.queue)),
    Column("slow jobs", lambda e: f"{e.slow_jobs:,}", ">"),
    Column("demotions", lambda e: f"{e.demotions:,}", ">"),
    Column("last", lambda e: f"{logs.duration(e.last_age)} ago", ">"),
    Column(
        "state lane", lambda e: f"{logs.duration(e.state_lane_left)} more" if e.state_lane_left else "-", ">"
    ),
    Column("worker", lambda e: safe(e.worker)),
    Column("host", lambda e: safe(e.host)),
]


def _print_events(slow: list[report.SlowEvents], careful: list[report.CarefulWorker]) -> None:
    """The engine's events the live workers' heartbeats carry: slow jobs and demotions, careful mode."""
    if slow:
        echo("\nslow jobs (handed back by the guard) and demotions to the state lane, per live worker")
        table(_SLOW_COLUMNS, slow)
    for c in careful:
        left = f"{logs.duration(c.left)} left" if c.left else "over"
        line = f"careful mode: worker {c.worker} on {c.host} began {logs.duration(c.age)} ago ({left}):"
        echo(
            "\n"
            + safe(f"{line} its predecessor died writing several failed jobs' outcomes; one job per batch")
        )


def _listener(p: dict[str, Any], now: float) -> str:
    if p["role"] != stats.WORKER:
        return ""
    state = f"up, ping ok {now - p['listener_ok']:.0f}s ago" if p["listening"] else "DOWN (polling)"
    return f"{state}, {p['listener_reconnects']} reconnects"


def _print_health(health: report.Health, now: float) -> None:
    echo("\nMVCC health")
    h = health.horizon
    if h is None:
        echo("oldest snapshot: none open")
    else:
        held = "" if h.seconds is None else f" open {h.seconds:,.1f}s,"
        who = safe(f"{h.source} {h.ident}")
        echo(f"oldest snapshot: {who},{held} {h.xid_age or 0:,} xids old ({safe(h.detail)})")
    echo(f"NOTIFY queue: {health.notify_queue:.1%} used")
    table(_table_columns(now), health.tables)
