"""The `fastjobs` command."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import difflib
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from . import control, database, logs, queues, schema, sql, stats
from .abc import OUTCOMES
from .app import App
from .children import EXIT_BOOT_ERROR
from .errors import ConfigurationError, DatabaseUnavailable, FastjobsError, SchemaMissing
from .impl import FALLBACK, IMPLEMENTATION
from .leader import DEFAULT_LEASE, LeaderConfig, RescuerConfig, periodic_status
from .master import DEFAULT_WORKER_TIMEOUT, Master, parse_queues, threaded_queues
from .stats import HORIZON_WARNING
from .types import JobSpec, JobState
from .worker import WorkerConfig, host_id

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


# The states each of `fastjobs jobs retry|cancel|discard` acts on.
_ACTS_ON = {"retry": control.RETRIABLE, "cancel": control.CANCELLABLE, "discard": control.DISCARDABLE}


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
            choices=sorted(_ACTS_ON[name]),
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
    limit.add_argument(
        "--concurrency",
        type=_backlog,
        default=queues.UNCHANGED,
        metavar="N",
        help="at most N of its jobs running at once, cluster-wide (none: no limit)",
    )
    limit.add_argument(
        "--rate-limit",
        type=_rate,
        default=queues.UNCHANGED,
        metavar="N/PERIOD",
        help="at most N of its jobs started per period, cluster-wide: 200/s, 1000/min, 50/h (none: no limit)",
    )
    limit.add_argument(
        "--max-backlog",
        type=_backlog,
        default=queues.UNCHANGED,
        metavar="N",
        help="jobs waiting past which enqueues are held back (none: no limit)",
    )
    limit.add_argument("--json", action="store_true")

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
        " durability), as an application's job does (issue 22's measurement)",
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
        args = _parser().parse_args(argv)  # --help writes to stdout too
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
        return _migrate(args)
    if args.command == "run":
        return _run(args)
    if args.command == "stats":
        return _stats(args)
    if args.command == "jobs":
        return _jobs(args)
    if args.command == "periodic":
        return _periodic(args)
    if args.command == "queues":
        return _queues(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "sql":
        return _sql_show(args.name, database.resolve_schema(args.schema))
    return 2


def load_app(target: str, dsn: str | None = None, schema: str | None = None) -> App:
    """Import `module` or `module:attr` and return its App; a clear error otherwise.

    With `dsn` (`fastjobs --dsn`), the App is pointed at that database
    (`App.configure`), whatever its own DSN; with `schema` (`--schema`), at that schema.
    """
    module_name, _, attr = target.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        hint = ""
        if module_name.endswith(".py") or os.sep in module_name:  # `flask --app` takes a file; we do not
            dotted = module_name.removesuffix(".py").strip(os.sep).replace(os.sep, ".")
            hint = f" (name the module, as in an import: {dotted}, not its file)"
        raise ConfigurationError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{hint}") from exc
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
    if dsn or schema:
        app.configure(dsn=dsn or None, schema=schema)
    return app


def _run(args: argparse.Namespace) -> int:
    return run(args, lambda: load_app(args.module, args.dsn, args.schema))


def run(args: argparse.Namespace, load: Callable[[], App], queues: Iterable[str] = ()) -> int:
    """`fastjobs run` with the options of add_run_arguments: its settings checked, then the App
    loaded by `load`, then the master run until it stops. The workers serve `--queues`, else
    every queue of a registered job and `queues`."""
    host = host_id(args.host_id)  # the settings are checked before the application is imported
    worker = WorkerConfig(
        batch_max=args.batch_max,
        keep_completed=args.keep_completed,
        grace=args.grace,
        fast_lane=args.fast_lane,
    )
    leader = LeaderConfig(
        lock_key=args.leader_key, rescuer=RescuerConfig.after(args.rescue_after), lease=args.leader_lease
    )
    app = load()
    registered = sorted({spec.queue for spec in app.jobs.values()} | set(queues))
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
        host=host,
        threaded=threaded_queues(args.queues),
    )
    code = master.run()
    if code != EXIT_BOOT_ERROR:  # what could not start says why, and nothing was stopped
        logger.info("stopped")
    return code


def _jobs(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    statements = sql.of(database.resolve_schema(args.schema))
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn, statements)
        command = args.jobs_command
        if command == "list":
            # One row more than asked says whether the listing was cut.
            rows = control.list_jobs(
                conn, queue=args.queue, state=args.state, kind=args.kind, limit=args.limit + 1, sql=statements
            )
            more, rows = len(rows) > args.limit, rows[: args.limit]
            if args.json:
                _echo(json.dumps(rows, default=str, indent=2))
            else:
                _table(_JOB_COLUMNS, rows)
            if more:
                logger.info("the newest %d shown, and there are more: --limit N for more", args.limit)
            elif not rows and (args.kind or args.queue):
                _no_such_names(conn, args.queue, args.kind, statements)
            return 0
        if command == "show":
            job = control.show(conn, args.id, statements)
            if args.json:
                _echo(json.dumps(job, default=str, indent=2))
                return 0
            for key, value in job.items():
                if key in ("errors", "args", "meta", "result"):
                    continue
                _echo(f"{key:>16}: {_safe(str(value))}")
            _echo(f"{'args':>16}: {_safe(json.dumps(job['args'], ensure_ascii=False))}")
            if "result" in job:
                _echo(f"{'result':>16}: {_safe(json.dumps(job['result'], ensure_ascii=False))}")
            for error in job["errors"] or []:
                head = f"attempt {error.get('attempt')} at {error.get('at')}: {error.get('error')}"
                _echo(f"\n--- {_safe(head)}")
                if error.get("traceback"):
                    _echo(_safe(str(error["traceback"]).rstrip(), lines=True))
            return 0
        filtered = any(v is not None for v in (args.state, args.queue, args.kind, args.older_than))
        if filtered == bool(args.id):
            raise ValueError(
                f"`fastjobs jobs {command}` takes job ids or filters (--state, --queue, --kind,"
                " --older-than), " + ("not both" if filtered else "and was given neither")
            )
        if filtered:
            return _act_on_filtered(conn, args, statements)
        # Each job is done and reported on its own; one that cannot be is logged and makes the exit 1.
        failed = False
        for job_id in args.id:
            try:
                if command == "retry":
                    retried = control.retry(conn, job_id, statements)
                    doc: dict[str, Any] = dataclasses.asdict(retried)
                    line = retried.describe()
                else:
                    act = {"cancel": control.cancel, "discard": control.discard}[command]
                    state = act(conn, job_id, statements)
                    doc, line = {"id": job_id, "state": state}, f"job {job_id}: {state}"
            except (FastjobsError, ValueError) as exc:
                logger.error("%s", exc)
                failed = True
                continue
            _echo(json.dumps(doc) if args.json else line)
        return 1 if failed else 0


def _queues(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    statements = sql.of(database.resolve_schema(args.schema))
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn, statements)
        if args.queues_command == "list":
            found = queues.list_queues(conn, statements)
            if args.json:
                _echo(json.dumps([dataclasses.asdict(q) for q in found], default=str, indent=2))
            elif found:
                _table(_QUEUES_COLUMNS, found)
            else:
                _echo("(no queues: none holds a job or was paused)")
            return 0
        name = args.name
        if name not in {q.name for q in queues.list_queues(conn, statements)}:
            # Paused or resumed all the same: a queue may be paused before its first job.
            _no_such_names(conn, name, None, statements)
        if args.queues_command == "limit":
            limits = {
                "concurrency": args.concurrency,
                "rate_limit": args.rate_limit,
                "max_backlog": args.max_backlog,
            }
            doc: dict[str, Any] = {
                field: value for field, value in limits.items() if value is not queues.UNCHANGED
            }
            if not doc:
                raise ValueError("give --concurrency, --rate-limit, --max-backlog or several")
            queues.limit(conn, name, **doc, sql=statements)
            line = f"queue {name!r}: " + ", ".join(
                f"no {field}"
                if value is None
                else f"{field} {value:,}"
                if isinstance(value, int)
                else f"{field} {value}"
                for field, value in doc.items()
            )
            doc["queue"] = name
        elif args.queues_command == "pause":
            since = queues.pause(conn, name, statements)
            doc = {"queue": name, "paused": True, "paused_at": since.isoformat()}
            line = f"queue {name!r}: paused since {_when(since)}"
        else:
            was = queues.resume(conn, name, statements)
            doc = {"queue": name, "paused": False, "was_paused": was}
            line = f"queue {name!r}: " + ("resumed" if was else "was not paused")
    _echo(json.dumps(doc) if args.json else _safe(line))
    return 0


def _rate(text: str) -> str | None:
    """An argparse type: a rate limit (N/PERIOD), or none."""
    if text.lower() == "none":
        return None
    try:
        queues.per_second(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _backlog(text: str) -> int | None:
    """An argparse type: a positive integer, or none."""
    if text.lower() == "none":
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or none, not {text!r}")
    return value


def _close(name: str, known: Iterable[str]) -> str:
    """A hint naming the names of `known` close to `name` (difflib): "; did you mean 'x'?", or ""."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def _no_such_names(conn: Any, queue: str | None, kind: str | None, statements: ModuleType = sql) -> None:
    """After a listing came back empty: warn about a --queue or --kind that names nothing known.

    Known are the queues and kinds of the jobs table and those live workers
    serve and handle (their heartbeats).
    """
    rows = control.kinds(conn, statements)
    workers = [w for h in stats.cluster(conn, sql=statements) for w in h.workers if not w.stale]
    queues = {q for q, _, _ in rows} | {q for w in workers for q in w.queues}
    kinds = {k for _, k, _ in rows} | {k for w in workers for k in w.counters.get("handles", [])}
    if queue is not None and queue not in queues:
        logger.warning(
            "no queue %r: no job is on it and no live worker serves it%s", queue, _close(queue, queues)
        )
    if kind is not None and kind not in kinds:
        # A kind is matched whole: name the kinds the short name ends, else the close ones.
        ends = sorted(k for k in kinds if k.endswith("." + kind))
        hint = f"; a kind is matched whole: {' or '.join(map(repr, ends))}?" if ends else _close(kind, kinds)
        logger.warning("no kind %r: no job has it and no live worker handles it%s", kind, hint)


