"""`fastjobs jobs` and `fastjobs periodic`: list, show, retry, cancel and discard jobs; list periodic jobs."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from .. import control, database, logs, report, schema, sql
from ..app import App
from ..errors import FastjobsError
from ..maintenance import periodic_status
from ..types import JobSpec
from .run import load_app
from .table import Column, echo, iso, minute, safe, table, when

__all__ = ["ACTS_ON", "did_you_mean", "jobs_command", "no_such_names", "periodic_command"]

logger = logging.getLogger("fastjobs.cli")

# The states each of `fastjobs jobs retry|cancel|discard` acts on.
ACTS_ON = {name: control.ACTS_ON[name] for name in ("retry", "cancel", "discard")}


def jobs_command(args: argparse.Namespace) -> int:
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
                echo(json.dumps(rows, default=str, indent=2))
            else:
                table(_JOB_COLUMNS, rows)
            if more:
                logger.info("the newest %d shown, and there are more: --limit N for more", args.limit)
            elif not rows and (args.kind or args.queue):
                # A name that names nothing exits 1, as any other "not found" of the CLI does.
                return 1 if no_such_names(conn, args.queue, args.kind, statements) else 0
            return 0
        if command == "show":
            job = control.show(conn, args.id, statements)
            if args.json:
                echo(json.dumps(job, default=str, indent=2))
                return 0
            for key, value in job.items():
                if key in ("errors", "args", "meta", "result"):
                    continue
                echo(f"{key:>16}: {safe(str(value))}")
            echo(f"{'args':>16}: {safe(json.dumps(job['args'], ensure_ascii=False))}")
            if "result" in job:
                echo(f"{'result':>16}: {safe(json.dumps(job['result'], ensure_ascii=False))}")
            for error in job["errors"] or []:
                head = f"attempt {error.get('attempt')} at {error.get('at')}: {error.get('error')}"
                echo(f"\n--- {safe(head)}")
                if error.get("traceback"):
                    echo(safe(str(error["traceback"]).rstrip(), lines=True))
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
            echo(json.dumps(doc) if args.json else line)
        return 1 if failed else 0


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """A hint naming the names of `known` close to `name` (difflib): "; did you mean 'x'?", or ""."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def no_such_names(conn: Any, queue: str | None, kind: str | None, statements: ModuleType = sql) -> bool:
    """After a listing came back empty: warn about a --queue or --kind that names nothing known;
    whether one did.

    Known are the queues and kinds of the jobs table and those live workers
    serve and handle (their heartbeats).
    """
    rows = control.kinds(conn, statements)
    workers = [w for h in report.cluster(conn, sql=statements) for w in h.workers if not w.stale]
    queues = {q for q, _, _ in rows} | {q for w in workers for q in w.queues}
    kinds = {k for _, k, _ in rows} | {k for w in workers for k in w.counters.get("handles", [])}
    unknown = False
    if queue is not None and queue not in queues:
        unknown = True
        logger.warning(
            "no queue %r: no job is on it and no live worker serves it%s", queue, did_you_mean(queue, queues)
        )
    if kind is not None and kind not in kinds:
        # A kind is matched whole: name the kinds the short name ends, else the close ones.
        ends = sorted(k for k in kinds if k.endswith("." + kind))
        hint = (
            f"; a kind is matched whole: {' or '.join(map(repr, ends))}?"
            if ends
            else did_you_mean(kind, kinds)
        )
        logger.warning("no kind %r: no job has it and no live worker handles it%s", kind, hint)
        unknown = True
    return unknown


