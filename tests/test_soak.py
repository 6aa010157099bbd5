"""The soak benchmark's parts: its latency histograms, its recovery rule, and one short phase.

The figures themselves come from `fastjobs bench --soak`; these tests check
that what it reports is computed right, never how fast anything is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fastjobs.bench import soak
from fastjobs.bench.soak import Histograms, Sample, percentile, recovery_seconds


def test_percentiles_of_the_histogram_are_bin_edges_within_five_percent() -> None:
    h = Histograms()
    for ms in range(1, 1001):  # 1..1000 ms, one each
        h.record(ms / 1000)
    total = h.total()
    assert total[0] == 1000
    for q, expected in ((0.5, 0.5), (0.99, 0.99), (1.0, 1.0)):
        value = percentile(total[1:], q)
        assert value is not None and expected <= value <= expected * 1.051, (q, value)
    assert percentile([0.0] * soak.BINS, 0.99) is None
    h.record(-1.0)  # a clock step backwards: the lowest bin, not an error
    h.record(1e9)  # beyond the last edge: the last bin
    assert h.total()[1] == 1 and h.total()[-1] == 1


def test_histograms_add_up_across_forked_processes() -> None:
    h = Histograms()
    h.record(0.001)
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                for _ in range(100):
                    h.record(0.002)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    assert h.total()[0] == 301
    h.reset()
    assert h.total()[0] == 0


def test_pickup_counts_from_the_commit_the_producer_noted() -> None:
    pickup = soak.Pickup()
    pickup.reset()
    now = time.time()
    pickup.note_commit(7, now - 0.020)
    pickup.record(now - 0.030, 7)  # enqueued 30 ms ago, committed 20 ms ago
    pickup.record(now - 0.030, 8)  # its commit not noted yet: 0 from the commit
    pickup.note_commit(7 + soak.Pickup.RING, now)  # the ring came round: 7's slot is another COPY's
    pickup.record(now - 0.030, 7)
    enqueued, committed = pickup.enqueued.total(), pickup.committed.total()
    assert enqueued[0] == committed[0] == 3
    assert 0.030 <= (percentile(enqueued[1:], 1.0) or 0) <= 0.040
    assert 0.020 <= (percentile(committed[1:], 1.0) or 0) <= 0.030
    assert committed[1] == 2  # the two without a noted commit, in the lowest bin
    assert percentile(committed[1:], 0.5) == pytest.approx(1e-5)


def sample(at: float, jobs: float, backlog: int) -> Sample:
    return Sample(at, jobs, jobs, 1.0, 2.0, backlog, 1.0, 1.0, 0, 0, 0.0, 0)


def test_recovery_is_the_first_sample_back_at_the_rate_with_its_backlog_worked_off() -> None:
    series = [
        sample(10, 100, 0),
        sample(20, 40, 600),  # the hold ends at 25
        sample(30, 95, 300),  # at the rate, but 3 s of backlog left
        sample(40, 130, 90),
        sample(50, 100, 0),
    ]
    assert recovery_seconds(series, 25.0, 100.0) == 15.0
    assert recovery_seconds(series[:3], 25.0, 100.0) is None


def test_a_short_phase_samples_throughput_latency_and_the_held_snapshot(
    dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(soak, "SAMPLE_SECONDS", 2.0)
    lines: list[str] = []
    samples = soak.run_phase(dsn, 0.1, 2000.0, 1, 1000, (1.0, 3.0), soak.Pickup(), lines.append)
    assert [s.at for s in samples] == pytest.approx([2.0, 4.0, 6.0], abs=0.5)
    assert sum(s.jobs_per_s for s in samples) > 0
    assert all(s.p99_ms is not None for s in samples)
    # From the commit: within the whole pickup latency, never above it.
    assert all(s.p99_commit_ms is not None and s.p99_commit_ms <= (s.p99_ms or 0.0) * 1.06 for s in samples)
    assert samples[0].horizon_s >= 0.5  # the held snapshot, seen a second after it began
    assert any("a transaction holds its snapshot open" in line for line in lines)
    assert any("the held transaction ended" in line for line in lines)
    assert len([line for line in lines if " jobs/s " in line]) == 3
