"""`fastjobs queues`: list the queues, pause and resume one."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from .. import database, keys, queues, schema, sql
from .jobs import no_such_names
from .table import Column, echo, safe, table, when

__all__ = ["backlog", "queues_command", "rate"]

_QUEUES_COLUMNS: list[Column[queues.QueueInfo]] = [
    Column("queue", lambda q: safe(q.name)),
    Column("state", lambda q: f"paused since {when(q.paused_at)}" if q.paused_at else "running"),
    Column("waiting", lambda q: f"{q.waiting:,}", ">"),
    Column("running", lambda q: f"{q.running:,}", ">"),
    Column("concurrency", lambda q: "" if q.concurrency is None else f"{q.concurrency:,}", ">"),
    Column("rate_limit", lambda q: q.rate_limit or "", ">"),
    Column("max_backlog", lambda q: "" if q.max_backlog is None else f"{q.max_backlog:,}", ">"),
    Column("held back", lambda q: f"{q.held_back:,}", ">"),
    Column("fair", lambda q: "fair" if q.fair else ""),
]


_KEYS_COLUMNS: list[Column[keys.KeyInfo]] = [
    Column("kind", lambda k: safe(k.kind)),
    Column("key", lambda k: safe(k.key) if k.key else "(the kind)"),
    Column("concurrency", lambda k: "" if k.concurrency is None else f"{k.concurrency:,}", ">"),
    Column("rate_limit", lambda k: k.rate_limit or "", ">"),
    Column("running", lambda k: f"{k.running:,}", ">"),
]


def _keys_command(args: argparse.Namespace, conn: Any, statements: Any) -> int:
    """`fastjobs queues keys` and `fastjobs queues key KIND KEY`."""
    if args.queues_command == "keys":
        found = keys.list_limits(conn, statements)
        if args.json:
            echo(json.dumps([dataclasses.asdict(k) for k in found], indent=2))
        elif found:
            table(_KEYS_COLUMNS, found)
        else:
            echo("(no limits set per key: every key has the limits its jobs were enqueued with)")
        return 0
    limits = {"concurrency": args.concurrency, "rate_limit": args.rate_limit}
    doc: dict[str, Any] = {field: value for field, value in limits.items() if value is not queues.UNCHANGED}
    keys.limit(conn, args.kind, args.key, **doc, sql=statements)
    line = f"kind {args.kind!r}, key {args.key!r}: " + ", ".join(
        f"{field} as declared" if value is None else f"{field} {value}" for field, value in doc.items()
    )
    echo(json.dumps({"kind": args.kind, "key": args.key, **doc}) if args.json else safe(line))
    return 0


def queues_command(args: argparse.Namespace) -> int:
    dsn = database.resolve_dsn(args.dsn, fallback=True)
    statements = sql.of(database.resolve_schema(args.schema))
    with database.connect(dsn, autocommit=True) as conn:
        schema.check(conn, statements)
        if args.queues_command in ("keys", "key"):
            return _keys_command(args, conn, statements)
        if args.queues_command == "list":
            found = queues.list_queues(conn, statements)
            if args.json:
                echo(json.dumps([dataclasses.asdict(q) for q in found], default=str, indent=2))
            elif found:
                table(_QUEUES_COLUMNS, found)
            else:
                echo("(no queues: none holds a job or was paused)")
            return 0
        name = args.name
        if name not in {q.name for q in queues.list_queues(conn, statements)}:
            # Paused or resumed all the same: a queue may be paused before its first job.
            no_such_names(conn, name, None, statements)
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
            line = f"queue {name!r}: paused since {when(since)}"
        else:
            was = queues.resume(conn, name, statements)
            doc = {"queue": name, "paused": False, "was_paused": was}
            line = f"queue {name!r}: " + ("resumed" if was else "was not paused")
    echo(json.dumps(doc) if args.json else safe(line))
    return 0


def rate(text: str) -> str | None:
    """An argparse type: a rate limit (N/PERIOD), or none."""
    if text.lower() == "none":
        return None
    try:
        queues.per_second(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def backlog(text: str) -> int | None:
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
