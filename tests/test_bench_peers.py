"""bench/peers.py's arithmetic: medians of alternating runs and ratios to the raw loop of the same runs.

The peers themselves are not installed here (they are no dependencies): only the harness's sums.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


def _peers() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_peers", Path(__file__).parent.parent / "bench" / "peers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_contender_is_its_median_rate_over_the_raw_loops_median() -> None:
    peers = _peers()
    run = peers.Run
    runs = {
        "raw": [run(0.5, 1.0, 2.0), run(0.4, 1.0, 2.0), run(1.0, 1.0, 2.0)],  # 20k, 25k, 10k jobs/s
        "fastjobs": [run(0.25, 0.2, 2.0), run(0.2, 0.4, 2.0), run(0.5, 0.3, 2.0)],  # 40k, 50k, 20k
        "procrastinate": [run(100.0, 50.0, 3.0)],  # one run: 100 jobs/s
    }
    rows = {row.name: row for row in peers.summarise(10_000, runs)}
    assert list(rows) == ["raw", "fastjobs", "procrastinate"]
    assert (rows["raw"].rate, rows["raw"].ratio) == (20_000, 1.0)
    assert (rows["fastjobs"].rate, rows["fastjobs"].low, rows["fastjobs"].high) == (40_000, 20_000, 50_000)
    assert rows["fastjobs"].ratio == 2.0
    assert rows["fastjobs"].cpu_us == pytest.approx(30.0)  # median of 20, 40, 30 us per job
    assert rows["procrastinate"].ratio == pytest.approx(100 / 20_000)