def _act_on_filtered(conn: Any, args: argparse.Namespace, statements: ModuleType = sql) -> int:
    """`fastjobs jobs retry|cancel|discard` by filter: count, confirm, then act on those jobs one by one.

    Each job goes through the single-id path (its statement, and the look again
    by id when the rotation moved its row), in its own transaction: a long run
    holds no lock for long, and the jobs acted on are those counted.
    """
    command = args.jobs_command
    states = {args.state} if args.state else _ACTS_ON[command]
    ids = control.select(
        conn, states, queue=args.queue, kind=args.kind, older_than=args.older_than, sql=statements
    )
    what = ", ".join(
        f"{name} {value}"
        for name, value in (
            ("state", args.state),
            ("queue", args.queue),
            ("kind", args.kind),
            (
                "created more than",
                args.older_than and f"{logs.duration(args.older_than.total_seconds())} ago",
            ),
        )
        if value
    )
    if not ids:
        logger.info("no job matches (%s): nothing to %s", what, command)
        if args.queue or args.kind:
            _no_such_names(conn, args.queue, args.kind, statements)
        return 0
    if not args.yes and not _confirm(f"{command} {logs.plural(len(ids), 'job')} ({what})? [y/N] "):
        logger.info("nothing done")
        return 1
    done: dict[str, int] = {}
    failed = 0
    for index, job_id in enumerate(ids, 1):
        try:
            if command == "retry":
                retried = control.retry(conn, job_id, statements)
                doc: dict[str, Any] = dataclasses.asdict(retried)
                state = retried.state if retried.attempt is not None else f"left {retried.state}"
            else:
                act = {"cancel": control.cancel, "discard": control.discard}[command]
                state = act(conn, job_id, statements)
                doc = {"id": job_id, "state": state}
        except (FastjobsError, ValueError) as exc:  # running now, finished meanwhile, a unique key held
            logger.warning("%s", exc)
            failed += 1
            continue
        done[state] = done.get(state, 0) + 1
        if args.json:
            _echo(json.dumps(doc))
        if index % _PROGRESS_EVERY == 0:
            logger.info("%s of %s", f"{index:,}", logs.plural(len(ids), "job"))
    summary = ", ".join(f"{logs.plural(n, 'job')} {state}" for state, n in sorted(done.items())) or "none"
    left = f"; {logs.plural(failed, 'job')} not, each said why above" if failed else ""
    logger.info("%s of %s: %s%s", command, logs.plural(len(ids), "job"), summary, left)
    return 1 if failed else 0


