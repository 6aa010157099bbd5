"""The wait of App.result after a job completes: from its handler's return to the waiter's wake-up.

    python bench/result_wait.py [JOBS] [DSN]

A worker (one process, the hot loop) runs jobs that return the wall clock
as they end; the waiter enqueues one, calls `result()` at once and, woken by
the notification, takes the difference: the finish statement, its commit,
the notification's delivery and the waiter's look at the table. Jobs go one
at a time (each waited for), so the worker's pickup latency is not counted.
Prints p50, p90, p99 and max in milliseconds, and the load average.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

import psycopg
from psycopg.conninfo import make_conninfo

import fastjobs
from fastjobs import schema
from fastjobs.worker import Worker, WorkerConfig

DB = "fastjobs_bench_result_wait"

app = fastjobs.App()


@app.job(kind="bench.stamp", keep_result=600)
def stamp() -> float:
    return time.time()


def _work() -> None:
    Worker(app, None, config=WorkerConfig()).run()


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    server = sys.argv[2] if len(sys.argv) > 2 else os.environ["FASTJOBS_DSN"]
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(server, dbname=DB)
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE fastjobs_jobs_all, fastjobs_results")
    app.configure(dsn=dsn)
    worker = multiprocessing.get_context("fork").Process(target=_work, daemon=True)
    worker.start()
    try:
        stamp.enqueue().result(timeout=30)  # the worker is up
        waits = []
        for _ in range(jobs):
            ended = stamp.enqueue().result(timeout=30)
            waits.append((time.time() - ended) * 1000)
    finally:
        worker.terminate()
        worker.join(10)
    waits.sort()
    q = statistics.quantiles(waits, n=100)
    print(
        f"result() after completion, {jobs} jobs: p50 {q[49]:.2f} ms, p90 {q[89]:.2f} ms,"
        f" p99 {q[98]:.2f} ms, max {waits[-1]:.2f} ms; load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
