"""Issue 26 §4's figures: fair sharing across keys, with `fastjobs run --processes 2`.

The issue's case: 100,000 no-op jobs of tenant A enqueued first (one COPY), then 100 of tenant B;
the workers are already running. Reported: B's wait from its enqueue's commit to each job's start
(p50, p99, last), and how many A jobs ran before the last B job started, with fairness (every job
keyed by its tenant) against the same jobs without keys, alternating. Each A job counts itself in
its process and writes its count every 50 jobs; each B job writes its start and that count.

Drain: 100,000 no-op jobs without keys, with 10 keys and with 10,000 keys (round-robin over the
keys, enqueued in key order), from one COPY's commit to the last job's end, alternating.

Run it against a database of its own:
    python bench/fairness.py postgresql://.../db [REPEAT] [case,drain]
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from fastjobs import App, schema

JOBS = """
import os

import psycopg

import fastjobs

app = fastjobs.App()
_state = {}


def _conn():
    if _state.get("pid") != os.getpid():
        _state.clear()
        _state.update(pid=os.getpid(), a=0, conn=psycopg.connect(os.environ["FAIR_DSN"], autocommit=True))
    return _state["conn"]


@app.job("tenant", queue="fair", fair_key="tenant")
def tenant(tenant, n):
    conn = _conn()
    if tenant == "A":
        _state["a"] += 1
    if tenant == "B" or _state["a"] % 50 == 0:
        row = (tenant, os.getpid(), _state["a"])
        conn.execute("INSERT INTO fair_runs (tenant, pid, a) VALUES (%s, %s, %s)", row)


@app.job("keyed", queue="fair")
def keyed(tenant, n):
    pass


@app.job("noop", queue="fair")
def noop(n):
    pass
"""

JOBS_COUNT = 100_000
B_JOBS = 100

logger = logging.getLogger("fairness")


@contextmanager
def _running(dsn: str, folder: str) -> Iterator[None]:
    """`fastjobs run --processes 2` on queue `fair`, its workers idle and ready."""
    command = [
        sys.executable,
        "-m",
        "fastjobs.cli",
        "--dsn",
        dsn,
        "run",
        "--processes",
        "2",
        "--queues",
        "fair",
    ]
    env = {**os.environ, "FAIR_DSN": dsn}
    master = subprocess.Popen([*command, "fairjobs"], cwd=folder, env=env, stderr=subprocess.DEVNULL)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while (conn.execute("SELECT count(*) FROM fastjobs_workers").fetchone() or (0,))[0] < 2:
                time.sleep(0.05)
        time.sleep(1.0)
        yield
    finally:
        master.terminate()
        master.wait(timeout=60)


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn, dsn=dsn)
        conn.execute("DROP TABLE IF EXISTS fair_runs")
        conn.execute(
            "CREATE TABLE fair_runs (tenant text, pid int, a int, at timestamptz DEFAULT clock_timestamp())"
        )
        conn.execute("TRUNCATE fastjobs_jobs_all")
        conn.execute("DELETE FROM fastjobs_workers")


def _wait_empty(conn: psycopg.Connection[object], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT EXISTS (SELECT FROM fastjobs_jobs_all WHERE queue = 'fair')").fetchone() != (
        False,
    ):
        if time.monotonic() > deadline:
            raise TimeoutError("the queue did not drain")
        time.sleep(0.01)


def case(dsn: str, folder: str, fair: bool) -> dict[str, float]:
    """The issue's case once: B's waits and the A jobs that ran before the last B started."""
    _reset(dsn)
    app = App(dsn)  # the kind is the workers': enqueued with the call's key, or none
    with _running(dsn, folder), psycopg.connect(dsn, autocommit=True) as conn:
        a_key, b_key = ({"fair_key": "A"}, {"fair_key": "B"}) if fair else ({}, {})
        app.enqueue_many(
            "tenant", ({"tenant": "A", "n": n} for n in range(JOBS_COUNT)), queue="fair", **a_key
        )
        app.enqueue_many("tenant", ({"tenant": "B", "n": n} for n in range(B_JOBS)), queue="fair", **b_key)
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        enqueued = row[0]
        _wait_empty(conn)
        waits = [
            w
            for (w,) in conn.execute(
                "SELECT extract(epoch FROM at - %s)::float8 FROM fair_runs WHERE tenant = 'B' ORDER BY at",
                (enqueued,),
            )
        ]
        last = conn.execute("SELECT max(at) FROM fair_runs WHERE tenant = 'B'").fetchone()
        assert last is not None
        before = conn.execute(
            "SELECT coalesce(sum(a), 0)"
            " FROM (SELECT max(a) AS a FROM fair_runs WHERE at <= %s GROUP BY pid) AS p",
            (last[0],),
        ).fetchone()
        assert before is not None
    app.close()
    waits.sort()
    return {
        "p50": statistics.median(waits),
        "p99": waits[int(0.99 * (len(waits) - 1))],
        "last": waits[-1],
        "a_before_last_b": float(before[0]),
    }


def drain(dsn: str, folder: str, keys: int) -> float:
    """Jobs per second draining JOBS_COUNT no-op jobs with `keys` fairness keys (0: none)."""
    _reset(dsn)
    app = App(dsn)
    app.job("keyed", queue="fair", fair_key="tenant")(lambda tenant, n: None)
    app.declare("noop", queue="fair")
    with _running(dsn, folder), psycopg.connect(dsn, autocommit=True) as conn:
        if keys:
            app.enqueue_many("keyed", ({"tenant": f"k{n % keys}", "n": n} for n in range(JOBS_COUNT)))
        else:
            app.enqueue_many("noop", ({"n": n} for n in range(JOBS_COUNT)))
        began = time.perf_counter()  # the COPY's commit made every job visible
        _wait_empty(conn)
        seconds = time.perf_counter() - began
    app.close()
    return JOBS_COUNT / seconds


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dsn = sys.argv[1]
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    folder = tempfile.mkdtemp()
    Path(folder, "fairjobs.py").write_text(textwrap.dedent(JOBS))
    only = sys.argv[3] if len(sys.argv) > 3 else "case,drain"
    for _ in range(repeat if "case" in only else 0):
        for fair in (False, True):
            figures = case(dsn, folder, fair)
            logger.info(
                "%s: B waits p50 %.3f s, p99 %.3f s, last %.3f s; A jobs run before the last B: %d",
                "fair" if fair else "plain",
                figures["p50"],
                figures["p99"],
                figures["last"],
                figures["a_before_last_b"],
            )
    for _ in range(repeat if "drain" in only else 0):
        rates = {keys: drain(dsn, folder, keys) for keys in (0, 10, 10_000)}
        logger.info(
            "drain: no keys %.0f jobs/s; 10 keys %.0f (%.2f x); 10,000 keys %.0f (%.2f x)",
            rates[0],
            rates[10],
            rates[10] / rates[0],
            rates[10_000],
            rates[10_000] / rates[0],
        )


if __name__ == "__main__":
    main()