# A filtered retry, cancel or discard logs how far it is after this many jobs.
_PROGRESS_EVERY = 1000


def _confirm(question: str) -> bool:
    """Ask on the terminal; from a script (stdin not a terminal) say to pass --yes instead."""
    if not sys.stdin.isatty():
        raise ValueError(f"{question.removesuffix(' [y/N] ')} Confirm with --yes: stdin is not a terminal")
    sys.stderr.write(question)
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _periodic_spec(app: App, module: str, name: str) -> JobSpec:
    """The periodic job of `app` named `name`: its whole kind, or the short name ending one kind."""
    periodic = {kind: spec for kind, spec in app.jobs.items() if spec.cron}
    if name in periodic:
        return periodic[name]
    ends = sorted(kind for kind in periodic if kind.endswith("." + name))
    if len(ends) == 1:
        return periodic[ends[0]]
    if ends:
        raise ValueError(
            f"{name!r} names several periodic jobs of {module}: {', '.join(ends)}; give one whole"
        )
    shorts = {kind.rsplit(".", 1)[-1] for kind in periodic}
    known = ", ".join(sorted(periodic)) or "none"
    raise ValueError(
        f"{name!r} is not a periodic job of {module}{_close(name, shorts) or _close(name, periodic)}"
        f" (its periodic jobs: {known})"
    )


