"""Issue 22's case: 3,000 quick jobs and one of the same kind that sleeps 15 s, under
`fastjobs run --processes 2`; how long the quick ones wait on the slow one.

Each run records every execution's start in a table of its own; it prints
the quick jobs not yet done 14 s after the slow job started, and when the
last quick one started, counted from the slow one's start. Run it from the
build to measure (PYTHONPATH=<tree>), against a database of its own:
    PYTHONPATH=<tree> python bench/hostage.py postgresql://.../db [--no-fast-lane]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psycopg

import fastjobs
from fastjobs import App, schema

QUICK, SLOW_AT, SLOW = 3_000, 1_500, 15.0

JOBS = """
import os
import time

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {}


@app.job("hostage")
def hostage(n, sleep=0.0):
    if os.getpid() not in _conn:
        _conn.clear()
        _conn[os.getpid()] = psycopg.connect(os.environ["HOSTAGE_DSN"], autocommit=True)
    _conn[os.getpid()].execute("INSERT INTO hostage_runs (n) VALUES (%s)", (n,))
    if sleep:
        time.sleep(sleep)
"""


def main() -> None:
    dsn, options = sys.argv[1], sys.argv[2:]
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.migrate(conn, dsn=dsn)
        conn.execute("DROP TABLE IF EXISTS hostage_runs")
        conn.execute("CREATE TABLE hostage_runs (n int, at timestamptz DEFAULT clock_timestamp())")
        conn.execute("DELETE FROM fastjobs_jobs_all")
    producer = App(dsn)
    producer.enqueue_many(
        "hostage", ({"n": n, "sleep": SLOW if n == SLOW_AT else 0.0} for n in range(QUICK + 1))
    )
    producer.close()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "hostagejobs.py").write_text(textwrap.dedent(JOBS))
        env = {**os.environ, "HOSTAGE_DSN": dsn}
        command = [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "run", "--processes", "2", *options]
        master = subprocess.Popen([*command, "hostagejobs"], cwd=folder, env=env, stderr=subprocess.DEVNULL)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    (left,) = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()  # type: ignore[misc]
                    if not left:
                        break
                    time.sleep(0.2)
                (waiting, last) = conn.execute(
                    "SELECT count(*) FILTER (WHERE r.at > s.at + interval '14 s')"
                    "       + %s - count(*) FILTER (WHERE r.n <> %s),"
                    "       extract(epoch FROM max(r.at) FILTER (WHERE r.n <> %s) - s.at)"
                    "  FROM hostage_runs r, (SELECT at FROM hostage_runs WHERE n = %s) s GROUP BY s.at",
                    (QUICK, SLOW_AT, SLOW_AT, SLOW_AT),
                ).fetchone()  # type: ignore[misc]
        finally:
            master.terminate()
            master.wait(60)
    print(
        f"{fastjobs.__file__} {' '.join(options) or '(fast lane on)'}: 14 s after the slow job started,"
        f" {waiting} of {QUICK} quick jobs not started; the last started {last:+.2f} s after it"
    )


if __name__ == "__main__":
    main()
