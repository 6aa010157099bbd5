"""`fastjobs bench --producers N`: single enqueues from N concurrent producers beside raw INSERTs.

Web applications enqueue one job per request from many processes, each
enqueue its own transaction: what counts there is how commits share their WAL
flush. Three contenders, each run by N producers for the same seconds, in the
same run, against one database:

- raw: `INSERT` into `fastjobs_bench_plain`, a table like fastjobs_jobs
  (columns, defaults, indexes) without its trigger, the very statement
  app.enqueue sends: the limit;
- trigger: the same `INSERT` into fastjobs_jobs, its wake-up trigger included;
- fastjobs: `app.enqueue`, on the pool of connections `App` keeps.

Producers are processes by default, as a web application's workers are: each
has its own interpreter, so the client's GIL cannot become the bottleneck of
the measurement. `threads=True` runs them as threads of one process instead
(psycopg releases the GIL while it waits), to compare.
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg

from ..app import App
from ..impl import IMPLEMENTATION
from ..types import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE
from . import BENCH_KIND, _noop, _record, _reset, _write, bench_dsn, queries

CONTENDERS = ("raw", "trigger", "fastjobs")
LABELS = {
    "raw": "raw INSERT, no trigger",
    "trigger": "raw INSERT into fastjobs_jobs",
    "fastjobs": f"app.enqueue ({IMPLEMENTATION})",
}


def _produce(dsn: str, name: str, begin: float, until: float) -> int:
    """Connect, then enqueue one job per transaction from `begin` to `until` (time.time()); how many."""
    count = 0
    if name == "fastjobs":
        app = App(dsn)
        app.job(kind=BENCH_KIND)(_noop)
        with app.connection():  # the pool's connection is opened before the clock starts
            pass
        time.sleep(max(0.0, begin - time.time()))
        while time.time() < until:
            app.enqueue(BENCH_KIND, {"i": count})
            count += 1
        app.close()
        return count
    statement = queries.bench_plain_insert if name == "raw" else queries.bench_trigger_insert
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn, psycopg.RawCursor(conn) as cur:
        time.sleep(max(0.0, begin - time.time()))
        while time.time() < until:
            args = orjson.dumps({"i": count}).decode()
            cur.execute(statement, (DEFAULT_QUEUE, BENCH_KIND, args, DEFAULT_PRIORITY, DEFAULT_MAX_ATTEMPTS))
            cur.fetchone()
            count += 1
    return count


def _process(dsn: str, name: str, seconds: float, ready: Any, start: Any, until: Any, out: Any) -> None:
    ready.wait()
    start.wait()
    out.put(_produce(dsn, name, until.value - seconds, until.value))


def _once(dsn: str, name: str, producers: int, seconds: float, threads: bool) -> tuple[int, float]:
    """One contender's run: (jobs committed, producers' CPU seconds)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(queries.bench_plain_reset)
    _reset(dsn)
    counts: list[int] = []
    if threads:
        before = resource.getrusage(resource.RUSAGE_SELF)
        begin = time.time() + 0.5  # every thread connects first: the clock starts together
        workers = [
            threading.Thread(target=lambda: counts.append(_produce(dsn, name, begin, begin + seconds)))
            for _ in range(producers)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return sum(counts), cpu
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Barrier(producers + 1), ctx.Barrier(producers + 1)
    until = ctx.Value("d", 0.0)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process, args=(dsn, name, seconds, ready, start, until, out))
        for _ in range(producers)
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for p in procs:
        p.start()
    ready.wait()
    until.value = time.time() + 0.3 + seconds

    start.wait()
    for _ in procs:
        counts.append(out.get(timeout=seconds + 60))
    for p in procs:
        p.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(counts), after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def run_producers(
    dsn: str,
    producers: int,
    seconds: float,
    repeat: int,
    threads: bool,
    results: Path | None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """Each contender `repeat` times, alternating, for `seconds`; medians of jobs/s and of the ratios."""
    return measure(bench_dsn(dsn), producers, seconds, repeat, threads, results, echo)


def measure(
    target: str,
    producers: int,
    seconds: float,
    repeat: int,
    threads: bool,
    results: Path | None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """`run_producers` on the migrated database `target`, whose jobs it deletes."""
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(queries.bench_plain_create)
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    kind = "threads" if threads else "processes"
    echo(f"producers: {producers} {kind}, one job per transaction, {seconds:g} s each\n")
    for run in range(repeat):
        for name in CONTENDERS:
            jobs, used = _once(target, name, producers, seconds, threads)
            rates[name].append(jobs / seconds)
            cpu[name].append(used / max(jobs, 1) * 1e6)
            echo(
                f"  run {run + 1}/{repeat} {name:9s} {jobs / seconds:>10,.0f} jobs/s"
                f"   producer CPU {cpu[name][-1]:6.1f} us/job\n"
            )
    # The ratio of each run to the raw figure of the same run, then their median:
    # the machine's drift between runs cancels out.
    ratios = {
        name: statistics.median(r / raw for r, raw in zip(rates[name], rates["raw"], strict=True))
        for name in CONTENDERS
    }
    medians = {name: statistics.median(r) for name, r in rates.items()}
    record = _record(
        "producers",
        target,
        producers=producers,
        producer_kind=kind,
        seconds=seconds,
        repeat=repeat,
        **{f"{name}_jobs_per_s": round(medians[name]) for name in CONTENDERS},
        **{f"{name}_cpu_us_per_job": round(statistics.median(cpu[name]), 1) for name in CONTENDERS},
        **{f"{name}_ratio": round(ratios[name], 3) for name in CONTENDERS if name != "raw"},
        runs={name: [round(r) for r in rates[name]] for name in CONTENDERS},
    )
    echo(f"\n{f'{producers} producers':<32}{'jobs/s':>10}{'ratio':>8}\n")
    for name in CONTENDERS:
        echo(f"{LABELS[name]:<32}{medians[name]:>10,.0f}{ratios[name]:>8.2f}\n")
    _write(results, record, echo)
    return record