def _periodic(args: argparse.Namespace) -> int:
    app = load_app(args.module, args.dsn, args.schema)
    try:
        with database.connect(app.dsn, autocommit=True) as conn:
            schema.check(conn, app.sql)
            if args.periodic_command == "run":
                spec = _periodic_spec(app, args.module, args.kind)
                job_id = app.enqueue(spec.kind, conn=conn)
                if args.json:
                    _echo(json.dumps({"id": job_id, "kind": spec.kind, "queue": spec.queue}))
                else:
                    _echo(
                        f"job {job_id}: {spec.kind} enqueued on queue {spec.queue}; its schedule is as it was"
                    )
                return 0
            found = periodic_status(conn, [s for s in app.jobs.values() if s.cron], sql=app.sql)
    finally:
        app.close()
    if args.json:
        _echo(json.dumps([dataclasses.asdict(p) for p in found], default=_iso, indent=2))
        return 0
    if not found:
        _echo(f"(no periodic jobs in {args.module})")
        return 0
    _table(_PERIODIC_COLUMNS, found)
    return 0


def _iso(value: object) -> str:
    return value.isoformat() if isinstance(value, dt.datetime) else str(value)


def _minute(at: dt.datetime | None) -> str:
    return "-" if at is None else f"{at:%Y-%m-%d %H:%M}"


