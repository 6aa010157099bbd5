"""The `fastjobs` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import bench, database, schema
from .errors import FastjobsError

DEFAULT_RESULTS = Path("bench") / "results.jsonl"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastjobs", description="PostgreSQL-backed background jobs")
    parser.add_argument("--dsn", help="PostgreSQL URL (default: FASTJOBS_DSN, DATABASE_URL, embedded)")
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="create or upgrade the schema")
    migrate.add_argument("--sql", action="store_true", help="print the migrations' SQL instead of applying it")

    run_bench = commands.add_parser("bench", help="measure fastjobs beside the raw-SQL limit")
    run_bench.add_argument("--jobs", type=int, default=100_000)
    run_bench.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are reported")
    run_bench.add_argument("--enqueue-only", action="store_true", help="measure enqueue_many against COPY")
    run_bench.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON lines file to append to")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "migrate":
            return _migrate(args)
        if args.command == "bench":
            dsn = database.resolve_dsn(args.dsn)
            bench.run_enqueue(dsn, args.jobs, args.repeat, args.results, bench.echo)
            return 0
    except FastjobsError as exc:
        print(f"fastjobs: {exc}", file=sys.stderr)
        return 1
    return 2


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
