"""A peer beside fastjobs: procrastinate drains the same no-op jobs, with the raw-SQL limit in the same run.

    pip install procrastinate       # beside fastjobs; not a dependency of fastjobs
    python bench/peers.py --dsn postgresql://postgres@127.0.0.1:5432/postgres --jobs 20000 --repeat 3

The contenders alternate, each run on a fresh database of the bench's with the same jobs:
`raw_locked` (fastjobs' locked claim + DELETE, no fastjobs code: the fast lane's limit), fastjobs'
Worker processes (`fastjobs bench`'s `worker`), and procrastinate's workers. Each forks
`--processes` workers; procrastinate's run an `async` no-op task (its documentation: concurrency
is for async tasks) with `concurrency` as fastjobs' default slots per worker (10) and
`delete_jobs="always"`, as fastjobs deletes a completed job. Its jobs are enqueued with its own
`batch_defer` before the clock starts, so the figure is its drain alone. Ratios are against
`raw_locked` of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import statistics
import time
from typing import Any

import procrastinate
import psycopg

from fastjobs.bench import _drain_once, _fastjobs_drainer, _raw_drainer, bench_dsn, spread
from fastjobs.impl import IMPLEMENTATION

logger = logging.getLogger("bench.peers")
CONCURRENCY = 10  # fastjobs' default slots per worker: `fastjobs run` prints "default:10"


def _procrastinate_app(dsn: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop", queue="bench")
    async def noop() -> None:
        return None

    return app


def _procrastinate_worker(dsn: str, concurrency: int, ready: Any, start: Any) -> None:
    app = _procrastinate_app(dsn)
    ready.wait()
    start.wait()
    # wait=False: the worker exits once no job is left, as fastjobs' exit_when_empty.
    app.run_worker(queues=["bench"], concurrency=concurrency, wait=False, delete_jobs="always")


def _procrastinate_once(dsn: str, jobs: int, processes: int, concurrency: int) -> float:
    """Fresh schema, `jobs` deferred in one batch, then `processes` workers started together."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    app = _procrastinate_app(dsn)

    async def prepare() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            task = app.tasks["noop"]
            for first in range(0, jobs, 10_000):
                await task.batch_defer_async(*({} for _ in range(min(10_000, jobs - first))))

    asyncio.run(prepare())
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            try:
                _procrastinate_worker(dsn, concurrency, ready, start)
            except BaseException:
                logger.exception("procrastinate worker failed")
                os._exit(1)
            os._exit(0)
        pids.append(pid)
    ready.wait()
    start.wait()
    began = time.perf_counter()
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"a procrastinate worker failed (status {status})")
    seconds = time.perf_counter() - began
    with psycopg.connect(dsn) as conn:
        left = conn.execute("SELECT count(*) FROM procrastinate_jobs").fetchone()
    if left != (0,):
        raise SystemExit(f"procrastinate left {left} jobs")
    return seconds


def _peer_dsn(dsn: str) -> str:
    """A database of the peer's own beside the bench's, created empty."""
    name = "fastjobs_bench_peer"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("FASTJOBS_DSN"), required="FASTJOBS_DSN" not in os.environ
    )
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="procrastinate's, per worker")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # procrastinate warns that an App made in __main__ is not found by its own CLI: this bench has none.
    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    target, peer = bench_dsn(options.dsn), _peer_dsn(options.dsn)

    def echo(text: str) -> None:  # the drains' progress lines: their finished lines only
        if not text.startswith("\r"):
            logger.info(text.rstrip("\n"))

    rates: dict[str, list[float]] = {"raw_locked": [], "worker": [], "procrastinate": []}
    for run in range(options.repeat):
        for name in rates:
            if name == "raw_locked":
                raw_args = (options.batch, False, True)
                seconds, _ = _drain_once(
                    target, options.jobs, options.processes, _raw_drainer, raw_args, echo
                )
            elif name == "worker":
                args = (options.batch, True, False, False)
                seconds, _ = _drain_once(
                    target, options.jobs, options.processes, _fastjobs_drainer, args, echo
                )
            else:
                seconds = _procrastinate_once(peer, options.jobs, options.processes, options.concurrency)
            rates[name].append(options.jobs / seconds)
            logger.info(
                f"  run {run + 1}/{options.repeat} {name:14s} {options.jobs / seconds:>10,.0f} jobs/s",
            )
    limit = statistics.median(rates["raw_locked"])
    labels = {
        "raw_locked": "raw SQL: locked claim + DELETE",
        "worker": f"fastjobs workers ({IMPLEMENTATION})",
        "procrastinate": f"procrastinate {procrastinate.__version__} (concurrency {options.concurrency})",
    }
    with psycopg.connect(options.dsn) as conn:
        version = conn.info.server_version
    logger.info(
        f"\ndrain of {options.jobs:,} no-op jobs, {options.processes} processes, PostgreSQL {version}"
    )
    logger.info(f"{'':<34}{'jobs/s':>10}{'runs min-max':>20}{'ratio':>8}")
    for name, runs in rates.items():
        rate = statistics.median(runs)
        logger.info(f"{labels[name]:<34}{rate:>10,.0f}{spread(runs):>20}{rate / limit:>8.2f}")
    logger.info("ratio: against the raw locked claim + DELETE of the same run (one write per job)")


if __name__ == "__main__":
    main()