def _last_tick(p: Any) -> str:
    if p.last_tick is not None:
        return _minute(p.last_tick)
    if p.first_seen is not None:
        return f"none (first seen {p.first_seen:%Y-%m-%d %H:%M:%S})"
    return "none (no leader has seen it)"


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


T = TypeVar("T")


class Column(Generic[T]):
    """A column of a table the command prints: its header, alignment and cell text from a row."""

    __slots__ = ("align", "cell", "header")

    def __init__(self, header: str, cell: Callable[[T], str], align: str = "<") -> None:
        self.header, self.cell, self.align = header, cell, align


def _table(columns: Sequence[Column[T]], rows: Iterable[T], indent: str = "") -> None:
    """Print rows under their headers, each column as wide as its widest cell, two spaces apart.

    However wide a value, columns never run together; the last column is not padded.
    """
    cells = [[c.header for c in columns]] + [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        text = "  ".join(
            f"{cell:{c.align}{width}}" for cell, c, width in zip(line, columns, widths, strict=True)
        )
        _echo(indent + text.rstrip())


_JOB_COLUMNS: list[Column[dict[str, Any]]] = [
    Column("id", lambda r: str(r["id"]), ">"),
    Column("queue", lambda r: _safe(r["queue"])),
    Column("kind", lambda r: _safe(r["kind"])),
    Column("state", lambda r: str(r["state"])),
    Column("attempt", lambda r: f"{r['attempt']}/{r['max_attempts']}", ">"),
    Column("run_at", lambda r: _when(r["run_at"])),
]
_PERIODIC_COLUMNS: list[Column[Any]] = [
    Column("kind", lambda p: _safe(p.kind)),
    Column("queue", lambda p: _safe(p.queue)),
    Column("schedule", lambda p: p.schedule),
    Column("last tick (UTC)", _last_tick),
    Column("next tick (UTC)", lambda p: _minute(p.next_tick)),
]
_QUEUES_COLUMNS: list[Column[queues.QueueInfo]] = [
    Column("queue", lambda q: _safe(q.name)),
    Column("state", lambda q: f"paused since {_when(q.paused_at)}" if q.paused_at else "running"),
    Column("waiting", lambda q: f"{q.waiting:,}", ">"),
    Column("running", lambda q: f"{q.running:,}", ">"),
    Column("concurrency", lambda q: "" if q.concurrency is None else f"{q.concurrency:,}", ">"),
    Column("rate_limit", lambda q: q.rate_limit or "", ">"),
    Column("max_backlog", lambda q: "" if q.max_backlog is None else f"{q.max_backlog:,}", ">"),
    Column("held back", lambda q: f"{q.held_back:,}", ">"),
]
_QUEUE_COLUMNS: list[Column[stats.QueueDepth]] = [
    Column("queue", lambda d: _safe(d.queue)),
    Column("state", lambda d: d.state),
    Column("jobs", lambda d: f"{d.count:,}", ">"),
    Column("oldest", lambda d: "" if d.oldest_seconds is None else f"{d.oldest_seconds:,.1f}s", ">"),
]


def _process_columns(now: float) -> list[Column[dict[str, Any]]]:
    """The columns of a master's processes (a slot's fields, as `_process_json` gives them)."""
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


def _table_columns(now: float) -> list[Column[stats.TableHealth]]:
    def vacuumed(t: stats.TableHealth) -> str:
        last = max((v for v in (t.last_vacuum, t.last_autovacuum) if v is not None), default=None)
        when = "never" if last is None else f"{now - last:,.0f}s ago"
        return f"{when} ({t.autovacuums:,} autovacuums)"

    return [
        Column("table", lambda t: t.table),
        Column("live", lambda t: f"{t.live:,}", ">"),
        Column("dead", lambda t: f"{t.dead:,}", ">"),
        Column("table", lambda t: _size(t.table_bytes), ">"),
        Column("indexes", lambda t: _size(t.index_bytes), ">"),
        Column("last vacuum", vacuumed),
    ]


def _process_json(p: dict[str, float]) -> dict[str, Any]:
    """A slot's fields for people and machines: counts and pids as integers, times as floats."""
    return {name: int(value) if name in stats.INTEGER_FIELDS else value for name, value in p.items()}


def _stats(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    statements = sql.of(database.resolve_schema(args.schema))
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn, statements)
        depths = stats.queue_depths(conn, statements)
        steered = queues.states(conn, statements)
        health = stats.health(conn, statements)
        identity = stats.database_identity(conn, dsn, statements)
        hosts = stats.cluster(conn, sql=statements)
        unhandled = stats.unhandled_kinds(control.kinds(conn, statements), hosts)
    warnings = health.warnings(args.horizon_warning) + [u.warning() for u in unhandled]
    found, skipped = stats.live_masters(None if args.all_masters else identity)
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
    warnings += stats.upkeep_warnings(p for m in found if m.database == identity for p in m.processes)
    if args.json:
        doc = {
            "database": identity,
            "queues": [dataclasses.asdict(d) for d in depths],
            "paused_queues": {q.name: q.paused_at.isoformat() for q in steered if q.paused_at},
            "queue_limits": [dataclasses.asdict(q) for q in steered if q.max_backlog is not None],
            "masters": masters,
            "health": dataclasses.asdict(health),
            "warnings": warnings,
            "cluster": [dataclasses.asdict(h) for h in hosts],
            "unhandled_kinds": [dataclasses.asdict(u) for u in unhandled],
        }
        _echo(json.dumps(doc, indent=2))
        return 0
    if depths:
        _table(_QUEUE_COLUMNS, depths)
    else:
        _echo("(no jobs)")
    for q in steered:
        if q.paused_at:
            _echo(
                _safe(
                    f"paused: queue {q.name!r} since {_when(q.paused_at)} (`fastjobs queues resume {q.name}`)"
                )
            )
        if q.concurrency is not None:
            _echo(_safe(f"concurrency: queue {q.name!r} runs at most {q.concurrency:,} jobs at once"))
        if q.rate_limit is not None:
            _echo(_safe(f"rate limit: queue {q.name!r} starts at most {q.rate_limit} jobs"))
        if q.max_backlog is not None:
            if q.backlog is None:
                counted = "not counted yet"
            elif q.backlog >= q.max_backlog:  # counted up to the limit
                counted = f"at least {q.backlog:,} waiting: FULL, enqueues held back"
            else:
                counted = f"{q.backlog:,} waiting"
            held = f"{q.held_back:,} held back so far"
            line = f"max_backlog: queue {q.name!r} {q.max_backlog:,} ({counted}; {held})"
            _echo(_safe(line))
    now = time.time()
    for m in masters:
        other = "" if m["this_database"] else f" (ANOTHER DATABASE: {_safe(m['database'])})"
        _echo(f"\nmaster pid {m['master_pid']} on this host{other}")
        _table(_process_columns(now), m["processes"])
        _print_kinds(m["kinds"])
    _print_cluster(hosts)
    _print_health(health, now)
    for line in warnings:
        _echo(f"\n{_safe(line)}")
    return 0


def _mean(histogram: dict[str, Any]) -> str:
    if not histogram["count"]:
        return "-"
    value = histogram["sum"] / histogram["count"]
    return f"{value * 1000:.2f}ms" if value < 1 else f"{value:.1f}s"


def _outcome_cell(outcome: str) -> Callable[[dict[str, Any]], str]:
    return lambda k: f"{k['outcomes'][outcome]:,}"


_KIND_COLUMNS: list[Column[dict[str, Any]]] = [
    Column("queue", lambda k: _safe(k["queue"])),
    Column("kind", lambda k: _safe(k["kind"])),
    *(Column(o, _outcome_cell(o), ">") for o in OUTCOMES),
    Column("run", lambda k: _mean(k["run_seconds"]), ">"),
    Column("pickup", lambda k: _mean(k["pickup_seconds"]), ">"),
]
_HOST_COLUMNS: list[Column[stats.ClusterHost]] = [
    Column("host", lambda h: _safe(h.host)),
    Column("workers", lambda h: str(len(h.workers)), ">"),
    Column("stale", lambda h: str(h.stale), ">"),
    Column("jobs/s", lambda h: f"{h.rate:,.0f}", ">"),
    Column("completed", lambda h: f"{h.totals['completed']:,}", ">"),
    Column("failed", lambda h: f"{h.totals['failed']:,}", ">"),
    Column("beat", lambda h: f"{h.heartbeat_age:.1f}s", ">"),
    Column("queues", lambda h: _safe(",".join(h.queues))),
]
_CLUSTER_WORKER_COLUMNS: list[Column[stats.ClusterWorker]] = [
    Column("worker", lambda w: _safe(w.id)),
    Column("pid", lambda w: str(w.pid), ">"),
    Column("jobs/s", lambda w: f"{w.rate:,.0f}", ">"),
    Column("beat", lambda w: f"{w.heartbeat_age:.1f}s", ">"),
    Column("queues", lambda w: _safe(",".join(w.queues))),
    Column("", lambda w: "STALE" if w.stale else ""),
]


def _print_kinds(kinds: list[dict[str, Any]]) -> None:
    """A master's counts per (queue, kind), with the mean run time and pickup latency."""
    if kinds:
        _table(_KIND_COLUMNS, kinds)


def _print_cluster(hosts: list[stats.ClusterHost]) -> None:
    """Every host's workers against this database, from their heartbeats (stale ones flagged)."""
    _echo(f"\ncluster: {len(hosts)} host(s) with workers registered in this database")
    if not hosts:
        return
    _table(_HOST_COLUMNS, hosts)
    for h in hosts:
        _echo(f"\n  workers of {_safe(h.host)}")
        _table(_CLUSTER_WORKER_COLUMNS, h.workers, indent="  ")


def _listener(p: dict[str, Any], now: float) -> str:
    if p["role"] != stats.WORKER:
        return ""
    state = f"up, ping ok {now - p['listener_ok']:.0f}s ago" if p["listening"] else "DOWN (polling)"
    return f"{state}, {p['listener_reconnects']} reconnects"


def _print_health(health: stats.Health, now: float) -> None:
    _echo("\nMVCC health")
    h = health.horizon
    if h is None:
        _echo("oldest snapshot: none open")
    else:
        held = "" if h.seconds is None else f" open {h.seconds:,.1f}s,"
        who = _safe(f"{h.source} {h.ident}")
        _echo(f"oldest snapshot: {who},{held} {h.xid_age or 0:,} xids old ({_safe(h.detail)})")
    _echo(f"NOTIFY queue: {health.notify_queue:.1%} used")
    _table(_table_columns(now), health.tables)


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


def _sql_show(name: str | None, schema_name: str | None = None) -> int:
    """Statement `name` as it is sent (its text, the leading newline of its literal aside; the three
    that name a table or an index, `{partition}` or `{index}`, have it filled in by psycopg.sql);
    without a name, the names by section of fastjobs.sql (a family's members are one). No database.
    With `schema_name` (--schema), as that schema's catalogue sends it."""
    if name is None:
        for title, names in sql.SECTIONS.items():
            _echo(title)
            for statement in names:
                _echo(f"  {statement}")
        return 0
    text = sql.of(schema_name).STATEMENTS.get(name)
    if text is None:
        hint = _close(name, sql.STATEMENTS) or "; `fastjobs sql show` lists them"
        raise ValueError(f"no statement named {name!r}{hint}")
    _echo(text.lstrip("\n"))
    return 0


def _migrate(args: argparse.Namespace) -> int:
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
        _echo(f"fastjobs: schema at {where} is up to date")
    for m in applied:
        _echo(f"fastjobs: applied {m.version:03d}_{m.name} to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
