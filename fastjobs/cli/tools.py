"""`fastjobs migrate`, `fastjobs sql show` and `fastjobs bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import database, logs, schema, sql
from ..impl import IMPLEMENTATION
from .jobs import did_you_mean
from .table import echo

__all__ = ["bench_command", "migrate_command", "sql_show_command"]

logger = logging.getLogger("fastjobs.cli")


def bench_command(args: argparse.Namespace) -> int:
    # Imported here: the benchmark (a subpackage of its own) is no cost to any other command.
    from .. import bench
    from ..bench import soak

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
        from ..bench import producers

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
        f"fastjobs bench: {logs.plural(args.jobs, 'job')},"
        f" {logs.plural(args.processes, 'process', 'processes')}, batch {args.batch},"
        f" {IMPLEMENTATION} implementation, medians of {logs.plural(args.repeat, 'run')}\n"
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
            middleware=args.middleware,
            compare_lanes=args.compare_lanes,
        )
    if every or args.latency_only:
        bench.run_latency(
            dsn,
            args.rate,
            args.latency_seconds,
            args.processes,
            args.batch,
            args.results,
            echo,
            write=args.latency_write,
        )
    return 0


def sql_show_command(name: str | None, schema_name: str | None = None) -> int:
    """Statement `name` as it is sent (its text, the leading newline of its literal aside; the three
    that name a table or an index, `{partition}` or `{index}`, have it filled in by psycopg.sql);
    without a name, the names by section of fastjobs.sql (a family's members are one). No database.
    With `schema_name` (--schema), as that schema's catalogue sends it."""
    if name is None:
        for title, names in sql.SECTIONS.items():
            echo(title)
            for statement in names:
                echo(f"  {statement}")
        return 0
    text = sql.of(schema_name).STATEMENTS.get(name)
    if text is None:
        hint = did_you_mean(name, sql.STATEMENTS) or "; `fastjobs sql show` lists them"
        raise ValueError(f"no statement named {name!r}{hint}")
    echo(text.lstrip("\n"))
    return 0


def migrate_command(args: argparse.Namespace) -> int:
    named = database.resolve_schema(args.schema)
    if args.sql:
        sys.stdout.write(schema.script(args.since, args.lock_timeout, named))
        return 0
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    with database.connect(dsn, application_name=schema.APPLICATION) as conn:
        applied = schema.migrate(
            conn, dsn=dsn, lock_timeout=args.lock_timeout, retries=args.lock_retries, schema=named
        )
    where = database.describe(dsn) + ("" if named is None else f", schema {named}")
    if not applied:
        echo(f"fastjobs: schema at {where} is up to date")
    for m in applied:
        echo(f"fastjobs: applied {m.version:03d}_{m.name} to {where}")
    return 0
