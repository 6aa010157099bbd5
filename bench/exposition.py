"""The cost of a scrape's per-kind part: fastjobs' hand-written exposition against prometheus_client.

20 kinds x 4 queues, spread over 8 worker slots, every row used: outcome
counters and the two histograms (25 buckets each). Run:
    python bench/exposition.py      (needs prometheus_client installed)
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from fastjobs import exposition, scoreboard, stats
from fastjobs.abc import BUCKETS, OUTCOMES, ROW

KINDS, QUEUES, WORKERS = 20, 4, 8


def filled() -> scoreboard.Scoreboard:
    queues = [f"queue{q}" for q in range(QUEUES)]
    labels = scoreboard.Labels([f"kind{k}" for k in range(KINDS)], [queues] * WORKERS + [[]])
    slots = scoreboard.Scoreboard.create(WORKERS + 1, "bench", 0, labels)
    rng = random.Random(1)
    for i in range(WORKERS):
        slot = slots[i]
        slot.claim(stats.WORKER, i)
        for at in range(0, labels.rows * ROW):
            slot.counts[at] = rng.randrange(1, 10**6)
    return slots


class KindCollector:
    """What a prometheus_client custom collector over the same shared memory would be."""

    def __init__(self, slots: scoreboard.Scoreboard) -> None:
        self.slots = slots

    def collect(self) -> Iterator[Any]:
        kinds = self.slots.kinds()
        outcomes = CounterMetricFamily(
            "fastjobs_job_outcomes", "jobs finished", labels=["queue", "kind", "outcome"]
        )
        run = HistogramMetricFamily("fastjobs_job_run_seconds", "run time", labels=["queue", "kind"])
        pickup = HistogramMetricFamily("fastjobs_job_pickup_seconds", "pickup", labels=["queue", "kind"])
        les = [*(repr(b) for b in BUCKETS), "+Inf"]
        for k in kinds:
            for outcome in OUTCOMES:
                outcomes.add_metric([k.queue, k.kind, outcome], k.outcomes[outcome])
            for family, h in ((run, k.run_seconds), (pickup, k.pickup_seconds)):
                family.add_metric([k.queue, k.kind], list(zip(les, h.buckets, strict=True)), h.sum)
        yield outcomes
        yield run
        yield pickup


def best(fn: Any, n: int = 30) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    slots = filled()
    try:
        registry = CollectorRegistry()
        registry.register(KindCollector(slots))  # type: ignore[arg-type]
        ours = "\n".join(exposition.kind_metrics(slots.kinds()))
        theirs = generate_latest(registry).decode()
        read = best(slots.kinds)
        hand = best(lambda: "\n".join(exposition.kind_metrics(slots.kinds())))
        client = best(lambda: generate_latest(registry))
        print(f"{KINDS} kinds x {QUEUES} queues over {WORKERS} workers: {len(slots.kinds())} series groups")
        print(f"read and sum the shared memory:        {read * 1000:7.2f} ms")
        print(f"hand-written exposition (incl. read):  {hand * 1000:7.2f} ms, {len(ours):,} bytes")
        print(f"prometheus_client collector (incl. read): {client * 1000:7.2f} ms, {len(theirs):,} bytes")
    finally:
        slots.close(unlink=True)


if __name__ == "__main__":
    main()
