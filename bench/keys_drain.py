"""Issue 26 §2's figure: a drain of jobs limited per key against the unlimited drain, in the same run.

JOBS no-op jobs drained by PROCESSES forked Worker processes (the hot loop alone, as
`fastjobs bench --drain-only`'s "worker"), three ways, alternating, REPEAT times each:
  unlimited        the kind without limits (its queue may take the fast lane: the default);
  unlimited_state  the same on the state lane only (WorkerConfig(fast_lane=False)), the lane
                   every keyed claim takes;
  keyed            the kind declared with concurrency_key="tenant", concurrency_limit=LIMIT, the
                   jobs spread over KEYS tenants (enqueued round-robin).
The keyed drain also samples, from the database every few milliseconds, the most jobs of one
key running at once: `running` rows, so the state lane's; a fast-lane batch's jobs in flight stay
`available` in the table and are not seen (tests/test_keys.py's property test counts them from
the handlers' own records). Prints jobs/s (median, min-max) and the ratios. Run it against a database
of its own (its jobs are deleted):
    python bench/keys_drain.py postgresql://.../db [JOBS] [PROCESSES] [REPEAT] [KEYS] [LIMIT]
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Any

import psycopg

from fastjobs import App, schema
from fastjobs.impl import IMPLEMENTATION
from fastjobs.worker import Worker, WorkerConfig

logger = logging.getLogger("keys_drain")
KIND = "bench.keyed"


def _app(dsn: str, keyed: bool, limit: int) -> App:
    app = App(dsn)
    options: dict[str, Any] = {"concurrency_key": "tenant", "concurrency_limit": limit} if keyed else {}
    app.job(kind=KIND, **options)(lambda tenant: None)
    return app


def _drainer(dsn: str, keyed: bool, limit: int, fast_lane: bool, ready: Any, start: Any) -> None:
    try:
        app = _app(dsn, keyed, limit)

        def on_ready() -> None:
            ready.wait()
            start.wait()

        Worker(app, config=WorkerConfig(fast_lane=fast_lane), exit_when_empty=True, on_ready=on_ready).run()
    except BaseException:
        logger.exception("drainer %d failed", os.getpid())
        os._exit(1)
    os._exit(0)


def _most_running(dsn: str, done: threading.Event, seen: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.is_set():
            row = conn.execute(
                "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM fastjobs_jobs_all"
                " WHERE state = 'running' AND limit_key IS NOT NULL GROUP BY limit_key) AS k"
            ).fetchone()
            assert row is not None
            seen.append(row[0])
            time.sleep(0.005)


def drain_once(dsn: str, jobs: int, processes: int, keys: int, limit: int, how: str) -> tuple[float, int]:
    """Seconds to drain `jobs` jobs `how` (see the module's docstring), and the most of one key running."""
    keyed = how == "keyed"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM fastjobs_jobs_all")
        conn.execute("DELETE FROM fastjobs_limits")
        conn.execute("VACUUM ANALYZE fastjobs_jobs_all")
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            _drainer(dsn, keyed, limit, how != "unlimited_state", ready, start)
        pids.append(pid)
    ready.wait()
    app = _app(dsn, keyed, limit)
    app.enqueue_many(KIND, ({"tenant": f"t{n % keys}"} for n in range(jobs)))
    app.close()
    seen: list[int] = []
    done = threading.Event()
    sampler = threading.Thread(target=_most_running, args=(dsn, done, seen))
    sampler.start()
    start.wait()
    began = time.perf_counter()
    try:
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if status:
                raise RuntimeError(f"a drainer failed ({status})")
    finally:
        done.set()
        sampler.join()
    return time.perf_counter() - began, max(seen, default=0)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dsn = sys.argv[1]
    jobs, processes, repeat, keys, limit = (
        int(a) for a in [*sys.argv[2:], "100000", "4", "3", "1000", "5"][:5]
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn, dsn=dsn)
    hows = ("unlimited", "unlimited_state", "keyed")
    rates: dict[str, list[float]] = {how: [] for how in hows}
    most = 0
    for run in range(repeat):
        for how in hows:
            seconds, running = drain_once(dsn, jobs, processes, keys, limit, how)
            rates[how].append(jobs / seconds)
            if how == "keyed":
                most = max(most, running)
            logger.info("run %d %-16s %8.0f jobs/s", run + 1, how, jobs / seconds)
    median = {how: statistics.median(r) for how, r in rates.items()}
    logger.info(
        "%s, %d jobs, %d processes, %d keys limited to %d each (%s)",
        IMPLEMENTATION,
        jobs,
        processes,
        keys,
        limit,
        os.environ.get("FASTJOBS_IMPL", "c"),
    )
    for how in hows:
        logger.info(
            "%-16s %8.0f jobs/s (runs %.0f-%.0f)  %.2f x unlimited  %.2f x unlimited_state",
            how,
            median[how],
            min(rates[how]),
            max(rates[how]),
            median[how] / median["unlimited"],
            median[how] / median["unlimited_state"],
        )
    logger.info(
        "keyed: at most %d jobs of one key running, sampled from the database (limit %d)", most, limit
    )


if __name__ == "__main__":
    main()
