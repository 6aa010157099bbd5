"""The `fastjobs` command line: its parser, and `main`, which hands each command to its module."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import database, logs, queues, schema
from ..children import EXIT_BOOT_ERROR
from ..errors import ConfigurationError, DatabaseUnavailable, FastjobsError, SchemaMissing
from ..impl import FALLBACK
from ..leader import DEFAULT_LEASE
from ..maintenance import RescuerConfig
from ..master import DEFAULT_WORKER_TIMEOUT
from ..report import HORIZON_WARNING
from ..types import JobState
from ..worker import WorkerConfig
from .jobs import ACTS_ON, jobs_command, periodic_command
from .queues import backlog, queues_command, rate
from .run import run_command
from .stats import stats_command
from .tools import bench_command, migrate_command, sql_show_command
from .web import add_web_arguments, web_command

__all__ = ["add_log_arguments", "add_run_arguments", "guarded", "main"]

# By name: run as `python -m fastjobs.cli`, __name__ is "__main__", outside the "fastjobs" logger.
logger = logging.getLogger("fastjobs.cli")

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


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _age(text: str) -> dt.timedelta:
    """An argparse type: an age such as 90s, 15m, 2h, 7d or 1w (a bare number is seconds)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _AGE_UNITS else (text, "s")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age such as 90s, 15m, 2h, 7d or 1w") from None
    if not 0 <= value < 1e7:
        raise argparse.ArgumentTypeError(f"{text!r}: an age is a positive number")
    return dt.timedelta(seconds=value * _AGE_UNITS[unit])


