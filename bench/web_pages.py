"""The dashboard's pages on 10 million jobs: each page's answer time over HTTP (issue 27).

    python bench/web_pages.py [ROWS] [DSN] [--keep]

Seeds ROWS jobs (default 10,000,000) into a database of its own, as a busy
system keeps them (mostly completed rows kept for their retention, a backlog,
scheduled and failed jobs, a rare kind), VACUUM ANALYZEs it as autovacuum
would, starts `fastjobs web` and times each page with a real client: one
warm-up, then 11 requests each, median and max in milliseconds. The
database is dropped at the end unless --keep (the disk is shared).
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fastjobs import schema

DB = "fastjobs_bench_web"
CHUNK = 1_000_000
# (state, share of the rows): what a system keeping a day of completed jobs holds.
MIX = [
    ("completed", 0.85),
    ("available", 0.08),
    ("scheduled", 0.03),
    ("discarded", 0.02),
    ("retryable", 0.01),
    ("cancelled", 0.01),
]

SEED = """
INSERT INTO fastjobs_jobs (queue, kind, args, state, run_at, created_at, attempted_at, finalized_at,
                           attempt, errors)
SELECT 'queue' || (i %% 4),
       'app.jobs.kind_' || (i %% 8),
       jsonb_build_object('user_id', i, 'tag', 't' || (i %% 1000), 'body', repeat('x', 40)),
       %(state)s::fastjobs_state,
       now() - make_interval(secs => (%(end)s - i) * 0.08)
             + CASE WHEN %(state)s = 'scheduled' THEN interval '2 days' ELSE interval '0' END,
       now() - make_interval(secs => (%(end)s - i) * 0.08),
       CASE WHEN %(state)s <> 'available' THEN now() - make_interval(secs => (%(end)s - i) * 0.08) END,
       CASE WHEN %(state)s IN ('completed', 'discarded', 'cancelled')
            THEN now() - make_interval(secs => (%(end)s - i) * 0.08) END,
       CASE WHEN %(state)s = 'available' THEN 0 ELSE 1 END,
       CASE WHEN %(state)s IN ('discarded', 'retryable')
            THEN jsonb_build_array(jsonb_build_object('at', now(), 'attempt', 1, 'error', 'ValueError: boom',
                                                      'traceback', 'Traceback ...'))
       END
  FROM generate_series(%(start)s::int8, %(end)s::int8 - 1) AS i"""

# A rare kind: 20 discarded jobs among the millions, the needle an operator looks for.
RARE = """
INSERT INTO fastjobs_jobs (queue, kind, args, state, finalized_at, attempt, errors)
SELECT 'queue1', 'app.jobs.rare', jsonb_build_object('user_id', i), 'discarded', now(), 1,
       '[{"error": "rare failure", "attempt": 1}]'
  FROM generate_series(1, 20) AS i"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = 0
        for state, share in MIX:
            count = round(rows * share)
            for begin in range(start, start + count, CHUNK):
                end = min(begin + CHUNK, start + count)
                conn.execute(SEED, {"state": state, "start": begin, "end": end})
            print(f"seeded {count:,} {state}", flush=True)
            start += count
        conn.execute(RARE)
        conn.execute("VACUUM (ANALYZE) fastjobs_jobs")
        conn.execute("ANALYZE fastjobs_jobs_all")


def measure(dsn: str, repeat: int = 11) -> list[tuple[str, float, float]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "web", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            for _ in range(300):
                try:
                    client.get("/static/style.css")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            with psycopg.connect(dsn, autocommit=True) as conn:
                top = conn.execute("SELECT max(id) FROM fastjobs_jobs").fetchone()[0]  # type: ignore[index]
                failed = conn.execute(
                    "SELECT id FROM fastjobs_jobs WHERE kind = 'app.jobs.rare' LIMIT 1"
                ).fetchone()[0]  # type: ignore[index]
            pages = [
                ("overview", "/"),
                ("jobs, newest", "/jobs"),
                ("jobs, state=available", "/jobs?state=available"),
                ("jobs, state=discarded", "/jobs?state=discarded"),
                (
                    "jobs, queue+kind+args search",
                    '/jobs?queue=queue1&kind=app.jobs.kind_1&args={"tag": "t1"}',
                ),
                ("jobs, a rare kind (window read through)", "/jobs?kind=app.jobs.rare"),
                ("jobs, page in the middle", f"/jobs?before={top // 2}"),
                ("job, a failed one", f"/jobs/{failed}"),
                ("bulk confirm", "/jobs/bulk?state=discarded&action=retry"),
                ("queues", "/queues"),
                ("periodic", "/periodic"),
                ("engine", "/engine"),
            ]
            found = []
            for name, path in pages:
                answer = client.get(path)
                assert answer.status_code == 200, (path, answer.status_code, answer.text[:500])
                times = []
                for _ in range(repeat):
                    began = time.perf_counter()
                    client.get(path)
                    times.append((time.perf_counter() - began) * 1000)
                found.append((name, statistics.median(times), max(times)))
            return found
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--keep"]
    rows = int(args[0]) if args else 10_000_000
    admin = (
        args[1]
        if len(args) > 1
        else os.environ.get("FASTJOBS_DSN", "postgresql://postgres@127.0.0.1/postgres")
    )
    dsn = make_conninfo(admin, dbname=DB)
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone()
        if not exists:
            conn.execute(f"CREATE DATABASE {DB}")
    try:
        with psycopg.connect(dsn) as conn:
            schema.migrate(conn, dsn=dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            have = conn.execute("SELECT count(*) FROM fastjobs_jobs").fetchone()[0]  # type: ignore[index]
        if have < rows:
            began = time.monotonic()
            seed(dsn, rows)
            print(f"seeded in {time.monotonic() - began:,.0f}s", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('fastjobs_jobs'))").fetchone()[
                0
            ]  # type: ignore[index]
            count = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()[0]  # type: ignore[index]
        host = conninfo_to_dict(dsn).get("host")
        print(f"\n{count:,} jobs ({size}), PostgreSQL on {host}, load {os.getloadavg()[0]:.2f}\n")
        print("| page | median ms | max ms |")
        print("|---|---:|---:|")
        for name, median, worst in measure(dsn):
            print(f"| {name} | {median:.1f} | {worst:.1f} |", flush=True)
    finally:
        if "--keep" not in sys.argv:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
            print("\ndropped", DB)


if __name__ == "__main__":
    main()
