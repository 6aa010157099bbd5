"""The C hot loop's client CPU per job, on each lane, for the build on sys.path: run it from two
builds in turn (PYTHONPATH=<tree>) to compare what a change costs per job.

The BatchLoop drains no-op jobs with a slot's counts, as a worker under a
master does (batch 1,000; the fast lane proven by a first batch). Client CPU
(time.process_time of the process, every thread included: the guard's too)
is compared, not throughput: the database's share, and the other tenants of
a shared machine, weigh on wall time much more than on the client's CPU.
    PYTHONPATH=<tree> python bench/hotloop_cpu.py postgresql://... [jobs] [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

import psycopg

import fastjobs
from fastjobs import App, schema, stats
from fastjobs.handlers import Executor
from fastjobs.impl import IMPLEMENTATION, core


def drain(app: App, fast: bool, jobs: int) -> float:
    app.enqueue_many("noop", ({"n": i} for i in range(jobs)))
    labels = stats.Labels(list(app.jobs), [["default"]])
    slots = stats.Slots.create(1, "bench", 0, labels)
    slot = slots[0]
    slot.claim(stats.WORKER, 0)
    conn = psycopg.connect(app.dsn, autocommit=True)
    executor = Executor()
    try:
        loop = core.BatchLoop(
            conn,
            app.runnable(),
            executor,
            "bench",
            ["default"],
            batch_min=1000,
            batch_max=1000,
            progress=slot.progress_view(),
            running=slot.running_view(),
            counts=slot.counts_view(),
            fast_lane=fast,
        )
        loop.prepare()
        began = time.process_time()
        while loop.step():
            pass
        loop.finish()
        spent = time.process_time() - began
        assert loop.completed == jobs, loop.completed
        return spent / jobs * 1e6
    finally:
        executor.close()
        conn.close()
        del slot
        slots.close(unlink=True)


def main() -> None:
    dsn = sys.argv[1]
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 50_000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn, dsn=dsn)
    app = App(dsn)

    @app.job("noop")
    def noop(n: int) -> None:
        pass

    seen: dict[bool, list[float]] = {False: [], True: []}
    drain(app, False, 2000)  # warm up
    for _ in range(rounds):
        for fast in (False, True):
            seen[fast].append(drain(app, fast, jobs))
    print(f"{fastjobs.__file__} ({IMPLEMENTATION}), {jobs:,} no-op jobs x {rounds}, client CPU us/job:")
    for fast, lane in ((False, "state lane"), (True, "fast lane ")):
        print(f"  {lane} median {statistics.median(seen[fast]):.3f}  {[round(x, 3) for x in seen[fast]]}")


if __name__ == "__main__":
    main()
