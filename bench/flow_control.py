"""Issue 26's figures: a queue's rate limit and concurrency limit held by `fastjobs run --processes 4`.

Rate: a backlog of no-op jobs on a queue limited to RATE/s, drained for SECONDS; the jobs started
per second over the window (from each execution's start, recorded in a table), against the rate.
Concurrency: a backlog of jobs sleeping 20 ms on a queue limited to 5 at once; the most running,
sampled from the database every few milliseconds, and the jobs per second against 5 / 20 ms.
Run it against a database of its own:
    python bench/flow_control.py postgresql://.../db [RATE] [SECONDS]
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psycopg

from fastjobs import App, schema

JOBS = """
import os
import time

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {}


@app.job("flow")
def flow(n, sleep=0.0):
    if os.getpid() not in _conn:
        _conn.clear()
        _conn[os.getpid()] = psycopg.connect(os.environ["FLOW_DSN"], autocommit=True)
    _conn[os.getpid()].execute("INSERT INTO flow_runs (n) VALUES (%s)", (n,))
    if sleep:
        time.sleep(sleep)
"""

logger = logging.getLogger("flow_control")


def _run(dsn: str, folder: str, queue: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "fastjobs.cli",
        "--dsn",
        dsn,
        "run",
        "--processes",
        "4",
        "--queues",
        queue,
    ]
    env = {**os.environ, "FLOW_DSN": dsn}
    return subprocess.Popen([*command, "flowjobs"], cwd=folder, env=env, stderr=subprocess.DEVNULL)


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn, dsn=dsn)
        conn.execute("DROP TABLE IF EXISTS flow_runs")
        conn.execute("CREATE TABLE flow_runs (n int, at timestamptz DEFAULT clock_timestamp())")
        conn.execute("DELETE FROM fastjobs_jobs_all")
        conn.execute("DELETE FROM fastjobs_queues")


def rate(dsn: str, folder: str, per_second: int, seconds: float) -> None:
    _reset(dsn)
    app = App(dsn)
    app.enqueue_many("flow", ({"n": n} for n in range(int(per_second * (seconds + 10)))), queue="paced")
    app.limit_queue("paced", rate_limit=f"{per_second}/s")
    app.close()
    master = _run(dsn, folder, "paced")
    try:
        time.sleep(seconds + 5)
    finally:
        master.terminate()
        master.wait(60)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The window starts 2 s after the first start: the bucket's first second and the workers' start-up.
        row = conn.execute(
            "SELECT count(*) FROM flow_runs, (SELECT min(at) AS first FROM flow_runs) f"
            " WHERE at >= f.first + interval '2 s' AND at < f.first + interval '2 s' + %s * interval '1 s'",
            (seconds,),
        ).fetchone()
        assert row is not None
    measured = row[0] / seconds
    logger.info(
        "rate limit %d/s, 4 processes, %g s window: %.1f jobs/s started (%.3f x the limit)",
        per_second,
        seconds,
        measured,
        measured / per_second,
    )


def concurrency(dsn: str, folder: str, limit: int, seconds: float) -> None:
    _reset(dsn)
    app = App(dsn)
    sleep = 0.02
    app.enqueue_many(
        "flow", ({"n": n, "sleep": sleep} for n in range(int(limit / sleep * (seconds + 5)))), queue="few"
    )
    app.limit_queue("few", concurrency=limit)
    app.close()
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute(
                    "SELECT count(*) FROM fastjobs_jobs_all WHERE queue = 'few' AND state = 'running'"
                ).fetchone()
                assert row is not None
                seen.append(row[0])

    sampler = threading.Thread(target=sample)
    sampler.start()
    master = _run(dsn, folder, "few")
    try:
        time.sleep(seconds + 3)
    finally:
        done.set()
        sampler.join()
        master.terminate()
        master.wait(60)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM flow_runs, (SELECT min(at) AS first FROM flow_runs) f"
            " WHERE at >= f.first + interval '2 s' AND at < f.first + interval '2 s' + %s * interval '1 s'",
            (seconds,),
        ).fetchone()
        assert row is not None
    measured = row[0] / seconds
    logger.info(
        "concurrency %d, jobs of %g ms, 4 processes: at most %d running in %d samples; %.1f jobs/s"
        " (%.2f x the limit's %.0f/s)",
        limit,
        sleep * 1000,
        max(seen),
        len(seen),
        measured,
        measured / (limit / sleep),
        limit / sleep,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dsn = sys.argv[1]
    per_second = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "flowjobs.py").write_text(textwrap.dedent(JOBS))
        rate(dsn, folder, per_second, seconds)
        concurrency(dsn, folder, 5, min(seconds, 20.0))


if __name__ == "__main__":
    main()
