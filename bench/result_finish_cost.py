"""The finish statements with and without the results' parts, on the same table, in alternation.

    python bench/result_finish_cost.py BASE_TREE [ROUNDS] [BATCH] [DSN]

BASE_TREE is a checkout of fastjobs before results (its fastjobs/sql.py is
read as text, not imported). Each round seeds BATCH available jobs
(without keep_result), claims them all (job_claim_many) and times the
statement that completes them all, claiming nothing: the state lane's
job_finish_claim_many, and on the fast lane job_lock_many then
job_finish_locked_many in one transaction; base's statement and this
tree's alternate round by round, each prepared once. The jobs table has
006's column, which base's statements do not name. Prints the median server
round trip of each statement in microseconds per job, and the load average.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from fastjobs import schema, sql

DB = "fastjobs_bench_result_finish"


def _base_sql(tree: str) -> Any:
    spec = importlib.util.spec_from_file_location("base_sql", Path(tree) / "fastjobs" / "sql.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_sql"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _seed(conn: psycopg.Connection[Any], batch: int) -> None:
    conn.execute("TRUNCATE fastjobs_jobs_all")
    conn.execute(
        "INSERT INTO fastjobs_jobs_all (kind, args) SELECT 'k', '{}' FROM generate_series(1, %s)", (batch,)
    )


def _state(conn: psycopg.Connection[Any], finish: str, batch: int) -> float:
    _seed(conn, batch)
    cur = psycopg.RawCursor(conn)
    ids = [row[0] for row in cur.execute(sql.job_claim_many, ("default", batch, "w"))]
    began = time.perf_counter()
    cur.execute(finish, (ids, "[]", "default", 0, "w"), prepare=True)
    cur.fetchall()
    return time.perf_counter() - began


def _fast(conn: psycopg.Connection[Any], lock: str, finish: str, batch: int) -> float:
    _seed(conn, batch)
    cur = psycopg.RawCursor(conn)
    with conn.transaction():
        ids = [row[0] for row in cur.execute(lock, ("default", batch), prepare=True)]
        began = time.perf_counter()
        cur.execute(finish, (ids, "[]", "w"), prepare=True)
        cur.fetchall()
        took = time.perf_counter() - began
    return took


def main() -> None:
    base = _base_sql(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    server = sys.argv[4] if len(sys.argv) > 4 else os.environ["FASTJOBS_DSN"]
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(server, dbname=DB)
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn)
    times: dict[str, list[float]] = {"state base": [], "state new": [], "fast base": [], "fast new": []}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET enable_seqscan = off")
        for _ in range(rounds):
            times["state base"].append(_state(conn, base.job_finish_claim_many, batch))
            times["state new"].append(_state(conn, sql.job_finish_claim_many, batch))
            times["fast base"].append(_fast(conn, base.job_lock_many, base.job_finish_locked_many, batch))
            times["fast new"].append(_fast(conn, sql.job_lock_many, sql.job_finish_locked_many, batch))
    us = {name: statistics.median(values) / batch * 1e6 for name, values in times.items()}
    print(
        f"finish of {batch} completed jobs, median of {rounds} rounds, us/job:"
        f" state lane base {us['state base']:.2f}, new {us['state new']:.2f}"
        f" ({us['state new'] / us['state base']:.2f} x);"
        f" fast lane base {us['fast base']:.2f}, new {us['fast new']:.2f}"
        f" ({us['fast new'] / us['fast base']:.2f} x); load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
