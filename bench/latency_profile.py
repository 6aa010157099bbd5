"""The soak's steady phase with its pickup latency taken apart (issue 13 part 3's profile).

    FASTJOBS_DSN=postgresql://... python bench/latency_profile.py SECONDS [LOAD] [FIXED_MAX]

Measures the end-to-end maximum like `fastjobs bench --soak` (this script's
handler on both sides), offers LOAD (0.8) of it as one COPY every 10 ms for
10 s of warm-up plus SECONDS, and prints one JSON line: p50/p90/p99 in ms of
total (just before the COPY to handler start), commit (the producer's COPY and
commit), from_commit, and, with the C loop built with bench/latency_probe.patch (in history at 3699380)
(`git apply`, then `pip install -e .`; never commit it), table (commit to the
claim's send), statement (send to result) and batch (result to handler start).
LAT_DB names the bench database (fastjobs_bench_latency); LAT_NOTRUNC=1 sets
vacuum_truncate off on its jobs table. Per-batch records go to LAT_BATCHES.
"""

import array
import json
import mmap
import multiprocessing
import os
import sys
import time
from typing import Any

import psycopg

import fastjobs
import fastjobs.bench as bench
from fastjobs.app import App
from fastjobs.bench import soak
from fastjobs.impl import IMPLEMENTATION

bench.BENCH_DB = os.environ.get("LAT_DB", "fastjobs_bench_latency")

KIND = "fastjobs.bench.soak"
RING = 1 << 16
PARTS = ("total", "commit", "from_commit", "table", "statement", "batch")


class Ring:
    def __init__(self):
        self._map = mmap.mmap(-1, RING * 8)
        self.v: Any = memoryview(self._map).cast("d")


def make_app(dsn, hists, ring, slow):
    app = App(dsn)
    last = [0.0]
    try:
        from fastjobs._core import _probe
    except ImportError:
        _probe = None

    @app.job(kind=KIND)
    def soak_job(t: float, s: int = 0) -> None:
        now = time.time()
        total = now - t
        hists["total"].record(total)
        commit = ring.v[s % RING]
        if commit < t:  # not written yet: the job was seen before the producer noted its commit
            commit = now
        hists["commit"].record(commit - t)
        hists["from_commit"].record(max(now - commit, 0.0))
        if _probe is not None:
            sent, recv, full, n = _probe()
            table = max(0.0, sent - commit)
            stmt = recv - max(sent, commit)
            batch = now - recv
            hists["table"].record(table)
            hists["statement"].record(max(stmt, 0.0))
            hists["batch"].record(max(batch, 0.0))
            if recv != last[0]:
                last[0] = recv
                i = int(batches.v[0]) % 100000
                batches.v[0] += 1
                b = 1 + i * 7
                batches.v[b : b + 7] = (
                    memoryview(array.array("d", [now, total, n, full, recv - sent, sent, os.getpid() % 1000]))
                    .cast("B")
                    .cast("d")
                )
            if total > 0.05:
                slow.record_slow(commit - t, table, stmt, batch, full, n)

    return app


class Batches:
    def __init__(self):
        self._map = mmap.mmap(-1, (1 + 100000 * 7) * 8)
        self.v: Any = memoryview(self._map).cast("d")


batches = Batches()


class Slow:
    def __init__(self):
        self._map = mmap.mmap(-1, 64 * 8 * 8)
        self.v: Any = memoryview(self._map).cast("d")

    def record_slow(self, *xs):
        base = (os.getpid() % 64) * 8
        self.v[base] += 1
        for i, x in enumerate(xs):
            self.v[base + 1 + i] += x

    def total(self):
        out = [0.0] * 8
        for r in range(64):
            for i in range(8):
                out[i] += self.v[r * 8 + i]
        return out