def _parser() -> argparse.ArgumentParser:
    worker = WorkerConfig()  # the defaults of the workers' settings
    parser = argparse.ArgumentParser(prog="fastjobs", description="PostgreSQL-backed background jobs")
    parser.add_argument(
        "--dsn",
        help="PostgreSQL URL, or 'embedded' (default: FASTJOBS_DSN, DATABASE_URL; migrate, stats, jobs"
        " and bench fall back on the embedded PostgreSQL, warning)",
    )
    parser.add_argument("--schema", help=_SCHEMA_HELP)
    add_log_arguments(parser)
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
    add_run_arguments(run)

    jobs = commands.add_parser("jobs", help="inspect and control single jobs")
    jobs_commands = jobs.add_subparsers(dest="jobs_command", required=True)
    listing = jobs_commands.add_parser("list", help="jobs, newest first")
    listing.add_argument("--queue")
    listing.add_argument("--state", choices=[s.value for s in JobState])
    listing.add_argument("--kind", help="the kind, whole: module.function unless @app.job(kind=...)")
    listing.add_argument(
        "--limit", type=_positive_int, default=50, help="at most this many, newest first (default 50)"
    )
    listing.add_argument("--json", action="store_true")
    show = jobs_commands.add_parser("show", help="one job: args, attempts, error history, kept result")
    show.add_argument("id", type=int)
    show.add_argument("--json", action="store_true")
    for name, help_text in (
        (
            "retry",
            "run jobs now: retryable or scheduled ones as they are, discarded, cancelled or completed"
            " ones with one more attempt",
        ),
        ("cancel", "cancel queued jobs, or ask running ones to stop"),
        ("discard", "discard jobs that are not running"),
    ):
        command = jobs_commands.add_parser(name, help=help_text)
        command.add_argument("id", type=int, nargs="*", help="job ids; or select jobs with the filters")
        command.add_argument(
            "--state",
            choices=sorted(ACTS_ON[name]),
            help=f"with the filters: jobs in this state (default: every state {name} acts on)",
        )
        command.add_argument("--queue", help="with the filters: jobs of this queue")
        command.add_argument("--kind", help="with the filters: jobs of this kind, whole")
        command.add_argument(
            "--older-than",
            type=_age,
            metavar="AGE",
            help="with the filters: jobs created more than AGE ago (90s, 15m, 2h, 7d)",
        )
        command.add_argument(
            "--yes", action="store_true", help="with the filters: no confirmation prompt (for scripts)"
        )
        command.add_argument("--json", action="store_true", help="one JSON object per job and line")

    queues_parser = commands.add_parser("queues", help="list queues; pause and resume one")
    queues_commands = queues_parser.add_subparsers(dest="queues_command", required=True)
    queues_commands.add_parser("list", help="queues, paused or not, with their jobs").add_argument(
        "--json", action="store_true"
    )
    for name, help_text in (
        ("pause", "stop every worker taking the queue's jobs (those started finish); enqueues go on"),
        ("resume", "let workers take the queue's jobs again, waking them"),
    ):
        command = queues_commands.add_parser(name, help=help_text)
        command.add_argument("name", help="the queue")
        command.add_argument("--json", action="store_true")
    limit = queues_commands.add_parser(
        "limit", help="limit the queue's jobs running at once, or hold producers back past a backlog"
    )
    limit.add_argument("name", help="the queue")
    _limit_arguments(limit, "its jobs", "200/s, 1000/min, 50/h", "no limit")
    limit.add_argument(
        "--max-backlog",
        type=backlog,
        default=queues.UNCHANGED,
        metavar="N",
        help="jobs waiting past which enqueues are held back (none: no limit)",
    )
    limit.add_argument("--json", action="store_true")
    limit_key = queues_commands.add_parser(
        "key", help="set a kind's limits for one key (tenant) in place of those its jobs declared"
    )
    limit_key.add_argument("kind", help="the job kind")
    limit_key.add_argument("key", help="the key's value as its jobs carry it ('': the kind as a whole)")
    _limit_arguments(limit_key, "its jobs with that key", "10/s, 600/min", "as declared")
    limit_key.add_argument("--json", action="store_true")
    queues_commands.add_parser(
        "keys", help="the limits set per kind and key, with their jobs running"
    ).add_argument("--json", action="store_true")

    periodic = commands.add_parser("periodic", help="the periodic (cron) jobs of MODULE")
    periodic_commands = periodic.add_subparsers(dest="periodic_command", required=True)
    periodic_list = periodic_commands.add_parser("list", help="schedules, last and next ticks")
    periodic_list.add_argument("module", help="module holding a fastjobs.App, or module:attribute")
    periodic_list.add_argument("--json", action="store_true")
    periodic_run = periodic_commands.add_parser(
        "run", help="enqueue a periodic job now (its schedule is unchanged)"
    )
    periodic_run.add_argument("module", help="module holding a fastjobs.App, or module:attribute")
    periodic_run.add_argument("kind")
    periodic_run.add_argument("--json", action="store_true")

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

    add_web_arguments(commands.add_parser("web", help="serve the dashboard (the web extra)"))

    statements = commands.add_parser("sql", help="the SQL statements fastjobs sends")
    statements_commands = statements.add_subparsers(dest="sql_command", required=True)
    statements_show = statements_commands.add_parser(
        "show", help="print statement NAME whole, as it is sent (no NAME: every name, by section)"
    )
    statements_show.add_argument("name", nargs="?", metavar="NAME")

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
        "--compare-lanes",
        action="store_true",
        help="drain: `fastjobs run` beside `fastjobs run --no-fast-lane` (every job on the state lane)",
    )
    run_bench.add_argument(
        "--keep-completed", action="store_true", help="keep completed rows (retention mode)"
    )
    run_bench.add_argument(
        "--middleware", action="store_true", help="drain: the jobs behind one no-op middleware"
    )
    run_bench.add_argument("--rate", type=float, default=1000.0, help="jobs/s offered in the latency run")
    run_bench.add_argument("--latency-seconds", type=float, default=5.0, help="length of the latency run")
    run_bench.add_argument(
        "--latency-write",
        action="store_true",
        help="latency: each handler also writes one row through its own connection (autocommit, default"
        " durability), as an application's job does",
    )
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
        "--plot", type=Path, help="with --soak: draw both runs as a PNG at PLOT (needs the plot extra)"
    )
    run_bench.add_argument(
        "--results",
        type=Path,
        metavar="PATH",
        help="append one JSON line per measurement to PATH (default: no file is written)",
    )
    _schema_everywhere(commands)
    return parser


_SCHEMA_HELP = (
    "the PostgreSQL schema of fastjobs' tables, for a database shared with other applications (default:"
    " FASTJOBS_SCHEMA, else none: the search_path's); given before or after the command"
)


