"""The round trip of a worker's claim on an idle queue, two builds side by side (issue 22 §5).

    python bench/claim_rt.py OLD_TREE NEW_TREE [--dsn DSN] [--rounds 40] [--per-round 50]

What an idle worker pays for each wake-up and each job's completion: the
statement that claims with nothing to finish, and the one that completes a
job and claims (the id given is nobody's, so the same state serves every
call), on an empty queue, each prepared and run on a generic plan with the
worker's session settings (`sql.worker_session`). Beside them, on the new
build's database: a no-op statement with the same parameters (the round trip
itself), the new claim's text on one slot (`fastjobs_jobs_1`, not every
partition: what the five partitions' executor start-up costs, which
pg_stat_statements does not count), and where the new build has them, its
claims in slot 0 and the current rotating slot (`job_claim_only_in_slot`,
`job_complete_claim_in_slot`). Each build's statements come from its
own tree (OLD_TREE, NEW_TREE: checkouts built in place), each on its own
database migrated by that build (bench/latency_call.py's `prepare`); the
cases alternate, `--per-round` calls each per round. Prints one JSON line
per case: p50, p90 and mean in ms over the calls after the first round.

--rows measures the busy worker's turnaround instead, on real rows: before
each call a producer inserts one job (the build's `job_insert_now`, its own
connection), and the call completes the job its case claimed last and
claims the new one (old: `job_finish_claim_after`; new: over five slots,
in slot 0 and the current, that text on the current slot's partition alone
(the floor), and with its DELETE pruned to slot 0 and the current too).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import time
from types import ModuleType
from typing import Any, Final

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_call import prepare

NOOP = "SELECT $1::text, $2::text, $3::text, $4::int, $5::text, $6::int, $7::int8"


def statements(tree: str) -> ModuleType:
    """The fastjobs.sql of the build in `tree` (its own import, apart from any other build's)."""
    for name in [m for m in sys.modules if m == "fastjobs" or m.startswith("fastjobs.")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        return importlib.import_module("fastjobs.sql")
    finally:
        sys.path.remove(tree)


def text(sql: ModuleType, *names: str) -> str:
    """The first of `names` the build has: the new build's claim-only statement, else the old one's."""
    table: dict[str, str] = getattr(sql, "STATEMENTS", {})
    for name in names:
        if name in table:
            return table[name]
        if isinstance(getattr(sql, name, None), str):
            return str(getattr(sql, name))
    raise LookupError(f"none of {names} in {sql.__file__}")


# --rows: each case's producer (a cursor of its own connection, its build's one-job INSERT), by
# the case's cursor; the INSERT's parameters (the old build's takes the first five).
_PRODUCERS: dict[int, tuple[psycopg.RawCursor[Any], str]] = {}
_JOB: Final = ["default", "bench.turnaround", "{}", 0, 25, None, None]


def insert(cur: psycopg.RawCursor[Any]) -> None:
    """One job due now on queue `default`, committed by the producer of `cur`'s case."""
    producer, text = _PRODUCERS[id(cur)]
    producer.execute(text, _JOB[: arity(text)], prepare=True)


def arity(text: str) -> int:
    """The highest $n a statement takes."""
    return max(int(n) for n in re.findall(r"\$(\d+)", text))


Case = tuple[psycopg.RawCursor[Any], str, list[Any]]  # a cursor, its statement, the parameters


def idle_cases(dsn: str, old: str, new: str) -> dict[str, Case]:
    """The cases on an idle queue, all of a build on one connection."""
    cases: dict[str, Case] = {}
    idle = ["{}", "[]", "default", 4, "bench", 0, 0]
    one = ["{1}", *idle[1:]]  # a job to complete that is nobody's: the same empty state every call
    for label, tree in (("old", old), ("new", new)):
        sql = statements(tree)
        conn = psycopg.connect(prepare(dsn, f"fj_claim_rt_{label}", tree), autocommit=True)
        conn.execute(sql.worker_session)
        claim = text(sql, "job_claim_only_after", "job_finish_claim_after")
        complete = text(sql, "job_complete_claim_after", "job_finish_claim_after")
        cases[f"{label} claim"] = (psycopg.RawCursor(conn), claim, idle)
        cases[f"{label} complete and claim"] = (psycopg.RawCursor(conn), complete, one)
        if label == "new":
            cases["no-op"] = (psycopg.RawCursor(conn), NOOP, idle)
            one_slot = claim.replace("fastjobs_jobs_all", "fastjobs_jobs_1")
            cases["new claim on one slot"] = (psycopg.RawCursor(conn), one_slot, idle)
            if "job_claim_only_in_slot" in getattr(sql, "STATEMENTS", {}):  # slot 0 and the current one
                [(slot,)] = conn.execute(sql.slot_current).fetchall()
                for case, name, params in (
                    ("claim", "claim_only", idle),
                    ("complete and claim", "complete_claim", one),
                ):
                    cases[f"new {case} in slot 0 and the current"] = (
                        psycopg.RawCursor(conn),
                        sql.STATEMENTS[f"job_{name}_in_slot"],
                        [*params, slot],
                    )
    return cases


def turnaround_cases(dsn: str, old: str, new: str) -> dict[str, Case]:
    """The --rows cases: each on its own worker connection and producer, its queue emptied."""
    cases: dict[str, Case] = {}
    params: list[Any] = ["{}", "[]", "default", 1, "bench", 0, 0]
    for label, tree in (("old", old), ("new", new)):
        sql = statements(tree)
        target = prepare(dsn, f"fj_claim_rt_{label}", tree)
        complete = text(sql, "job_complete_claim_after", "job_finish_claim_after")
        variants = {f"{label} complete and claim": complete}
        slot: list[Any] = []
        if "job_complete_claim_in_slot" in getattr(sql, "STATEMENTS", {}):
            with psycopg.connect(target, autocommit=True) as conn:
                [(current,)] = conn.execute(sql.slot_current).fetchall()
            slot = [current]
            in_slot = sql.STATEMENTS["job_complete_claim_in_slot"]
            variants["new complete and claim in slot 0 and the current"] = in_slot
            variants["new complete and claim, its text on the current slot alone"] = in_slot.replace(
                "fastjobs_jobs_all", f"fastjobs_jobs_{current}"
            )
            pruned = "WHERE j.slot IN (0, $8::smallint) AND j.id = ANY($1::bigint[])"
            variants["new complete and claim in slot 0 and the current, its DELETE too"] = in_slot.replace(
                "WHERE j.id = ANY($1::bigint[])", pruned, 1
            )
        for name, statement in variants.items():
            conn = psycopg.connect(target, autocommit=True)
            conn.execute(sql.worker_session)
            conn.execute("TRUNCATE fastjobs_jobs_all" if slot else "TRUNCATE fastjobs_jobs")
            cur = psycopg.RawCursor(conn)
            producer = psycopg.RawCursor(psycopg.connect(target, autocommit=True))
            _PRODUCERS[id(cur)] = (producer, sql.job_insert_now)
            cases[name] = (cur, statement, [*params, *(slot if "$8" in statement else [])])
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument(
        "--dsn", default=os.environ.get("FASTJOBS_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rows", action="store_true", help="the busy turnaround on real rows")
    args = parser.parse_args()
    cases = (turnaround_cases if args.rows else idle_cases)(args.dsn, args.old, args.new)
    times: dict[str, list[float]] = {name: [] for name in cases}
    last: dict[str, str] = {name: "{}" for name in cases}  # --rows: the job each case claimed last
    for _ in range(args.rounds):
        for name, (cur, statement, params) in cases.items():
            for _ in range(args.per_round):
                if args.rows:
                    insert(cur)
                    params = [last[name], *params[1:]]
                began = time.perf_counter()
                rows = cur.execute(statement, params, prepare=True).fetchall()
                times[name].append(time.perf_counter() - began)
                if args.rows:
                    claimed = [row[0] for row in rows if row[1] is not None]  # not outcomes or slot rows
                    last[name] = "{" + ",".join(map(str, claimed)) + "}"
    for name, seconds in times.items():
        kept = sorted(seconds[args.per_round :])  # the first round prepares and plans
        record = {
            "case": name,
            "calls": len(kept),
            "p50_ms": round(kept[len(kept) // 2] * 1000, 3),
            "p90_ms": round(kept[int(len(kept) * 0.9)] * 1000, 3),
            "mean_ms": round(statistics.mean(kept) * 1000, 3),
            "loadavg": round(os.getloadavg()[0], 2),
        }
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
