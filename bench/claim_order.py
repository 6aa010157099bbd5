"""The cost of returning a claim in claim order: each build's claim statements timed on one table.

The statements of two or more builds (each a tree on PYTHONPATH, read by a subprocess: `fastjobs.sql`
as that build sends it), executed prepared on one connection with a worker's session settings,
in alternation, against one table of BACKLOG available jobs over 3 priorities (id order is not
claim order). Each execution claims SIZE jobs and is rolled back, so every build meets the same
rows; a VACUUM every few rounds clears what the rollbacks leave. Beside them, the raw-SQL claim:
the leanest UPDATE ... WHERE id IN (SELECT ... ORDER BY ... LIMIT ... FOR UPDATE SKIP LOCKED)
RETURNING, and the same with its rows sorted (WITH ... ORDER BY), measured in the same rounds.
Prints, per statement and size, the median execution time (EXPLAIN ANALYZE's, so a loaded client
does not count) of each build, its ratio to the raw claim's, and the time of its Sort nodes alone.
Run it against a database of its own:
    python bench/claim_order.py DSN SIZES ROUNDS LABEL=TREE [LABEL=TREE ...]
e.g. python bench/claim_order.py postgresql://postgres@127.0.0.1/fj_claim 16,1000 300 \\
         before=/work/wt-order-before after=/work/wt-order
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg

logger = logging.getLogger("claim_order")
BACKLOG = 200_000
NAMES = ("job_claim_many", "job_finish_claim_many", "job_lock_many")
_RAW_CLAIM = """UPDATE fastjobs_jobs_all SET state = 'running', attempt = attempt + 1,
       attempted_at = now(), attempted_by = $3
 WHERE id IN (SELECT id FROM fastjobs_jobs_all
               WHERE state = 'available' AND queue = $1 AND run_at <= now()
               ORDER BY priority DESC, run_at, id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id, kind, args, attempt, max_attempts, priority, run_at, keep_result"""
RAW = {
    "raw": _RAW_CLAIM,
    "raw_sorted": f"WITH claimed AS ({_RAW_CLAIM}) SELECT * FROM claimed ORDER BY priority DESC, run_at, id",
}


def _statements(tree: str) -> dict[str, str]:
    """The statements NAMES of the build in `tree`, as its sql module has them."""
    code = "import json; from fastjobs import sql"
    code += f"; print(json.dumps({{n: sql.STATEMENTS[n] for n in {NAMES!r}}}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": tree},
        cwd=tree,  # python -c puts its directory first on sys.path, before PYTHONPATH
        check=True,
        capture_output=True,
    )
    statements: dict[str, str] = json.loads(out.stdout)
    return statements


def _arguments(name: str, size: int) -> str:
    """EXECUTE's arguments of statement `name` claiming `size` jobs, as literals."""
    if name == "job_lock_many":
        return f"'q', {size}"
    if name == "job_finish_claim_many":
        return f"'{{}}', '[]', 'q', {size}, 'w'"
    return f"'q', {size}, 'w'"


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _sort_ms(plan: dict[str, Any]) -> float:
    """The time of a plan's Sort of the claimed rows into claim order, its own (less its input's), ms."""
    total = 0.0
    for node in _nodes(plan):
        if node["Node Type"] == "Sort" and node["Sort Key"][0].split(".")[0] in ("claimed", "queued"):
            inputs = [c for c in node.get("Plans", []) if c["Parent Relationship"] == "Outer"]
            total += node["Actual Total Time"] - sum(c["Actual Total Time"] for c in inputs)
    return total


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dsn, sizes, rounds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
    builds = dict(arg.split("=", 1) for arg in sys.argv[4:])
    contenders: dict[str, dict[str, str]] = {"raw": RAW}
    contenders.update((label, _statements(tree)) for label, tree in builds.items())
    first = next(iter(builds.values()))
    subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fastjobs"), "migrate"],
        env={**os.environ, "PYTHONPATH": first, "FASTJOBS_DSN": dsn},
        check=True,
        capture_output=True,
    )
    took: dict[tuple[str, str, int], list[float]] = {}
    sorting: dict[tuple[str, str, int], list[float]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM fastjobs_jobs_all")
        conn.execute(
            "INSERT INTO fastjobs_jobs_all (queue, kind, priority, run_at)"
            " SELECT 'q', 'k', (i * 7) % 3, now() - interval '1 hour' + (i % 1000) * interval '1 ms'"
            f"   FROM generate_series(1, {BACKLOG}) i"
        )
        conn.execute("VACUUM ANALYZE fastjobs_jobs_all")
        from fastjobs import sql  # a worker's session settings (of the build on PYTHONPATH)

        conn.execute(sql.worker_session)
        cur = psycopg.RawCursor(conn)
        for label, statements in contenders.items():
            for name, text in statements.items():
                cur.execute(f"PREPARE {label}_{name} AS {text}")
        for r in range(rounds):
            for label, statements in contenders.items():
                for name in statements:
                    for size in sizes:
                        conn.execute("BEGIN")
                        explain = (
                            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {label}_{name}({_arguments(name, size)})"
                        )
                        row = cur.execute(explain).fetchone()
                        conn.execute("ROLLBACK")
                        assert row is not None
                        plan = row[0][0]
                        if r >= 5:  # the first rounds plan, cache and warm up
                            took.setdefault((label, name, size), []).append(plan["Execution Time"])
                            sorting.setdefault((label, name, size), []).append(_sort_ms(plan["Plan"]))
            if r % 10 == 9:
                conn.execute("VACUUM fastjobs_jobs_all")
    for size in sizes:
        raw = statistics.median(took[("raw", "raw", size)])
        for (label, name, at), runs in took.items():
            if at == size:
                median = statistics.median(runs)
                deciles = statistics.quantiles(runs, n=10)
                logger.info(
                    "size %5d  %-7s %-22s execution median %7.3f ms (p10 %7.3f, p90 %7.3f) x raw %.2f;"
                    " its Sort %.3f ms",
                    size, label, name, median, deciles[0], deciles[-1], median / raw,
                    statistics.median(sorting[(label, name, at)]),
                )  # fmt: skip


if __name__ == "__main__":
    main()
