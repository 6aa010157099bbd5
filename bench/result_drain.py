"""A drain of jobs that keep their result beside one of jobs that do not, one worker in-process.

    python bench/result_drain.py [JOBS] [RUNS] [DSN]

Each run enqueues JOBS no-op jobs (one COPY) that return a small dict, with
keep_result or without, and times one Worker (the hot loop, both lanes as
`fastjobs run` chooses) draining them; the two kinds alternate, RUNS times
each. Prints the median jobs/s of each and their ratio, and the load average.
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
from fastjobs.worker import Worker, WorkerConfig

DB = "fastjobs_bench_result_drain"

app = fastjobs.App()


@app.job(kind="bench.plain")
def plain(n: int) -> dict[str, int]:
    return {"n": n}


@app.job(kind="bench.kept", keep_result=3600)
def kept(n: int) -> dict[str, int]:
    return {"n": n}


def _drain(dsn: str, job: fastjobs.Job[..., dict[str, int]], jobs: int) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE fastjobs_jobs_all, fastjobs_results")
        conn.execute("VACUUM ANALYZE fastjobs_jobs_all")
    job.enqueue_many({"n": n} for n in range(jobs))
    worker = Worker(app, None, config=WorkerConfig(), exit_when_empty=True)
    began = time.perf_counter()
    worker.run()
    return jobs / (time.perf_counter() - began)


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    server = sys.argv[3] if len(sys.argv) > 3 else os.environ["FASTJOBS_DSN"]
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(server, dbname=DB)
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn)
    app.configure(dsn=dsn)
    rates: dict[str, list[float]] = {"plain": [], "kept": []}
    for _ in range(runs):
        rates["plain"].append(_drain(dsn, plain, jobs))
        rates["kept"].append(_drain(dsn, kept, jobs))
    with psycopg.connect(dsn) as conn:
        count = conn.execute("SELECT count(*) FROM fastjobs_results").fetchone()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"drain of {jobs} jobs, 1 worker, {runs} runs each ({fastjobs.impl.IMPLEMENTATION}):"
        f" without keep_result {medians['plain']:,.0f} jobs/s, with {medians['kept']:,.0f} jobs/s"
        f" ({medians['kept'] / medians['plain']:.2f} x;"
        f" results kept by the last run: {count[0] if count else 0});"
        f" runs {[round(r) for r in rates['plain']]} / {[round(r) for r in rates['kept']]};"
        f" load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
