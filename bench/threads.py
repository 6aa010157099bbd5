"""I/O-bound sync jobs under `fastjobs run`, with and without threads: jobs/s of `time.sleep(SLEEP)`.

    python bench/threads.py --dsn postgresql://... --jobs 2000 --processes 2 --queues default:20

Creates (or empties) the database `fastjobs_threads_bench` beside the DSN's,
enqueues the jobs, runs `fastjobs run` until they are done (completed rows
kept) and prints one JSON line: jobs/s from the first job's start to the
last one's end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

import fastjobs
from fastjobs import schema
from fastjobs.impl import IMPLEMENTATION

DB = "fastjobs_threads_bench"
MODULE = """
import time

import fastjobs

app = fastjobs.App()


@app.job("sleep")
def sleep(seconds):
    if seconds:
        time.sleep(seconds)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--queues", default="default:20")
    parser.add_argument("--sleep", type=float, default=0.05)
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(args.dsn, dbname=DB)
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn)
        conn.execute("TRUNCATE fastjobs_jobs RESTART IDENTITY")
    app = fastjobs.App(dsn)
    app.enqueue_many("sleep", ({"seconds": args.sleep} for _ in range(args.jobs)))
    app.close()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sleepjobs.py").write_text(MODULE)
        cmd = [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "run", "--keep-completed"]
        cmd += ["--processes", str(args.processes), "--queues", args.queues, "sleepjobs"]
        env = dict(os.environ, PYTHONPATH=tmp)
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stderr=subprocess.DEVNULL)
        try:
            left = "SELECT count(*) FROM fastjobs_jobs WHERE state <> 'completed'"
            with psycopg.connect(dsn, autocommit=True) as conn:
                while conn.execute(left).fetchone()[0]:  # type: ignore[index]
                    time.sleep(0.1)
                first, last, done = conn.execute(
                    "SELECT min(attempted_at), max(finalized_at), count(*) FROM fastjobs_jobs"
                ).fetchone()  # type: ignore[misc]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    seconds = (last - first).total_seconds()
    print(
        json.dumps(
            {
                "jobs": done,
                "processes": args.processes,
                "queues": args.queues,
                "sleep": args.sleep,
                "implementation": IMPLEMENTATION,
                "seconds": round(seconds, 3),
                "jobs_per_second": round(done / seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
