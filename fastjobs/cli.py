"""The `fastjobs` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from . import bench, database, schema
from .app import App
from .errors import ConfigurationError, FastjobsError
from .impl import IMPLEMENTATION
from .worker import Worker

DEFAULT_RESULTS = Path("bench") / "results.jsonl"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastjobs", description="PostgreSQL-backed background jobs")
    parser.add_argument("--dsn", help="PostgreSQL URL (default: FASTJOBS_DSN, DATABASE_URL, embedded)")
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="create or upgrade the schema")
    migrate.add_argument(
        "--sql", action="store_true", help="print the migrations' SQL instead of applying it"
    )

    run = commands.add_parser("run", help="run workers for the jobs of MODULE")
    run.add_argument("module", help="module holding a fastjobs.App, or module:attribute")
    run.add_argument("--processes", type=int, default=1, help="worker processes (this version: 1)")
    run.add_argument("--queues", help="comma-separated queues to serve (default: every registered queue)")
    run.add_argument("--batch-max", type=int, default=1000, help="largest batch one claim takes")
    run.add_argument("--keep-completed", action="store_true", help="keep completed jobs instead of deleting")

    run_bench = commands.add_parser("bench", help="measure fastjobs beside the raw-SQL limit")
    run_bench.add_argument("--jobs", type=int, default=100_000)
    run_bench.add_argument("--processes", type=int, default=2, help="worker processes draining")
    run_bench.add_argument("--batch", type=int, default=1000, help="largest batch per claim")
    run_bench.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are reported")
    run_bench.add_argument("--no-overlap", action="store_true", help="strictly sequential claim/run/complete")
    run_bench.add_argument(
        "--keep-completed", action="store_true", help="keep completed rows (retention mode)"
    )
    run_bench.add_argument("--rate", type=float, default=1000.0, help="jobs/s offered in the latency run")
    run_bench.add_argument("--latency-seconds", type=float, default=5.0, help="length of the latency run")
    only = run_bench.add_mutually_exclusive_group()
    only.add_argument("--enqueue-only", action="store_true", help="only enqueue_many against COPY")
    only.add_argument("--drain-only", action="store_true", help="only the drain against the raw-SQL loop")
    only.add_argument("--latency-only", action="store_true", help="only pickup latency at --rate")
    run_bench.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="JSON lines file to append to"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "migrate":
            return _migrate(args)
        if args.command == "run":
            return _run(args)
        if args.command == "bench":
            return _bench(args)
    except FastjobsError as exc:
        print(f"fastjobs: {exc}", file=sys.stderr)
        return 1
    return 2


def load_app(target: str, dsn: str | None = None) -> App:
    """Import `module` or `module:attr` and return its App; a clear error otherwise."""
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
        app._dsn = dsn
    return app


def _run(args: argparse.Namespace) -> int:
    if args.processes != 1:
        raise ConfigurationError("this version runs one worker process: --processes 1")
    app = load_app(args.module, args.dsn)
    queues = [q.strip() for q in args.queues.split(",") if q.strip()] if args.queues else None
    worker = Worker(app, queues, batch_max=args.batch_max, keep_completed=args.keep_completed)
    worker.install_signals()
    print(
        f"fastjobs: worker {worker.worker_id} serving {','.join(worker.queues)} "
        f"({len(app.jobs)} job kinds, {IMPLEMENTATION} implementation)",
        file=sys.stderr,
        flush=True,
    )
    worker.run()
    print("fastjobs: worker stopped", file=sys.stderr, flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn)
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
            not args.no_overlap,
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
        sys.stdout.write(schema.script())
        return 0
    dsn = database.resolve_dsn(args.dsn)
    with database.connect(dsn) as conn:
        applied = schema.migrate(conn)
    where = database.describe(dsn)
    if not applied:
        print(f"fastjobs: schema at {where} is up to date")
    for m in applied:
        print(f"fastjobs: applied {m.version:03d}_{m.name} to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
