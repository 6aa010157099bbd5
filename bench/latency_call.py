"""Pickup latency from the enqueue call, on any build of fastjobs (issue 22 §5).

    PYTHONPATH=TREE python bench/latency_call.py [--db NAME] [--rate 1000] [--seconds 10]
        [--processes 2] [--producers 4] [--no-write] [--stages] [--waits] [--label TEXT]

Offers --rate single enqueues a second (`App.enqueue(kind, args, conn=...)`,
each in its own transaction: the producers' connections are in autocommit,
default durability) from --producers threads, for --seconds, to --processes
in-process `fastjobs.Worker`s (forked, default WorkerConfig: the rotation
runs in one of them where the build has one). The handler notes its start
time first, then (unless --no-write) writes one row through its own
connection (autocommit, default durability), as an application's job does.

Prints one JSON line: p50/p90/p99/max in ms from the call (before
`enqueue`) and from the commit (when `enqueue` returned) to the handler's
start, and of each handler's write (`write_*`); CPU per job of the worker
processes, of the machine's PostgreSQL processes and of the whole machine
(`server_cpu_ms_per_job`, `machine_cpu_ms_per_job`, from /proc: a server on
another machine reads 0). --stages runs each enqueue in an explicit transaction to split the
call into the INSERT (`insert_*`) and the COMMIT (`commit_*`); it adds a
BEGIN round trip, so compare from-the-call figures only between runs of the
same mode. --waits samples pg_stat_activity of the bench database every
10 ms and adds the wait events seen per kind of backend (`waits`).

Imports only fastjobs's public API (App, Worker, WorkerConfig) and its CLI
(`fastjobs migrate`, run as a subprocess on the target database), so the
same file measures the build of 352031d (schema 004) and later ones: run
it with PYTHONPATH pointing at the tree to measure, each build against its
own database (--db, default $FASTJOBS_BENCH_DB or fastjobs_bench_call),
migrated by that build. The jobs and the handler's rows are truncated
before each run. bench/RESULTS.md (issue 22 §5) has the runs and commands.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import fastjobs


def own_migrations() -> None:
    """Read `fastjobs.migrations` from the measured tree's `migrations/`. The package maps it there
    (pyproject's package-dir), and a development install's import hook maps it to that install's
    checkout whatever tree PYTHONPATH names: until 2026-12-03 every build here was migrated by the
    working checkout's files (the old build ran on slot 0 of the rotating schema)."""
    init = os.path.join(os.path.dirname(os.path.dirname(fastjobs.__file__)), "migrations", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "fastjobs.migrations", init, submodule_search_locations=[os.path.dirname(init)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastjobs.migrations"] = module
    spec.loader.exec_module(module)


own_migrations()

KIND = "fastjobs.bench.call"

# The handler's row: what a job of an application writes.
CREATE_ROWS = (
    "CREATE TABLE IF NOT EXISTS latency_call_rows (i int NOT NULL, at timestamptz NOT NULL DEFAULT now())"
)
# The handler's write, one row a job.
INSERT_ROW = "INSERT INTO latency_call_rows (i) VALUES (%s)"
# Before each run: no jobs and no rows left by the previous one (schema 004 or 005: either table).
RESET = """
DO $$
BEGIN
    IF to_regclass('fastjobs_jobs_all') IS NOT NULL THEN
        TRUNCATE fastjobs_jobs_all;
    ELSE
        TRUNCATE fastjobs_jobs;
    END IF;
    TRUNCATE latency_call_rows;
END
$$"""
# Jobs not finished yet (schema 004 and 005: fastjobs_jobs_all is absent from 004).
PENDING = """
SELECT count(*) FROM fastjobs_jobs WHERE state IN ('available', 'running')"""
PENDING_ALL = """
SELECT count(*) FROM fastjobs_jobs_all WHERE state IN ('available', 'running')"""
# The wait sampler: every other backend of the bench database, what it waits on.
ACTIVITY = """
SELECT application_name, state, wait_event_type, wait_event, left(query, 40)
  FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()"""


def echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def prepare(dsn: str, db: str, tree: str | None = None) -> str:
    """Database `db` of `dsn`'s server, created if missing and migrated by the build on PYTHONPATH
    (or in `tree`); its jobs and rows emptied. Its DSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,)).fetchone():
            conn.execute(f'CREATE DATABASE "{db}"')
    target = make_conninfo(dsn, dbname=db)
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--migrate", target],
        check=True,
        stdout=subprocess.DEVNULL,
        env=None if tree is None else {**os.environ, "PYTHONPATH": tree},
    )
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(CREATE_ROWS)
        conn.execute(RESET)
        conn.execute("VACUUM ANALYZE")
    return target


def worker_main(
    target: str, write: bool, log: str | None, config: dict[str, Any], out: Any, ready: Any, start: Any
) -> None:
    if log:
        logging.basicConfig(
            filename=log, level=logging.DEBUG, format="%(created).6f %(process)d %(name)s %(message)s"
        )
    app = fastjobs.App(target)
    started: dict[int, float] = {}
    writes: list[float] = []  # each handler's write, its round trip and commit
    rows: list[psycopg.Connection[Any]] = []

    @app.job(kind=KIND)
    def handler(i: int) -> None:
        started[i] = time.time()
        if write:
            began = time.perf_counter()
            rows[0].execute(INSERT_ROW, (i,))
            writes.append(time.perf_counter() - began)

    def on_ready() -> None:
        if write:  # before the first job: an application's handler finds its connection open
            rows.append(psycopg.connect(target, autocommit=True, application_name="latency_call handler"))
        ready.wait()
        start.wait()

    worker = fastjobs.Worker(app, config=fastjobs.WorkerConfig(**config), on_ready=on_ready)
    worker.install_signals()
    worker.run()
    cpu = os.times()
    out.put((started, cpu.user + cpu.system, writes))


class Sampler(threading.Thread):
    """pg_stat_activity every `period` s: counts of (backend, wait) over the run."""

    def __init__(self, target: str, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.target, self.period = target, period
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.target, autocommit=True) as conn:
            while not self.stop.wait(self.period):
                self.samples += 1
                for app_name, state, wtype, wevent, query in conn.execute(ACTIVITY):
                    if state != "active":
                        continue
                    who = app_name or "fastjobs"
                    if who == "fastjobs":
                        q = (query or "").lstrip().upper()
                        who = (
                            "rotation"
                            if q.startswith(("LOCK", "TRUNCATE", "INSERT INTO FASTJOBS_JOBS_ALL (ID"))
                            else who
                        )
                    self.counts[f"{who} | {wtype or 'CPU'}:{wevent or '-'}"] += 1


def server_cpu() -> float:
    """CPU seconds of this machine's PostgreSQL processes so far (their backends, walwriter...): /proc."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read(9).startswith(b"postgres"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            continue
    return total / tick


def machine_busy() -> float:
    """CPU seconds every core spent busy so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def pct(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    return round(samples[min(len(samples) - 1, int(q * len(samples)))] * 1000, 3)


def main() -> int:
    if sys.argv[1:2] == ["--migrate"]:  # prepare's subprocess: this build's CLI, its migrations
        from fastjobs.cli import main as cli

        return cli(["--dsn", sys.argv[2], "migrate"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("FASTJOBS_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--db", default=os.environ.get("FASTJOBS_BENCH_DB", "fastjobs_bench_call"))
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument(
        "--no-write", dest="write", action="store_false", help="the handler only stamps a time"
    )
    parser.add_argument("--stages", action="store_true", help="split the call into INSERT and COMMIT")
    parser.add_argument("--waits", action="store_true", help="sample pg_stat_activity every 10 ms")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--config", default="{}", help="WorkerConfig fields, as JSON (e.g. '{\"rotate\": false}')"
    )
    parser.add_argument(
        "--dump", help="write each job's times (JSON lines: i, call, inserted, committed, started)"
    )
    parser.add_argument("--log", help="the workers' fastjobs log, DEBUG, with times (the rotations)")
    args = parser.parse_args()

    target = prepare(args.dsn, args.db)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    n = args.processes
    ready, start = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    procs = [
        ctx.Process(
            target=worker_main,
            args=(target, args.write, args.log, json.loads(args.config), out, ready, start),
        )
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    ready.wait()
    start.wait()
    sampler = Sampler(target) if args.waits else None
    if sampler:
        sampler.start()
    total = int(args.rate * args.seconds)
    sent: dict[int, tuple[float, float, float]] = {}  # i: (before the call, INSERT done, commit returned)
    # The rate's clock starts once every producer is connected: producers that connect after it
    # would first offer a burst of the jobs they are late with, not the rate.
    began = 0.0

    cpu_at: list[float] = []  # the server's and the machine's CPU when the clock started

    def start_clock() -> None:
        nonlocal began
        began = time.perf_counter()
        cpu_at.extend((server_cpu(), machine_busy()))

    connected = threading.Barrier(args.producers + 1, action=start_clock)

    def produce(index: int) -> None:
        app = fastjobs.App(target)
        with psycopg.connect(
            target, autocommit=not args.stages, application_name="latency_call producer"
        ) as conn:
            connected.wait()
            for i in range(index, total, args.producers):
                pause = began + i / args.rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                before = time.time()
                if args.stages:
                    app.enqueue(KIND, {"i": i}, conn=conn)
                    inserted = time.time()
                    conn.commit()
                else:
                    app.enqueue(KIND, {"i": i}, conn=conn)
                    inserted = 0.0
                sent[i] = (before, inserted, time.time())

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(args.producers)]
    for thread in threads:
        thread.start()
    connected.wait()
    for thread in threads:
        thread.join()
    achieved = total / (time.perf_counter() - began)
    with psycopg.connect(target, autocommit=True) as conn:
        pending = (
            PENDING_ALL if conn.execute("SELECT to_regclass('fastjobs_jobs_all')").fetchone()[0] else PENDING
        )  # type: ignore[index]
        deadline = time.monotonic() + 60
        while conn.execute(pending).fetchone()[0] and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.05)
    server_seconds, busy_seconds = server_cpu() - cpu_at[0], machine_busy() - cpu_at[1]
    if sampler:
        sampler.stop.set()
        sampler.join()
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)  # the graceful stop
    started: dict[int, float] = {}
    cpu = 0.0  # the worker processes' CPU seconds (loop, handlers, control threads)
    writes: list[float] = []
    for _ in procs:
        got, seconds, wrote = out.get(timeout=60)
        started.update(got)
        cpu += seconds
        writes += wrote
    for p in procs:
        p.join()
    keys = [i for i in started if i in sent]
    from_call = sorted(started[i] - sent[i][0] for i in keys)
    from_commit = sorted(started[i] - sent[i][2] for i in keys)
    call = sorted(sent[i][2] - sent[i][0] for i in keys)
    record: dict[str, Any] = {
        "label": args.label,
        "fastjobs": os.path.dirname(fastjobs.__file__),
        "at": time.strftime("%H:%M:%S"),
        "rate": args.rate,
        "achieved": round(achieved),
        "jobs": len(keys),
        "sent": len(sent),
        "write": args.write,
        "stages": args.stages,
        "loadavg": round(os.getloadavg()[0], 2),
        "worker_cpu_ms_per_job": round(cpu * 1000 / max(1, len(keys)), 3),
        # The processes of the machine's PostgreSQL, and the whole machine, from the clock's start
        # to the last job's end (a server elsewhere reads 0).
        "server_cpu_ms_per_job": round(server_seconds * 1000 / max(1, len(keys)), 3),
        "machine_cpu_ms_per_job": round(busy_seconds * 1000 / max(1, len(keys)), 3),
    }
    for name, samples in (
        ("call", from_call),
        ("commit", from_commit),
        ("enqueue", call),
        ("write", sorted(writes)),
    ):
        for q, tag in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (1.0, "max")):
            record[f"{name}_{tag}"] = pct(samples, q)
    if args.stages:
        insert = sorted(sent[i][1] - sent[i][0] for i in keys)
        commit = sorted(sent[i][2] - sent[i][1] for i in keys)
        for name, samples in (("insert", insert), ("commit_rt", commit)):
            for q, tag in ((0.5, "p50"), (0.99, "p99")):
                record[f"{name}_{tag}"] = pct(samples, q)
    if sampler:
        record["samples"] = sampler.samples
        record["waits"] = dict(sampler.counts.most_common(25))
    if args.dump:
        with open(args.dump, "w") as f:
            for i in sorted(keys):
                f.write(json.dumps([i, *sent[i], started[i]]) + "\n")
    echo(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
