"""What the counts per (queue, kind) cost the C hot loop per job: the same loop, the same build,
draining the same no-op jobs with and without a slot's counts (alternating rounds).

Client CPU (time.process_time of the draining process) per job is compared,
not throughput: the database's share, and the other tenants of a shared
machine, weigh on wall time much more than on the client's CPU.
    python bench/hotloop_counts.py postgresql://... [jobs] [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

import psycopg

from fastjobs import App, schema, scoreboard, stats
from fastjobs.executor import Executor
from fastjobs.impl import IMPLEMENTATION, core


def drain(app: App, counts: bool, jobs: int) -> float:
    app.enqueue_many("noop", ({"n": i} for i in range(jobs)))
    labels = scoreboard.Labels(list(app.jobs), [["default"]])
    slots = scoreboard.Scoreboard.create(1, "bench", 0, labels)
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
            counts=slot.counts_view() if counts else None,
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
    drain(app, True, 2000)  # warm up
    for _ in range(rounds):
        for counts in (False, True):
            seen[counts].append(drain(app, counts, jobs))
    off, on = statistics.median(seen[False]), statistics.median(seen[True])
    print(f"{IMPLEMENTATION} loop, {jobs:,} no-op jobs x {rounds} rounds, client CPU us/job (median):")
    print(f"  without counts {off:.3f}  {[round(x, 3) for x in seen[False]]}")
    print(f"  with counts    {on:.3f}  {[round(x, 3) for x in seen[True]]}")
    print(f"  difference     {on - off:+.3f} us/job ({(on - off) / off:+.1%})")


if __name__ == "__main__":
    main()
