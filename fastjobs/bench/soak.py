"""`fastjobs bench --soak`: sustained enqueue and drain at a fixed rate, sampled every 10 s.

A queue that is fast for a minute can still fail over an hour: dead rows
pile up faster than autovacuum removes them, or a long transaction pins the
cleanup horizon and every claim wades through what it cannot remove. The
soak offers a steady rate (80% of the measured end-to-end maximum) to the
real `fastjobs run` (master, workers, leader) for MINUTES, samples
throughput, pickup latency, table and index size and dead rows every 10 s,
then runs again with a transaction held open for `hold` seconds in the
middle, and reports the last minute against the first and the recovery.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

from .. import bench, report, sql
from ..app import App
from ..errors import FastjobsError
from ..impl import IMPLEMENTATION
from . import queries

SOAK_KIND = "fastjobs.bench.soak"
SAMPLE_SECONDS = 10.0
TICK = 0.01  # the producer's pace: one COPY every 10 ms
MAX_SECONDS = 15.0  # length of each maximum measurement, after a warm-up of 3 s
LOAD = 0.8  # the offered rate, as a share of the measured maximum

# Pickup latency histogram: bin 0 is <= 10 us, bin b > 0 holds latencies up
# to 10 us x 1.05^b (5% wide, up to ~50 min), enough for a p99.
BINS = 400
_FLOOR, _GROWTH = 1e-5, math.log(1.05)
REGIONS = 64
_ROTATING = re.compile(r"fastjobs_jobs_[0-9]+$")


class Histograms:
    """Latency histograms in an anonymous shared mapping, one region per process.

    Made before the master forks, so every worker inherits it; a worker
    takes a free region on its first job (under a lock), then writes only
    there, without locks. The bench reads the sum.
    """

    def __init__(self) -> None:
        self.width = 2 + BINS  # pid, count, bins
        self._map = mmap.mmap(-1, REGIONS * self.width * 8)
        self._values: Any = memoryview(self._map).cast("d")
        self._lock = multiprocessing.get_context("fork").Lock()
        self._mine: tuple[int, Any] | None = None

    def record(self, seconds: float) -> None:
        pid = os.getpid()
        if self._mine is None or self._mine[0] != pid:
            self._mine = (pid, self._claim(pid))
        region = self._mine[1]
        region[1] += 1.0
        b = 0 if seconds <= _FLOOR else min(BINS - 1, int(math.log(seconds / _FLOOR) / _GROWTH) + 1)
        region[2 + b] += 1.0

    def _claim(self, pid: int) -> Any:
        with self._lock:
            for i in range(REGIONS):
                region = self._values[i * self.width : (i + 1) * self.width]
                if region[0] == 0.0:
                    region[0] = pid
                    return region
        raise FastjobsError(f"more than {REGIONS} processes recorded latencies")

    def total(self) -> list[float]:
        """[count, bins...] summed over every process."""
        sums = [0.0] * (1 + BINS)
        for i in range(REGIONS):
            base = i * self.width
            if self._values[base] == 0.0:
                continue
            for j in range(1 + BINS):
                sums[j] += self._values[base + 1 + j]
        return sums

    def reset(self) -> None:
        for i in range(len(self._values)):
            self._values[i] = 0.0
        self._mine = None


class Pickup:
    """Pickup latency twice: from just before the producer's COPY (`enqueued`), and from
    the moment its commit returned (`committed`), the latency a worker can act on.

    The producer notes each COPY's commit time in a shared ring, under the
    COPY's sequence number, which its jobs carry; a job seen before its
    producer noted the commit (it ran while the commit's reply was in flight)
    counts 0 from the commit. The ring holds the last 65,536 COPYs (11 min
    at one per 10 ms): a job older than that counts 0 too.
    """

    RING = 1 << 16

    def __init__(self) -> None:
        self.enqueued = Histograms()
        self.committed = Histograms()
        self._map = mmap.mmap(-1, self.RING * 2 * 8)
        self._ring: Any = memoryview(self._map).cast("d")

    def note_commit(self, seq: int, at: float) -> None:
        slot = 2 * (seq % self.RING)
        self._ring[slot + 1] = at
        self._ring[slot] = float(seq)  # written last: a reader that sees the seq sees its time

    def record(self, enqueued_at: float, seq: int) -> None:
        now = time.time()
        self.enqueued.record(now - enqueued_at)
        slot = 2 * (seq % self.RING)
        committed = self._ring[slot + 1] if self._ring[slot] == float(seq) else now
        self.committed.record(max(0.0, now - committed))

    def reset(self) -> None:
        self.enqueued.reset()
        self.committed.reset()
        for i in range(len(self._ring)):
            self._ring[i] = -1.0


def percentile(bins: list[float], q: float) -> float | None:
    """The upper edge (seconds) of the bin holding quantile `q` of a histogram; None when empty."""
    count = sum(bins)
    if count <= 0:
        return None
    seen = 0.0
    for b, n in enumerate(bins):
        seen += n
        if seen >= q * count:
            return _FLOOR * math.exp(_GROWTH * b)
    return _FLOOR * math.exp(_GROWTH * (BINS - 1))


# --- the processes under test -----------------------------------------------------------------


def _soak_app(dsn: str, pickup: Pickup) -> App:
    app = App(dsn)

    @app.job(kind=SOAK_KIND)
    def soak(t: float, s: int) -> None:
        pickup.record(t, s)

    return app


def _produce(dsn: str, rate: float | None, stop: Any, sent: Any, pickup: Pickup) -> None:
    """Enqueue soak jobs, one COPY per tick, at `rate` jobs/s (None: as fast as COPY goes).

    Behind schedule (a slow commit), the next COPY carries what is due, so
    the offered rate holds on average; `sent` counts what was committed.
    """
    app = App(dsn)
    began = time.perf_counter()
    done = seq = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            if rate is None:
                n = 1000
            else:
                n = min(int((time.perf_counter() - began) * rate) - done, 20_000)
                if n <= 0:
                    time.sleep(TICK)
                    continue
            t = time.time()
            with conn.transaction():
                app.enqueue_many(SOAK_KIND, [{"t": t, "s": seq}] * n, conn=conn)
            pickup.note_commit(seq, time.time())
            seq += 1
            done += n
            sent.value = done


def _raw_produce(dsn: str, stop: Any, sent: Any) -> None:
    """The raw limit's producer: bare binary COPY of 1,000 rows encoded once, as fast as it goes."""
    data = bench.raw_copy_data([{"t": 0.0}] * 1000)
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            with conn.transaction(), conn.cursor() as cur, cur.copy(sql.job_copy) as copy:
                copy.write(data)
            done += 1000
            sent.value = done


def _raw_consume(dsn: str, batch: int, stop: Any, completed: Any) -> None:
    """The raw limit's consumer: the state lane's UPDATE claim, DELETE by id array (two writes per
    job), polling 1 ms when empty."""
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        cur = psycopg.RawCursor(conn)
        cur.execute(sql.worker_session)
        worker = f"raw:{os.getpid()}"
        while not stop.is_set():
            ids = [row[0] for row in cur.execute(sql.job_claim_many, ("default", batch, worker))]
            if not ids:
                time.sleep(0.001)
                continue
            cur.execute(queries.bench_raw_complete, (ids,))
            with completed.get_lock():
                completed.value += len(ids)


def _spawn(target: Callable[..., None], *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        bench._child(target, *args)
    return pid


def _reap(pids: list[int], stop: Any) -> None:
    stop.set()
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise FastjobsError(f"a soak process failed (status {status})")


# --- the maximum, beside the raw limit --------------------------------------------------------


def _window(count: Callable[[], float], echo: Callable[[str], None], label: str) -> float:
    """Completions per second over MAX_SECONDS, after a 3 s warm-up."""
    time.sleep(3.0)
    first, began = count(), time.perf_counter()
    while time.perf_counter() - began < MAX_SECONDS:
        time.sleep(0.5)
        # Elapsed after the sleep: the first reading is over half a second, not a division by
        # the microseconds before it.
        elapsed = time.perf_counter() - began
        echo(f"\r  {label}: {(count() - first) / elapsed:>10,.0f} jobs/s")
    rate = (count() - first) / (time.perf_counter() - began)
    echo(f"\r  {label}: {rate:>10,.0f} jobs/s\n")
    return rate


def measure_maximum(
    dsn: str, processes: int, batch: int, pickup: Pickup, echo: Callable[[str], None]
) -> tuple[float, float]:
    """End-to-end maximum, enqueue and drain at once: (fastjobs jobs/s, raw-SQL jobs/s)."""
    ctx = multiprocessing.get_context("fork")
    bench._reset(dsn)
    stop, completed, sent = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    pids = [_spawn(_raw_consume, dsn, batch, stop, completed) for _ in range(processes)]
    pids.append(_spawn(_raw_produce, dsn, stop, sent))
    try:
        raw = _window(lambda: float(completed.value), echo, "raw SQL, COPY and UPDATE claim + DELETE at once")
    finally:
        _reap(pids, stop)
    bench._reset(dsn)
    pickup.reset()
    stop, sent = ctx.Event(), ctx.Value("q", 0)
    with bench.master_running(lambda: _soak_app(dsn, pickup), processes, batch):
        pids = [_spawn(_produce, dsn, None, stop, sent, pickup)]
        try:
            fast = _window(lambda: pickup.enqueued.total()[0], echo, "fastjobs, enqueue_many and run at once")
        finally:
            _reap(pids, stop)
    return fast, raw


# --- the soak ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # seconds since the phase began
    jobs_per_s: float
    enqueued_per_s: float
    p50_ms: float | None  # pickup latency from just before the producer's COPY
    p99_ms: float | None
    backlog: int  # available jobs
    table_mb: float
    index_mb: float
    dead_rows: int
    live_rows: int
    horizon_s: float  # age of the oldest snapshot holding back cleanup
    autovacuums: int
    p50_commit_ms: float | None = None  # pickup latency from the producer's commit
    p99_commit_ms: float | None = None


def _hold(dsn: str, start: float, seconds: float, echo: Callable[[str], None]) -> threading.Thread:
    """A thread holding one REPEATABLE READ snapshot open from `start` (perf_counter) for `seconds`."""

    def run() -> None:
        time.sleep(max(0.0, start - time.perf_counter()))
        with psycopg.connect(dsn, application_name="fastjobs-soak-hold") as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT count(*) FROM fastjobs_periodic")  # takes the snapshot
            echo("\n  -- a transaction holds its snapshot open\n")
            time.sleep(seconds)
            conn.rollback()
            echo("\n  -- the held transaction ended\n")

    thread = threading.Thread(target=run, name="fastjobs-soak-hold", daemon=True)
    thread.start()
    return thread


def run_phase(
    dsn: str,
    minutes: float,
    rate: float,
    processes: int,
    batch: int,
    hold: tuple[float, float] | None,
    pickup: Pickup,
    echo: Callable[[str], None],
) -> list[Sample]:
    """Offer `rate` jobs/s for `minutes`, sampled every 10 s; `hold`: (start, length) of a held snapshot."""
    ctx = multiprocessing.get_context("fork")
    bench._reset(dsn)
    pickup.reset()
    stop, sent = ctx.Event(), ctx.Value("q", 0)
    samples: list[Sample] = []
    with (
        bench.master_running(lambda: _soak_app(dsn, pickup), processes, batch),
        psycopg.connect(dsn, autocommit=True) as watch,
    ):
        pids = [_spawn(_produce, dsn, rate, stop, sent, pickup)]
        try:
            began = time.perf_counter()
            holder = _hold(dsn, began + hold[0], hold[1], echo) if hold else None
            last, last_commit = pickup.enqueued.total(), pickup.committed.total()
            last_sent, last_at = 0, began
            for k in range(1, int(minutes * 60 / SAMPLE_SECONDS) + 1):
                time.sleep(max(0.0, began + k * SAMPLE_SECONDS - time.perf_counter()))
                now, total, enqueued = time.perf_counter(), pickup.enqueued.total(), sent.value
                commit_total = pickup.committed.total()
                bins = [a - b for a, b in zip(total[1:], last[1:], strict=True)]
                commit_bins = [a - b for a, b in zip(commit_total[1:], last_commit[1:], strict=True)]
                health = report.health(watch)
                # fastjobs_jobs (slot 0) and the rotating slots fastjobs_jobs_1..4: the jobs' partitions.
                parts = [t for t in health.tables if t.table == "fastjobs_jobs" or _ROTATING.match(t.table)]
                backlog = watch.execute(queries.bench_available_count).fetchone()[0]  # type: ignore[index]
                p50, p99 = percentile(bins, 0.50), percentile(bins, 0.99)
                c50, c99 = percentile(commit_bins, 0.50), percentile(commit_bins, 0.99)
                h = health.horizon
                sample = Sample(
                    at=round(now - began, 1),
                    jobs_per_s=round((total[0] - last[0]) / (now - last_at)),
                    enqueued_per_s=round((enqueued - last_sent) / (now - last_at)),
                    p50_ms=None if p50 is None else round(p50 * 1000, 2),
                    p99_ms=None if p99 is None else round(p99 * 1000, 2),
                    backlog=int(backlog),
                    table_mb=round(sum(t.table_bytes for t in parts) / 2**20, 1),
                    index_mb=round(sum(t.index_bytes for t in parts) / 2**20, 1),
                    dead_rows=sum(t.dead for t in parts),
                    live_rows=sum(t.live for t in parts),
                    horizon_s=round(h.seconds or 0.0, 1) if h is not None else 0.0,
                    autovacuums=sum(t.autovacuums for t in parts),
                    p50_commit_ms=None if c50 is None else round(c50 * 1000, 2),
                    p99_commit_ms=None if c99 is None else round(c99 * 1000, 2),
                )
                samples.append(sample)
                echo(_line(sample))
                last, last_commit, last_sent, last_at = total, commit_total, enqueued, now
            if holder is not None:
                holder.join()
        finally:
            _reap(pids, stop)
    return samples


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _line(s: Sample) -> str:
    return (
        f"  {s.at:>6.0f}s {s.jobs_per_s:>9,.0f} jobs/s  p50 {_ms(s.p50_ms):>7} p99 {_ms(s.p99_ms):>8} ms"
        f" (from the commit {_ms(s.p50_commit_ms)} / {_ms(s.p99_commit_ms)})  backlog {s.backlog:>9,}"
        f"  table {s.table_mb:>7,.1f} MB  indexes {s.index_mb:>7,.1f} MB  dead {s.dead_rows:>10,}"
        f"  horizon {s.horizon_s:>5.0f}s  autovacuums {s.autovacuums}\n"
    )


def _minute(samples: list[Sample], first: bool) -> float:
    per_minute = max(1, int(60 / SAMPLE_SECONDS))
    window = samples[:per_minute] if first else samples[-per_minute:]
    return sum(s.jobs_per_s for s in window) / len(window)


def recovery_seconds(samples: list[Sample], hold_end: float, rate: float) -> float | None:
    """Seconds from the end of the hold to the first sample back at 90% of the offered rate with
    no more than a second's worth of backlog; None if it never recovered."""
    for s in samples:
        if s.at > hold_end and s.jobs_per_s >= 0.9 * rate and s.backlog <= rate:
            return round(s.at - hold_end, 1)
    return None


def run_soak(
    dsn: str,
    minutes: float,
    rate: float | None,
    processes: int,
    batch: int,
    hold_seconds: float,
    results: Path | None,
    plot: Path | None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    target = bench.bench_dsn(dsn)
    pickup = Pickup()
    echo(
        f"fastjobs soak: {minutes:g} min steady, then {minutes:g} min with a {hold_seconds:g} s"
        f" transaction in the middle; {processes} processes, {IMPLEMENTATION} implementation\n"
    )
    fast_max, raw_max = measure_maximum(target, processes, batch, pickup, echo)
    offered = rate if rate is not None else round(LOAD * fast_max)
    echo(
        f"  maximum {fast_max:,.0f} jobs/s = {fast_max / raw_max:.2f} x the raw two-write loop"
        f" (UPDATE claim + DELETE) {raw_max:,.0f};"
        f" offering {offered:,.0f} jobs/s\n\nsteady:\n"
    )
    steady = run_phase(target, minutes, offered, processes, batch, None, pickup, echo)
    hold_start = max(0.0, minutes * 60 / 2 - hold_seconds / 2)
    echo(f"\nwith a transaction held from {hold_start:.0f} s to {hold_start + hold_seconds:.0f} s:\n")
    held = run_phase(target, minutes, offered, processes, batch, (hold_start, hold_seconds), pickup, echo)
    hold_end = hold_start + hold_seconds
    figures = {
        "minutes": minutes,
        "processes": processes,
        "batch": batch,
        "max_jobs_per_s": round(fast_max),
        "raw_max_jobs_per_s": round(raw_max),
        "max_ratio": round(fast_max / raw_max, 3),
        "offered_jobs_per_s": offered,
        "offered_ratio_to_raw": round(offered / raw_max, 3),
        "steady_first_minute": round(_minute(steady, True)),
        "steady_last_minute": round(_minute(steady, False)),
        "steady_last_over_first": round(_minute(steady, False) / _minute(steady, True), 3),
        "steady_p99_ms_worst": max((s.p99_ms or 0.0) for s in steady),
        "steady_p50_commit_ms_worst": max((s.p50_commit_ms or 0.0) for s in steady),
        "steady_p99_commit_ms_worst": max((s.p99_commit_ms or 0.0) for s in steady),
        "hold_start_s": hold_start,
        "hold_seconds": hold_seconds,
        "held_first_minute": round(_minute(held, True)),
        "held_last_minute": round(_minute(held, False)),
        "held_last_over_first": round(_minute(held, False) / _minute(held, True), 3),
        "held_worst_jobs_per_s": min(s.jobs_per_s for s in held),
        "held_p99_ms_worst": max((s.p99_ms or 0.0) for s in held),
        "recovery_s": recovery_seconds(held, hold_end, offered),
        "steady": [asdict(s) for s in steady],
        "held": [asdict(s) for s in held],
    }
    record = bench._record("soak", target, **figures)
    echo(
        f"\nsoak at {offered:,.0f} jobs/s offered ({offered / raw_max:.2f} x the raw two-write loop):\n"
        f"  steady: last minute {figures['steady_last_minute']:,} jobs/s ="
        f" {figures['steady_last_over_first']:.2f} x the first; worst p99"
        f" {figures['steady_p99_ms_worst']:,.1f} ms; from the commit, worst p50"
        f" {figures['steady_p50_commit_ms_worst']:,.1f} ms, worst p99"
        f" {figures['steady_p99_commit_ms_worst']:,.1f} ms\n"
        f"  held:   last minute = {figures['held_last_over_first']:.2f} x the first; slowest 10 s"
        f" {figures['held_worst_jobs_per_s']:,} jobs/s; worst p99 {figures['held_p99_ms_worst']:,.1f} ms;"
        f" recovered {figures['recovery_s']} s after the transaction ended\n"
    )
    echo(minute_table(record))
    bench._write(results, record, echo)
    if plot is not None:
        _plot(record, plot, echo)
    return record


def minute_table(record: dict[str, Any]) -> str:
    """Both phases minute by minute, as a Markdown table (bench/RESULTS.md)."""
    lines = [
        "| minute | steady jobs/s | p99 ms | from the commit p50 / p99 ms | dead rows | table + indexes MB"
        " | held jobs/s | p99 ms | from the commit p50 / p99 ms | dead rows | table + indexes MB | backlog |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_minute = max(1, int(60 / SAMPLE_SECONDS))
    phases = [record["steady"], record["held"]]
    for m in range(max(len(p) for p in phases) // per_minute):
        cells = [str(m + 1)]
        for phase in phases:
            window = phase[m * per_minute : (m + 1) * per_minute]
            cells += [
                f"{sum(s['jobs_per_s'] for s in window) / len(window):,.0f}",
                f"{max(s['p99_ms'] or 0.0 for s in window):,.0f}",
                f"{max(s.get('p50_commit_ms') or 0.0 for s in window):,.1f}"
                f" / {max(s.get('p99_commit_ms') or 0.0 for s in window):,.0f}",
                f"{max(s['dead_rows'] for s in window):,}",
                f"{window[-1]['table_mb'] + window[-1]['index_mb']:,.0f}",
            ]
        cells.append(f"{max(s['backlog'] for s in phases[1][m * per_minute : (m + 1) * per_minute]):,}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(record: dict[str, Any], path: Path, echo: Callable[[str], None]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo("no plot: matplotlib is not installed (pip install 'fastjobs[plot]')\n")
        return
    panels = (
        ("jobs_per_s", "jobs/s completed"),
        ("p99_ms", "pickup p99 (ms), and from the commit"),
        ("backlog", "available jobs"),
        ("mb", "jobs' partitions (MB)"),
        ("dead_rows", "dead rows"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 13), sharex=True)
    hold = (record["hold_start_s"], record["hold_start_s"] + record["hold_seconds"])
    for ax, (key, label) in zip(axes, panels, strict=True):
        for phase, style in (("steady", "-"), ("held", "--")):
            xs = [s["at"] for s in record[phase]]
            if key == "mb":
                ax.plot(xs, [s["table_mb"] for s in record[phase]], style, label=f"{phase}: table")
                ax.plot(xs, [s["index_mb"] for s in record[phase]], style, label=f"{phase}: indexes")
            elif key == "p99_ms":
                for field, name in (("p99_ms", "from the COPY"), ("p99_commit_ms", "from the commit")):
                    ys = [s.get(field) for s in record[phase]]
                    ax.plot(xs, [math.nan if y is None else y for y in ys], style, label=f"{phase}: {name}")
            else:
                ax.plot(
                    xs,
                    [s[key] if s[key] is not None else math.nan for s in record[phase]],
                    style,
                    label=phase,
                )
        ax.axvspan(
            *hold, color="orange", alpha=0.15, label="held transaction" if key == "jobs_per_s" else None
        )
        if key == "jobs_per_s":
            ax.axhline(record["offered_jobs_per_s"], color="grey", linewidth=0.8, label="offered")
        if key == "p99_ms":
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(
        f"fastjobs soak: {record['offered_jobs_per_s']:,} jobs/s offered"
        f" ({record['offered_ratio_to_raw']:.2f} x raw limit), {record['processes']} processes,"
        f" PostgreSQL {record['postgres'].split()[0]}, {record['commit']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    echo(f"plot written to {path}\n")


__all__ = ["Histograms", "Pickup", "Sample", "measure_maximum", "percentile", "recovery_seconds", "run_soak"]
