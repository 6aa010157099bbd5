"""Enqueue and drain without a schema (the search_path's) beside App(schema=...), in one database.

    python bench/schema_cost.py [JOBS] [RUNS] [DSN]

Each run, for each of the two installations (public, and the schema
`bench_schema`), in turn: JOBS single enqueues on fastjobs' own pool (the
insert_own path) and, separately, on a caller's connection in autocommit
(RawCursor), each job one statement; one enqueue_many of JOBS (COPY); and
one Worker in-process (the hot loop, both lanes as `fastjobs run` chooses)
draining those. RUNS times each, alternating; prints the medians and the
ratios (schema / none), and the load average.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import psycopg
from psycopg.conninfo import make_conninfo

import fastjobs
from fastjobs import schema
from fastjobs.impl import IMPLEMENTATION
from fastjobs.worker import Worker, WorkerConfig

DB = "fastjobs_bench_schema_cost"
SCHEMA = "bench_schema"


def _app(dsn: str, name: str | None) -> tuple[fastjobs.App, fastjobs.Job[..., None]]:
    app = fastjobs.App(dsn, schema=name)

    @app.job(kind="bench.noop")
    def noop(n: int) -> None:
        pass

    return app, noop


def _reset(dsn: str, name: str | None) -> None:
    table = "fastjobs_jobs_all" if name is None else f'"{name}".fastjobs_jobs_all'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        conn.execute(f"VACUUM ANALYZE {table}")


def _run(dsn: str, name: str | None, jobs: int) -> dict[str, float]:
    rates = {}
    app, noop = _app(dsn, name)
    try:
        _reset(dsn, name)
        began = time.perf_counter()
        for n in range(jobs):
            noop.enqueue(n=n)
        rates["enqueue (own pool)"] = jobs / (time.perf_counter() - began)
        with psycopg.connect(dsn, autocommit=True) as conn:
            caller = noop.using(conn)
            began = time.perf_counter()
            for n in range(jobs):
                caller.enqueue(n=n)
            rates["enqueue (conn=)"] = jobs / (time.perf_counter() - began)
        _reset(dsn, name)
        began = time.perf_counter()
        noop.enqueue_many({"n": n} for n in range(jobs))
        rates["enqueue_many (COPY)"] = jobs / (time.perf_counter() - began)
        worker = Worker(app, None, config=WorkerConfig(), exit_when_empty=True)
        began = time.perf_counter()
        worker.run()
        rates["drain (1 worker)"] = jobs / (time.perf_counter() - began)
    finally:
        app.close()
    return rates


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    server = sys.argv[3] if len(sys.argv) > 3 else os.environ["FASTJOBS_DSN"]
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(server, dbname=DB)
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn)
        schema.migrate(conn, schema=SCHEMA)
    found: dict[str | None, list[dict[str, float]]] = {None: [], SCHEMA: []}
    for run in range(runs):
        for name in (None, SCHEMA) if run % 2 == 0 else (SCHEMA, None):
            found[name].append(_run(dsn, name, jobs))
    print(f"{IMPLEMENTATION} implementation, {jobs:,} jobs, medians of {runs} runs, load {os.getloadavg()}")
    print(f"{'':24}{'no schema':>12}{SCHEMA:>14}{'ratio':>8}")
    for what in found[None][0]:
        plain = statistics.median(r[what] for r in found[None])
        named = statistics.median(r[what] for r in found[SCHEMA])
        print(f"{what:24}{plain:>12,.0f}{named:>14,.0f}{named / plain:>8.2f}")


if __name__ == "__main__":
    main()