def produce(dsn, rate, stop, sent, ring):
    app = App(dsn)
    began = time.perf_counter()
    done = 0
    seq = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            n = min(int((time.perf_counter() - began) * rate) - done, 20_000)
            if n <= 0:
                time.sleep(soak.TICK)
                continue
            t = time.time()
            seq += 1
            with conn.transaction():
                app.enqueue_many(KIND, [{"t": t, "s": seq}] * n, conn=conn)
            ring.v[seq % RING] = time.time()
            done += n
            sent.value = done


def main():
    dsn = os.environ["FASTJOBS_DSN"]
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60
    load = float(sys.argv[2]) if len(sys.argv) > 2 else soak.LOAD
    fixed = float(sys.argv[3]) if len(sys.argv) > 3 else 0
    processes, batch = 2, 1000
    target = bench.bench_dsn(dsn)
    with psycopg.connect(target, autocommit=True) as c:
        if os.environ.get("LAT_NOTRUNC") == "1":
            c.execute("ALTER TABLE fastjobs_jobs SET (vacuum_truncate = false)")
        else:
            c.execute("ALTER TABLE fastjobs_jobs RESET (vacuum_truncate)")
    hists = {k: soak.Histograms() for k in PARTS}
    ring, slow = Ring(), Slow()
    soak._soak_app = lambda dsn_, h_: make_app(dsn_, hists, ring, slow)
    h0 = hists["total"]
    if fixed:
        fast, raw = fixed, float("nan")
    else:
        fast, raw = soak.measure_maximum(target, processes, batch, h0, lambda s: None)
    rate = round(load * fast)
    ctx = multiprocessing.get_context("fork")
    bench._reset(target)
    stop, sent = ctx.Event(), ctx.Value("q", 0)
    with bench.master_running(lambda: make_app(target, hists, ring, slow), processes, batch):
        pid = soak._spawn(produce, target, rate, stop, sent, ring)
        try:
            time.perf_counter()
            time.sleep(10)  # warm-up
            base = {k: h.total() for k, h in hists.items()}
            sbase = slow.total()
            t0, s0 = time.perf_counter(), sent.value
            time.sleep(seconds)
            el = time.perf_counter() - t0
            tot = {k: [a - b for a, b in zip(h.total(), base[k], strict=False)] for k, h in hists.items()}
            done = tot["total"][0]
            st = [a - b for a, b in zip(slow.total(), sbase, strict=False)]
            enq = sent.value - s0
        finally:
            soak._reap([pid], stop)
    out = {
        "src": fastjobs.__file__.split("/")[-3],
        "notrunc": os.environ.get("LAT_NOTRUNC"),
        "ab": os.environ.get("FASTJOBS_LAT_AB"),
        "impl": IMPLEMENTATION,
        "max": round(fast),
        "raw": round(raw) if raw == raw else None,
        "rate": rate,
        "done_per_s": round(done / el),
        "enq_per_s": round(enq / el),
    }
    for k in PARTS:
        b = tot[k][1:]
        p50, p90, p99 = (soak.percentile(b, q) for q in (0.5, 0.9, 0.99))
        out[k] = [None if p is None else round(p * 1000, 2) for p in (p50, p90, p99)]
    if st[0]:
        out["slow>50ms"] = {
            "n": int(st[0]),
            "share": round(st[0] / max(done, 1), 4),
            "mean_commit": round(st[1] / st[0] * 1000, 1),
            "mean_table": round(st[2] / st[0] * 1000, 1),
            "mean_stmt": round(st[3] / st[0] * 1000, 1),
            "mean_batch": round(st[4] / st[0] * 1000, 1),
            "full_share": round(st[5] / st[0], 2),
            "mean_n": round(st[6] / st[0]),
        }
    print(json.dumps(out), flush=True)
    nb = int(batches.v[0])
    recs = [tuple(batches.v[1 + i * 7 : 8 + i * 7]) for i in range(min(nb, 100000))]
    with open(os.environ.get("LAT_BATCHES", "/tmp/latency_batches.json"), "w") as f:
        json.dump(recs, f)


if __name__ == "__main__":
    main()
