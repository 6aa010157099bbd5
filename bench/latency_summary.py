"""Medians per build of bench/latency_rounds.sh's runs: `python bench/latency_summary.py OUT`."""

from __future__ import annotations

import collections
import json
import statistics
import sys

FIGURES = (
    "call_p50",
    "call_p99",
    "commit_p50",
    "commit_p99",
    "write_p50",
    "worker_cpu_ms_per_job",
    "server_cpu_ms_per_job",
    "machine_cpu_ms_per_job",
)


def main() -> int:
    runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    with open(sys.argv[1]) as f:
        for line in f:
            record = json.loads(line)
            runs[record["label"]].append(record)
    sys.stdout.write("build runs " + " ".join(FIGURES) + "\n")
    for label, records in runs.items():
        medians = (statistics.median(r.get(k) or 0.0 for r in records) for k in FIGURES)
        sys.stdout.write(f"{label} {len(records)} " + " ".join(f"{m:.3f}" for m in medians) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