def _limit_arguments(parser: argparse.ArgumentParser, whose: str, rates: str, none: str) -> None:
    """The --concurrency and --rate-limit of `queues limit` and `queues key`."""
    parser.add_argument(
        "--concurrency",
        type=backlog,
        default=queues.UNCHANGED,
        metavar="N",
        help=f"at most N of {whose} running at once, cluster-wide (none: {none})",
    )
    parser.add_argument(
        "--rate-limit",
        type=rate,
        default=queues.UNCHANGED,
        metavar="N/PERIOD",
        help=f"at most N of {whose} started per period, cluster-wide: {rates} (none: {none})",
    )


def _schema_everywhere(commands: Any) -> None:
    """--schema after any command too (`fastjobs migrate --schema jobs`), as before it."""
    for command in commands.choices.values():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _schema_everywhere(nested[0])
        else:
            command.add_argument("--schema", default=argparse.SUPPRESS, help=_SCHEMA_HELP)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, which `main` (and `manage.py fastjobs_run`) configure logging with."""
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


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The options of `fastjobs run` but its MODULE: `manage.py fastjobs_run` takes the same."""
    worker = WorkerConfig()  # the defaults of the workers' settings
    run.add_argument("--processes", type=int, default=1, help="worker processes (besides master and leader)")
    run.add_argument(
        "--queues",
        help="queues and their concurrency, e.g. default:8,emails:2: async jobs at once, and sync jobs on"
        " threads (default: every registered queue, 10 async jobs per process, sync ones one at a time)",
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
        help="advisory lock key of the leader election (pick one your application does not use; default:"
        " one of fastjobs' own, a schema's own with --schema)",
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
        "--host-id",
        help="this host's name in worker ids and the cluster view of `fastjobs stats`"
        " (default: $FASTJOBS_HOST_ID, else the host name)",
    )
    run.add_argument(
        "--batch-max",
        type=_positive_int,
        default=worker.batch_max,
        help="largest batch one claim takes (default %(default)d)",
    )
    run.add_argument("--keep-completed", action="store_true", help="keep completed jobs instead of deleting")
    run.add_argument(
        "--no-fast-lane",
        dest="fast_lane",
        action="store_false",
        help="every job takes the state lane (claimed as 'running', then finished): two writes per job",
    )
    run.add_argument(
        "--rescue-after",
        type=float,
        default=RescuerConfig().stale_after,
        metavar="SECONDS",
        help="rescue the running jobs of a worker silent this long (heartbeats every 2 s; at least 5)",
    )


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit:
            sys.stdout.flush()  # --help's text (argparse exits after it): a closed pipe is caught below
            raise
        with logs.configured(args.log_level, args.log_format):
            code = _main(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`fastjobs stats | head`): stop quietly, as a Unix tool killed by
        # SIGPIPE does. stdout now points at /dev/null, so the interpreter's final flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(args: argparse.Namespace) -> int:
    if FALLBACK:
        logger.warning(FALLBACK)
    return guarded(lambda: _command(args))


def guarded(command: Callable[[], int]) -> int:
    """Run a command, its start-up failures logged and turned into exit codes (EXIT_BOOT_ERROR: do
    not restart)."""
    try:
        return command()
    except (ConfigurationError, DatabaseUnavailable, SchemaMissing) as exc:
        # Could not start (no or bad DSN, no database, no schema, no app): the code `run` exits
        # with too, which a supervisor takes for "do not restart".
        logger.error("%s", exc)
        return EXIT_BOOT_ERROR
    except (FastjobsError, ValueError) as exc:
        logger.error("%s", exc)
        return 1


def _command(args: argparse.Namespace) -> int:
    if args.command == "migrate":
        return migrate_command(args)
    if args.command == "run":
        return run_command(args)
    if args.command == "stats":
        return stats_command(args)
    if args.command == "jobs":
        return jobs_command(args)
    if args.command == "periodic":
        return periodic_command(args)
    if args.command == "queues":
        return queues_command(args)
    if args.command == "bench":
        return bench_command(args)
    if args.command == "sql":
        return sql_show_command(args.name, database.resolve_schema(args.schema))
    if args.command == "web":
        return web_command(args)
    return 2
