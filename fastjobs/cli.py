"""The `fastjobs` command."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import control, database, logs, schema, sql, stats
from .app import App
from .errors import ConfigurationError, FastjobsError
from .impl import FALLBACK, IMPLEMENTATION
from .leader import DEFAULT_LEASE, LeaderConfig, RescuerConfig
from .master import DEFAULT_WORKER_TIMEOUT, Master, parse_queues
from .stats import HORIZON_WARNING
from .types import JobState
from .worker import WorkerConfig

# By name: run as `python -m fastjobs.cli`, __name__ is "__main__", outside the "fastjobs" logger.
logger = logging.getLogger("fastjobs.cli")

DEFAULT_RESULTS = Path("bench") / "results.jsonl"

_INT64 = (-(1 << 63), (1 << 63) - 1)


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a bad value exits 2 before anything starts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _int64(text: str) -> int:
    """An argparse type: an integer PostgreSQL's bigint holds (an advisory lock key)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not _INT64[0] <= value <= _INT64[1]:
        raise argparse.ArgumentTypeError(
            f"must be between {_INT64[0]} and {_INT64[1]} (a bigint), not {value}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    worker = WorkerConfig()  # the defaults of the workers' settings
    parser = argparse.ArgumentParser(prog="fastjobs", description="PostgreSQL-backed background jobs")
    parser.add_argument(
        "--dsn",
        help="PostgreSQL URL, or 'embedded' (default: FASTJOBS_DSN, DATABASE_URL; migrate, stats, jobs"
        " and bench fall back on the embedded PostgreSQL, warning)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        default="INFO",
        help="the least severe messages shown on stderr (default %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="stderr messages as text lines or one JSON object per line (default %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="create or upgrade the schema")
    migrate.add_argument(
        "--sql", action="store_true", help="print the migrations' SQL instead of applying it"
    )
    migrate.add_argument(
        "--since", type=int, default=0, metavar="VERSION", help="with --sql: only migrations after VERSION"
    )
    migrate.add_argument(
        "--lock-timeout",
        type=float,
        default=schema.LOCK_TIMEOUT,
        metavar="SECONDS",
        help="how long a step waits for its locks (enqueues queue behind it meanwhile) before it gives"
        " way and retries (default %(default)g)",
    )
    migrate.add_argument(
        "--lock-retries",
        type=int,
        default=schema.LOCK_RETRIES,
        metavar="N",
        help="attempts of a step before giving up (default %(default)d, with backoff up to 10 s)",
    )

    run = commands.add_parser("run", help="run workers for the jobs of MODULE")
    run.add_argument("module", help="module holding a fastjobs.App, or module:attribute")
    run.add_argument("--processes", type=int, default=1, help="worker processes (besides master and leader)")
    run.add_argument(
        "--queues",
        help="queues and their concurrency, e.g. default:8,emails:2 (default: every registered queue,"
        " concurrency 10 per process)",
    )
    run.add_argument(
        "--grace",
        type=float,
        default=worker.grace,
        help="seconds to finish in-flight jobs on stop (default %(default)g)",
    )
    run.add_argument(
        "--worker-timeout",
        type=float,
        help="kill a worker or leader whose process sent no heartbeat this long: hung holding the GIL,"
        " or stopped (it beats every second, whatever length of job it runs;"
        f" default {DEFAULT_WORKER_TIMEOUT:g}, at least 2)",
    )
    run.add_argument("--metrics-port", type=int, help="serve Prometheus text on this port")
    run.add_argument(
        "--leader-key",
        type=_int64,
        default=sql.LEADER_LOCK_KEY,
        help="advisory lock key of the leader election (pick one your application does not use)",
    )
    run.add_argument(
        "--leader-lease",
        type=float,
        default=DEFAULT_LEASE,
        help="seconds a leader whose session fell silent (process stopped, host cut off) keeps the lock"
        " before another takes over (default %(default)g, at least 3)",
    )
    run.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    run.add_argument(
        "--batch-max",
        type=_positive_int,
        default=worker.batch_max,
        help="largest batch one claim takes (default %(default)d)",
    )
    run.add_argument("--keep-completed", action="store_true", help="keep completed jobs instead of deleting")
    run.add_argument(
        "--rescue-after",
        type=float,
        default=RescuerConfig().stale_after,
        metavar="SECONDS",
        help="rescue the running jobs of a worker silent this long (heartbeats every 2 s; at least 5)",
    )

    jobs = commands.add_parser("jobs", help="inspect and control single jobs")
    jobs_commands = jobs.add_subparsers(dest="jobs_command", required=True)
    listing = jobs_commands.add_parser("list", help="jobs, newest first")
    listing.add_argument("--queue")
    listing.add_argument("--state", choices=[s.value for s in JobState])
    listing.add_argument("--kind")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true")
    for name, help_text in (
        ("show", "one job: args, attempts, error history"),
        ("retry", "a discarded, cancelled or completed job back to available"),
        ("cancel", "cancel a queued job, or ask a running one to stop"),
        ("discard", "discard a job that is not running"),
    ):
        command = jobs_commands.add_parser(name, help=help_text)
        command.add_argument("id", type=int)
        command.add_argument("--json", action="store_true")

    stats = commands.add_parser("stats", help="queue depths, and live rates of masters on this host")
    stats.add_argument("--json", action="store_true", help="one JSON document for machines")
    stats.add_argument(
        "--all-masters",
        action="store_true",
        help="list the live masters of every database on this host, not only of this one",
    )
    stats.add_argument(
        "--horizon-warning",
        type=float,
        default=HORIZON_WARNING,
        metavar="SECONDS",
        help="warn when one transaction has held back cleanup this long (default %(default)g)",
    )

    run_bench = commands.add_parser("bench", help="measure fastjobs beside the raw-SQL limit")
    run_bench.add_argument("--jobs", type=int, default=100_000)
    run_bench.add_argument("--processes", type=int, default=2, help="worker processes draining")
    run_bench.add_argument(
        "--batch", type=_positive_int, default=worker.batch_max, help="largest batch per claim"
    )
    run_bench.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are reported")
    run_bench.add_argument(
        "--compare-sync",
        action="store_true",
        help="drain: also a strictly sequential claim/run/complete loop",
    )
    run_bench.add_argument(
        "--keep-completed", action="store_true", help="keep completed rows (retention mode)"
    )
    run_bench.add_argument("--rate", type=float, default=1000.0, help="jobs/s offered in the latency run")
    run_bench.add_argument("--latency-seconds", type=float, default=5.0, help="length of the latency run")
    only = run_bench.add_mutually_exclusive_group()
    only.add_argument("--enqueue-only", action="store_true", help="only enqueue_many against COPY")
    only.add_argument("--drain-only", action="store_true", help="only the drain against the raw-SQL loop")
    only.add_argument("--latency-only", action="store_true", help="only pickup latency at --rate")
    only.add_argument(
        "--cleaner",
        type=int,
        metavar="ROWS",
        help="only: seed ROWS finished jobs, drain without and beside the cleaner",
    )
    only.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="only: enqueue and drain at a steady rate for MINUTES, then again with a transaction held"
        " open in the middle; samples every 10 s",
    )
    only.add_argument(
        "--producers",
        type=_positive_int,
        metavar="N",
        help="only: N producers each enqueueing one job per transaction (app.enqueue), beside raw"
        " INSERTs with and without the jobs table's trigger",
    )
    run_bench.add_argument(
        "--producer-seconds", type=float, default=4.0, help="with --producers: length of each run"
    )
    run_bench.add_argument(
        "--producer-threads",
        action="store_true",
        help="with --producers: threads of one process instead of processes",
    )
    run_bench.add_argument(
        "--soak-rate",
        type=float,
        help="with --soak: jobs/s offered (default: 80%% of the end-to-end maximum measured first)",
    )
    run_bench.add_argument(
        "--hold",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --soak: the held transaction's length",
    )
    run_bench.add_argument(
        "--plot", type=Path, default=Path("bench") / "soak.png", help="with --soak: where the PNG plot goes"
    )
    run_bench.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="JSON lines file to append to"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with logs.configured(args.log_level, args.log_format):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    if FALLBACK:
        logger.warning(FALLBACK)
    try:
        if args.command == "migrate":
            return _migrate(args)
        if args.command == "run":
            return _run(args)
        if args.command == "stats":
            return _stats(args)
        if args.command == "jobs":
            return _jobs(args)
        if args.command == "bench":
            return _bench(args)
    except (FastjobsError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    return 2


def load_app(target: str, dsn: str | None = None) -> App:
    """Import `module` or `module:attr` and return its App; a clear error otherwise.

    With `dsn` (`fastjobs --dsn`), the App is pointed at that database
    (`App.configure`), whatever its own DSN.
    """
    module_name, _, attr = target.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if attr:
        app = getattr(module, attr, None)
        if not isinstance(app, App):
            raise ConfigurationError(f"{target!r} is not a fastjobs.App")
    else:
        apps = [v for v in vars(module).values() if isinstance(v, App)]
        if len(apps) != 1:
            raise ConfigurationError(
                f"module {module_name!r} holds {len(apps)} fastjobs.App instances;"
                f" name one as {module_name}:attribute"
            )
        app = apps[0]
    if dsn:
        app.configure(dsn=dsn)
    return app


def _run(args: argparse.Namespace) -> int:
    # The settings are checked before the application is imported.
    worker = WorkerConfig(batch_max=args.batch_max, keep_completed=args.keep_completed, grace=args.grace)
    leader = LeaderConfig(
        lock_key=args.leader_key, rescuer=RescuerConfig.after(args.rescue_after), lease=args.leader_lease
    )
    app = load_app(args.module, args.dsn)
    registered = sorted({spec.queue for spec in app.jobs.values()})
    queues = parse_queues(args.queues, registered, args.processes)
    metrics = (args.metrics_host, args.metrics_port) if args.metrics_port is not None else None
    master = Master(
        app,
        args.processes,
        queues,
        worker=worker,
        leader=leader,
        worker_timeout=args.worker_timeout,
        metrics=metrics,
    )
    code = master.run()
    logger.info("stopped")
    return code


def _jobs(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn)
        command = args.jobs_command
        if command == "list":
            rows = control.list_jobs(
                conn, queue=args.queue, state=args.state, kind=args.kind, limit=args.limit
            )
            if args.json:
                _echo(json.dumps(rows, default=str, indent=2))
                return 0
            _echo(f"{'id':>10}  {'queue':<16}{'kind':<32}{'state':<11}{'attempt':>8}  run_at")
            for r in rows:
                _echo(
                    f"{r['id']:>10}  {_safe(r['queue']):<16}{_safe(r['kind']):<32}{r['state']:<11}"
                    f"{r['attempt']:>4}/{r['max_attempts']:<3}  {_when(r['run_at'])}"
                )
            return 0
        if command == "show":
            job = control.show(conn, args.id)
            if args.json:
                _echo(json.dumps(job, default=str, indent=2))
                return 0
            for key, value in job.items():
                if key in ("errors", "args", "meta"):
                    continue
                _echo(f"{key:>16}: {_safe(str(value))}")
            _echo(f"{'args':>16}: {_safe(json.dumps(job['args'], ensure_ascii=False))}")
            for error in job["errors"] or []:
                head = f"attempt {error.get('attempt')} at {error.get('at')}: {error.get('error')}"
                _echo(f"\n--- {_safe(head)}")
                if error.get("traceback"):
                    _echo(_safe(str(error["traceback"]).rstrip(), lines=True))
            return 0
        action = {"retry": control.retry, "cancel": control.cancel, "discard": control.discard}[command]
        state = action(conn, args.id)
        if args.json:
            _echo(json.dumps({"id": args.id, "state": state}))
        else:
            _echo(f"job {args.id}: {state}")
        return 0


# Job input (args, error messages, kinds) must not drive the operator's
# terminal: C0 and C1 controls, ESC and DEL among them, print as \xNN.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS_BUT_NEWLINES = {c: text for c, text in _CONTROLS.items() if c not in (0x09, 0x0A)}


def _echo(text: str) -> None:
    """A line of the command's output (stdout): what it was asked for, unlike its log on stderr."""
    sys.stdout.write(f"{text}\n")


def _safe(text: str, lines: bool = False) -> str:
    """`text` with control characters escaped; with `lines`, newlines and tabs kept."""
    return text.translate(_CONTROLS_BUT_NEWLINES if lines else _CONTROLS)


def _when(at: dt.datetime | str) -> str:
    """A run_at for humans; control gives what a datetime cannot hold (infinity, BC) as text."""
    return f"{at:%Y-%m-%d %H:%M:%S}" if isinstance(at, dt.datetime) else at


def _stats(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn)
        depths = stats.queue_depths(conn)
        health = stats.health(conn)
        identity = stats.database_identity(conn, dsn)
    warnings = health.warnings(args.horizon_warning)
    found, skipped = stats.live_masters(None if args.all_masters else identity)
    for skip in skipped:
        removed = " (removed)" if skip.stale and skip.ours else ""
        logger.warning("skipped %s: %s%s", skip.path, skip.reason, removed)
    masters: list[dict[str, Any]] = [
        {"master_pid": m.master_pid, "database": m.database, "file": str(m.path), "processes": m.processes}
        for m in found
    ]
    if args.json:
        doc = {
            "queues": [dataclasses.asdict(d) for d in depths],
            "masters": masters,
            "health": dataclasses.asdict(health),
            "warnings": warnings,
        }
        _echo(json.dumps(doc, indent=2))
        return 0
    _echo(f"{'queue':<24}{'state':<12}{'jobs':>10}{'oldest':>12}")
    for d in depths:
        oldest = "" if d.oldest_seconds is None else f"{d.oldest_seconds:,.1f}s"
        _echo(f"{d.queue:<24}{d.state:<12}{d.count:>10,}{oldest:>12}")
    if not depths:
        _echo("(no jobs)")
    now = time.time()
    for m in masters:
        elsewhere = "" if m["database"] == identity else f", database {m['database']}"
        _echo(f"\nmaster pid {m['master_pid']} on this host{elsewhere}")
        _echo(
            f"{'process':<12}{'pid':>8}{'jobs/s':>10}{'completed':>12}{'failed':>9}{'retried':>9}{'discarded':>10}"
            f"{'beat':>8}  listener"
        )
        for p in m["processes"]:
            name = f"{stats.ROLES.get(int(p['role']), '?')} {int(p['index']) + 1}"
            _echo(
                f"{name:<12}{int(p['pid']):>8}{p['rate']:>10,.0f}{int(p['completed']):>12,}{int(p['failed']):>9,}"
                f"{int(p['retried']):>9,}{int(p['discarded']):>10,}{now - p['heartbeat']:>7.1f}s"
                f"  {_listener(p, now)}"
            )
    _print_health(health, now)
    for line in warnings:
        _echo(f"\n{line}")
    return 0


def _listener(p: dict[str, float], now: float) -> str:
    if p["role"] != stats.WORKER:
        return ""
    state = f"up, ping ok {now - p['listener_ok']:.0f}s ago" if p["listening"] else "DOWN (polling)"
    return f"{state}, {int(p['listener_reconnects'])} reconnects"


def _print_health(health: stats.Health, now: float) -> None:
    _echo("\nMVCC health")
    h = health.horizon
    if h is None:
        _echo("oldest snapshot: none open")
    else:
        held = "" if h.seconds is None else f" open {h.seconds:,.1f}s,"
        _echo(f"oldest snapshot: {h.source} {h.ident},{held} {h.xid_age or 0:,} xids old ({h.detail})")
    _echo(f"NOTIFY queue: {health.notify_queue:.1%} used")
    _echo(f"{'table':<22}{'live':>12}{'dead':>12}{'table':>10}{'indexes':>10}  last vacuum")
    for t in health.tables:
        last = max((v for v in (t.last_vacuum, t.last_autovacuum) if v is not None), default=None)
        vacuumed = "never" if last is None else f"{now - last:,.0f}s ago"
        _echo(
            f"{t.table:<22}{t.live:>12,}{t.dead:>12,}{_size(t.table_bytes):>10}{_size(t.index_bytes):>10}"
            f"  {vacuumed} ({t.autovacuums:,} autovacuums)"
        )


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("kB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            break
    return f"{size:,.1f} {unit}"


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark (a subpackage of its own) is no cost to any other command.
    from . import bench
    from .bench import soak

    dsn = database.resolve_dsn(args.dsn, fallback=True)
    if args.soak:
        soak.run_soak(
            dsn,
            args.soak,
            args.soak_rate,
            args.processes,
            args.batch,
            args.hold,
            args.results,
            args.plot,
            bench.echo,
        )
        return 0
    if args.producers:
        from .bench import producers

        producers.run_producers(
            dsn,
            args.producers,
            args.producer_seconds,
            args.repeat,
            args.producer_threads,
            args.results,
            bench.echo,
        )
        return 0
    if args.cleaner:
        bench.run_cleaner(dsn, args.cleaner, args.jobs, args.processes, args.batch, args.results, bench.echo)
        return 0
    every = not (args.enqueue_only or args.drain_only or args.latency_only)
    echo = bench.echo
    echo(
        f"fastjobs bench: {args.jobs:,} jobs, {args.processes} processes, batch {args.batch}, "
        f"{IMPLEMENTATION} implementation, medians of {args.repeat}\n"
    )
    if every or args.enqueue_only:
        bench.run_enqueue(dsn, args.jobs, args.repeat, args.results, echo)
    if every or args.drain_only:
        bench.run_drain(
            dsn,
            args.jobs,
            args.processes,
            args.batch,
            args.repeat,
            args.compare_sync,
            args.keep_completed,
            args.results,
            echo,
        )
    if every or args.latency_only:
        bench.run_latency(
            dsn, args.rate, args.latency_seconds, args.processes, args.batch, args.results, echo
        )
    return 0


def _migrate(args: argparse.Namespace) -> int:
    if args.sql:
        sys.stdout.write(schema.script(args.since, args.lock_timeout))
        return 0
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    with database.connect(dsn, application_name=schema.APPLICATION) as conn:
        applied = schema.migrate(conn, dsn=dsn, lock_timeout=args.lock_timeout, retries=args.lock_retries)
    where = database.describe(dsn)
    if not applied:
        _echo(f"fastjobs: schema at {where} is up to date")
    for m in applied:
        _echo(f"fastjobs: applied {m.version:03d}_{m.name} to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
