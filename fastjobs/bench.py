"""`fastjobs bench`: fastjobs beside the raw-SQL limit measured in the same run."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import database, enqueue, schema
from .app import App
from .impl import IMPLEMENTATION

BENCH_DB = "fastjobs_bench"
BENCH_KIND = "fastjobs.bench.noop"


def bench_dsn(dsn: str) -> str:
    """A dedicated database beside the given one, created and migrated on demand.

    The benchmark truncates the jobs table between runs: it must never touch
    the user's own jobs.
    """
    with database.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DB,)).fetchone()
        if not exists:
            conn.execute(f"CREATE DATABASE {BENCH_DB}")
    target = make_conninfo(dsn, dbname=BENCH_DB)
    with database.connect(target) as conn:
        schema.migrate(conn)
    return target


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE fastjobs_jobs RESTART IDENTITY")
        conn.execute("VACUUM ANALYZE fastjobs_jobs")


def _raw_copy(dsn: str, rows: list[dict[str, Any]]) -> float:
    """The limit: one binary COPY of rows encoded before the clock starts."""
    opts = enqueue.options(BENCH_KIND, None)
    statement, prefix, suffix = enqueue.copy_layout(opts, dt.datetime.now(dt.UTC))
    body = b"".join(
        prefix + (len(d) + 1).to_bytes(4, "big") + b"\x01" + d + suffix
        for d in (json.dumps(r, separators=(",", ":")).encode() for r in rows)
    )
    data = b"PGCOPY\n\xff\r\n\x00" + bytes(8) + body + b"\xff\xff"
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        with conn.cursor() as cur, cur.copy(statement) as copy:
            copy.write(data)
        conn.commit()
        return time.perf_counter() - start


def _fastjobs_copy(dsn: str, rows: list[dict[str, Any]]) -> float:
    app = App(dsn)
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        app.enqueue_many(BENCH_KIND, rows, conn=conn)
        conn.commit()
        return time.perf_counter() - start


def run_enqueue(dsn: str, jobs: int, repeat: int, results: Path | None, echo: Callable[[str], None]) -> dict[str, Any]:
    """Enqueue `jobs` rows with enqueue_many and with a bare COPY, alternating; medians."""
    target = bench_dsn(dsn)
    rows = [{"i": i, "email": f"user{i}@example.com"} for i in range(jobs)]
    times: dict[str, list[float]] = {"fastjobs": [], "raw": []}
    for run in range(repeat):
        for name, fn in (("fastjobs", _fastjobs_copy), ("raw", _raw_copy)):
            _reset(target)
            seconds = fn(target, rows)
            times[name].append(seconds)
            echo(f"  run {run + 1}/{repeat} {name:8s} {jobs / seconds:>10,.0f} jobs/s")
    fast = jobs / statistics.median(times["fastjobs"])
    raw = jobs / statistics.median(times["raw"])
    record = {
        "bench": "enqueue",
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "implementation": IMPLEMENTATION,
        "jobs": jobs,
        "repeat": repeat,
        "fastjobs_jobs_per_s": round(fast),
        "raw_copy_jobs_per_s": round(raw),
        "ratio": round(fast / raw, 3),
        "postgres": _server_version(target),
        "commit": _git_commit(),
        "host": conninfo_to_dict(target).get("host"),
    }
    echo("")
    echo(f"{'enqueue':<24}{'jobs/s':>12}{'ratio':>8}")
    echo(f"{'raw binary COPY':<24}{raw:>12,.0f}{1.0:>8.2f}")
    echo(f"{'fastjobs enqueue_many':<24}{fast:>12,.0f}{fast / raw:>8.2f}   ({IMPLEMENTATION} implementation)")
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        echo(f"result appended to {results}")
    return record


def _server_version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def echo(line: str) -> None:
    print(line, flush=True)