def _act_on_filtered(conn: Any, args: argparse.Namespace, statements: ModuleType = sql) -> int:
    """`fastjobs jobs retry|cancel|discard` by filter: count, confirm, then act on those jobs one by one.

    Each job goes through the single-id path (its statement, and the look again
    by id when the rotation moved its row), in its own transaction, page by page
    (control.act_by_filter): a long run holds no lock for long nor every id in
    memory, and no job enqueued after the count is acted on.
    """
    command = args.jobs_command
    states = {args.state} if args.state else ACTS_ON[command]
    selection = control.select(
        conn, states, queue=args.queue, kind=args.kind, older_than=args.older_than, sql=statements
    )
    matched = control.count(conn, selection, statements)
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
    if not matched:
        logger.info("no job matches (%s): nothing to %s", what, command)
        if args.queue or args.kind:
            return 1 if no_such_names(conn, args.queue, args.kind, statements) else 0
        return 0
    if not args.yes and not _confirm(f"{command} {logs.plural(matched, 'job')} ({what})? [y/N] "):
        logger.info("nothing done")
        return 1
    done: dict[str, int] = {}
    failed = reached = 0
    for reached, acted in enumerate(control.act_by_filter(conn, command, selection, statements), 1):
        if acted.state is None:  # running now, finished meanwhile, a unique key held
            logger.warning("%s", acted.error)
            failed += 1
            continue
        done[acted.state] = done.get(acted.state, 0) + 1
        if args.json:
            echo(json.dumps(acted.report))
        if reached % _PROGRESS_EVERY == 0:
            logger.info("%s of %s", f"{reached:,}", logs.plural(matched, "job"))
    summary = ", ".join(f"{logs.plural(n, 'job')} {state}" for state, n in sorted(done.items())) or "none"
    left = f"; {logs.plural(failed, 'job')} not, each said why above" if failed else ""
    logger.info("%s of %s: %s%s", command, logs.plural(reached, "job"), summary, left)
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
    hint = did_you_mean(name, shorts) or did_you_mean(name, periodic)
    raise ValueError(f"{name!r} is not a periodic job of {module}{hint} (its periodic jobs: {known})")


def periodic_command(args: argparse.Namespace) -> int:
    app = load_app(args.module, args.dsn, args.schema)
    try:
        with database.connect(app.dsn, autocommit=True) as conn:
            schema.check(conn, app.sql)
            if args.periodic_command == "run":
                spec = _periodic_spec(app, args.module, args.kind)
                job_id = app.enqueue(spec.kind, conn=conn)
                if args.json:
                    echo(json.dumps({"id": job_id, "kind": spec.kind, "queue": spec.queue}))
                else:
                    echo(
                        f"job {job_id}: {spec.kind} enqueued on queue {spec.queue}; its schedule is as it was"
                    )
                return 0
            found = periodic_status(conn, [s for s in app.jobs.values() if s.cron], sql=app.sql)
    finally:
        app.close()
    if args.json:
        echo(json.dumps([dataclasses.asdict(p) for p in found], default=iso, indent=2))
        return 0
    if not found:
        echo(f"(no periodic jobs in {args.module})")
        return 0
    table(_PERIODIC_COLUMNS, found)
    return 0


def _last_tick(p: Any) -> str:
    if p.last_tick is not None:
        return minute(p.last_tick)
    if p.first_seen is not None:
        return f"none (first seen {p.first_seen:%Y-%m-%d %H:%M:%S})"
    return "none (no leader has seen it)"


_JOB_COLUMNS: list[Column[dict[str, Any]]] = [
    Column("id", lambda r: str(r["id"]), ">"),
    Column("queue", lambda r: safe(r["queue"])),
    Column("kind", lambda r: safe(r["kind"])),
    Column("state", lambda r: str(r["state"])),
    Column("attempt", lambda r: f"{r['attempt']}/{r['max_attempts']}", ">"),
    Column("run_at", lambda r: when(r["run_at"])),
]
_PERIODIC_COLUMNS: list[Column[Any]] = [
    Column("kind", lambda p: safe(p.kind)),
    Column("queue", lambda p: safe(p.queue)),
    Column("schedule", lambda p: p.schedule),
    Column("last tick (UTC)", _last_tick),
    Column("next tick (UTC)", lambda p: minute(p.next_tick)),
]
