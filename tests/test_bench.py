"""`fastjobs bench` tells the truth: no file unless asked, both raw loops, the rate it reached,
progress fit for a log, and the spread of repeated runs."""

from __future__ import annotations

import io
import json
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from fastjobs import bench
from fastjobs.bench import soak
from fastjobs.cli import main
from fastjobs.testing import databases


@pytest.fixture
def bench_db(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A benchmark database of this test's own (the benchmark truncates its jobs)."""
    name = f"fastjobs_bench_{secrets.token_hex(4)}"
    monkeypatch.setattr(bench, "BENCH_DB", name)
    yield name
    with psycopg.connect(databases.server_dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_drain_writes_no_file_unless_asked_and_shows_both_raw_loops_and_the_spread(
    dsn: str,
    bench_db: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--dsn", dsn, "bench", "--drain-only", "--jobs", "300", "--processes", "1", "--repeat", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran
    assert "\r" not in out  # not a terminal: each line a line
    table = {line[:32].strip(): line[32:].split() for line in out.splitlines() if line[:32].strip()}
    for raw in ("raw SQL: UPDATE claim + DELETE", "raw SQL: locked claim + DELETE"):
        _, runs, _ = table[raw]
        assert re.fullmatch(r"[\d,]+-[\d,]+", runs)  # the spread of the 2 runs
    assert "ratio: against the raw loop of the same lane" in out

    results = tmp_path / "out" / "results.jsonl"
    assert main([*args[:-2], "--repeat", "1", "--results", str(results)]) == 0
    [record] = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["raw_jobs_per_s"] > 0 and record["raw_locked_jobs_per_s"] > 0
    assert record["master_baseline"] == record["worker_baseline"] == "raw_locked"
    assert record["master_ratio"] == pytest.approx(  # written to two decimals
        record["master_jobs_per_s"] / record["raw_locked_jobs_per_s"], rel=0.01, abs=0.006
    )
    assert len(record["master_jobs_per_s_runs"]) == 1


def test_a_latency_run_says_when_the_rate_asked_for_was_not_reached(dsn: str, bench_db: str) -> None:
    lines: list[str] = []
    # 20,000 jobs/s asked of producers committing one job per transaction: out of reach.
    record = bench.run_latency(dsn, 20_000, 0.05, 1, 100, None, lines.append)
    assert not record["rate_reached"] and record["achieved_rate"] < 20_000
    text = "".join(lines)
    assert f"{record['achieved_rate']:,} jobs/s offered of 20,000 asked" in text
    assert "NOTE: 20,000 jobs/s was asked for and the producers offered" in text
    assert "from the enqueue call:" in text and "from its commit:" in text
    lines.clear()
    record = bench.run_latency(dsn, 20, 0.5, 1, 100, None, lines.append)
    assert record["rate_reached"] and "NOTE" not in "".join(lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_progress_rewrites_its_line_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    out = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    bench.echo("\r       100 / 300 jobs done")
    bench.echo("\r       200 / 300 jobs done")
    bench.echo("\r  run 1/1 raw    1,000 jobs/s\n")
    bench.echo("table\n")
    if terminal:
        assert out.getvalue() == (
            "\r\x1b[K       100 / 300 jobs done\r\x1b[K       200 / 300 jobs done"
            "\r\x1b[K  run 1/1 raw    1,000 jobs/s\ntable\n"
        )
    else:
        assert out.getvalue() == "  run 1/1 raw    1,000 jobs/s\ntable\n"


class _Clock:
    """time.perf_counter and time.sleep of a clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_soaks_first_reading_is_a_rate_not_a_division_by_almost_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(soak, "time", clock)
    readings: list[str] = []
    rate = soak._window(lambda: 2_000.0 * clock.now, readings.append, "fastjobs")
    assert rate == pytest.approx(2_000.0)
    assert readings[0] == "\r  fastjobs:      2,000 jobs/s"
    assert all("2,000 jobs/s" in r for r in readings)
