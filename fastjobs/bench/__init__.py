"""`fastjobs bench`: fastjobs beside the raw-SQL limit measured in the same run.

A subpackage imported only by that command (`fastjobs.cli` imports it on
demand), as River keeps `cmd/river/riverbench` out of the library.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from .. import bulk, database, enqueue, schema, sql
from ..app import App
from ..context import current_job
from ..errors import FastjobsError
from ..impl import IMPLEMENTATION, core
from ..logs import plural
from ..maintenance import CleanerConfig, clean_once
from ..master import Master
from ..scoreboard import Scoreboard, find
from ..sharding import DEFAULT_CONCURRENCY
from ..worker import Worker, WorkerConfig
from . import queries

logger = logging.getLogger(__name__)

# FASTJOBS_BENCH_DB: another name, so benchmarks sharing a server do not truncate each other's jobs.
BENCH_DB = os.environ.get("FASTJOBS_BENCH_DB", "fastjobs_bench")
BENCH_KIND = "fastjobs.bench.noop"


def bench_dsn(dsn: str) -> str:
    """A dedicated database beside the given one, created and migrated on demand.

    The benchmark truncates the jobs table between runs: it must never touch
    the user's own jobs.
    """
    with database.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DB,)).fetchone()
        if not exists:
            conn.execute(f"CREATE DATABASE {BENCH_DB}")
    target = make_conninfo(dsn, dbname=BENCH_DB)
    with database.connect(target) as conn:
        schema.migrate(conn)
    return target


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE fastjobs_jobs_all RESTART IDENTITY")
        conn.execute("VACUUM ANALYZE fastjobs_jobs_all")


def raw_copy_data(rows: list[dict[str, Any]], kind: str = BENCH_KIND) -> bytes:
    """Rows of `kind` as binary COPY data for sql.job_copy, encoded before any clock starts."""
    _, prefix, suffix = bulk.copy_layout(enqueue.options(kind, None), dt.datetime.now(dt.UTC))
    body: bytes
    body, _ = core.encode_copy_rows(kind, iter(rows), prefix, suffix, len(rows), None, frozenset())
    return bulk.COPY_HEADER + body + bulk.COPY_TRAILER


def _raw_copy(dsn: str, rows: list[dict[str, Any]]) -> float:
    """The limit: one binary COPY of rows encoded before the clock starts."""
    data = raw_copy_data(rows)
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        with conn.cursor() as cur, cur.copy(sql.job_copy) as copy:
            copy.write(data)
        conn.commit()
        return time.perf_counter() - start


def _plain(i: int, email: str) -> None:
    """The enqueue benchmark's handler: its plain-typed arguments are checked at each enqueue."""


def _fastjobs_copy(dsn: str, rows: list[dict[str, Any]]) -> float:
    app = App(dsn)
    app.job(kind=BENCH_KIND)(_plain)
    with contextlib.closing(app), psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        app.enqueue_many(BENCH_KIND, rows, conn=conn)
        conn.commit()
        return time.perf_counter() - start


def _enqueue_noops(dsn: str, jobs: int) -> None:
    """`jobs` no-op jobs in one COPY, committed before it returns."""
    with contextlib.closing(App(dsn)) as app:
        app.enqueue_many(BENCH_KIND, ({"i": i} for i in range(jobs)))


def run_enqueue(
    dsn: str, jobs: int, repeat: int, results: Path | None, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Enqueue `jobs` rows with enqueue_many and with a bare COPY, alternating; medians."""
    target = bench_dsn(dsn)
    rows = [{"i": i, "email": f"user{i}@example.com"} for i in range(jobs)]
    times: dict[str, list[float]] = {"fastjobs": [], "raw": []}
    for run in range(repeat):
        for name, fn in (("fastjobs", _fastjobs_copy), ("raw", _raw_copy)):
            _reset(target)
            seconds = fn(target, rows)
            times[name].append(seconds)
            echo(f"  run {run + 1}/{repeat} {name:8s} {jobs / seconds:>10,.0f} jobs/s\n")
    fast = jobs / statistics.median(times["fastjobs"])
    raw = jobs / statistics.median(times["raw"])
    rates = {name: [jobs / s for s in t] for name, t in times.items()}
    record = _record(
        "enqueue",
        target,
        jobs=jobs,
        repeat=repeat,
        fastjobs_jobs_per_s=round(fast),
        raw_copy_jobs_per_s=round(raw),
        ratio=round(fast / raw, 3),
        fastjobs_jobs_per_s_runs=[round(r) for r in rates["fastjobs"]],
        raw_copy_jobs_per_s_runs=[round(r) for r in rates["raw"]],
    )
    echo(f"\n{'enqueue':<28}{'jobs/s':>12}{'runs min-max':>20}{'ratio':>8}\n")
    echo(f"{'raw binary COPY':<28}{raw:>12,.0f}{spread(rates['raw']):>20}{1.0:>8.2f}\n")
    echo(f"{'fastjobs enqueue_many':<28}{fast:>12,.0f}{spread(rates['fastjobs']):>20}{fast / raw:>8.2f}\n")
    costs = typed_costs()
    record["typed_us_per_job"] = costs
    echo(f"\n{'typed arguments, per job':<28}{'enqueue us':>12}{'run us':>8}\n")
    for name, (encode_us, decode_us) in costs.items():
        echo(f"{name:<28}{encode_us:>12.2f}{decode_us:>8.2f}\n")
    _write(results, record, echo)
    return record


def typed_costs(number: int = 20_000) -> dict[str, tuple[float, float]]:
    """Microseconds per job to check and convert one argument at enqueue, and back at execution.

    Beside plain types (`i: int, email: str`): a dataclass, a msgspec.Struct
    and a pydantic model of the same three fields (a str, an int, a
    datetime), the last two when installed.
    """
    import dataclasses
    import timeit

    from .. import typed

    now = dt.datetime.now(dt.UTC)

    @dataclasses.dataclass
    class Record:
        name: str
        n: int
        at: dt.datetime

    def plain(i: int, email: str) -> None: ...

    def record(r: Record) -> None: ...

    cases: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
        "plain": (plain, {"i": 1, "email": "user1@example.com"}),
        "dataclass": (record, {"r": Record("a", 1, now)}),
    }
    with contextlib.suppress(ImportError):
        import msgspec

        class Struct(msgspec.Struct):
            name: str
            n: int
            at: dt.datetime

        def struct(r: Struct) -> None: ...

        cases["msgspec.Struct"] = (struct, {"r": Struct("a", 1, now)})
    with contextlib.suppress(ImportError):
        import pydantic

        class Model(pydantic.BaseModel):
            name: str
            n: int
            at: dt.datetime

        def model(r: Model) -> None: ...

        cases["pydantic.BaseModel"] = (model, {"r": Model(name="a", n=1, at=now)})
    costs = {}
    for name, (func, args) in cases.items():
        func.__annotations__ = typing.get_type_hints(func, localns=locals())
        schema = typed.schema(name, func)
        assert schema is not None
        stored = schema.encode(args)
        call = schema.converter(func, is_async=False) or func
        # The best of 5: the least disturbed by a busy machine.
        encode_s = min(timeit.repeat(lambda: schema.encode(args), number=number // 5, repeat=5))  # noqa: B023
        decode_s = min(timeit.repeat(lambda: call(**stored), number=number // 5, repeat=5))  # noqa: B023
        costs[name] = (round(encode_s / (number // 5) * 1e6, 2), round(decode_s / (number // 5) * 1e6, 2))
    return costs


def _record(bench: str, dsn: str, **figures: Any) -> dict[str, Any]:
    """One JSON line: what ran, where, on which commit, and its figures."""
    return {
        "bench": bench,
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "implementation": IMPLEMENTATION,
        "postgres": _server_version(dsn),
        "commit": _git_commit(),
        **figures,
    }


def _write(results: Path | None, record: dict[str, Any], echo: Callable[[str], None]) -> None:
    if results is None:
        return
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    echo(f"result appended to {results}\n")


def _server_version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def echo(text: str) -> None:
    """Progress and tables on stdout; a leading \\r rewrites the progress line on a terminal.

    Elsewhere (a log, a pipe) a reading that a later one would overwrite is
    left out, and a final line is written as a line of its own: `\\r` in a
    file joins every reading into one line.
    """
    if text.startswith("\r"):
        if not sys.stdout.isatty():
            if not text.endswith("\n"):
                return
            text = text[1:]
        else:
            text = "\r\x1b[K" + text[1:]  # erase what a longer reading left on the line
    sys.stdout.write(text)
    sys.stdout.flush()


def spread(values: list[float]) -> str:
    """The range of repeated runs' figures, "48,210-51,877" (one run: "-")."""
    return f"{min(values):,.0f}-{max(values):,.0f}" if len(values) > 1 else "-"


# --- drain: fastjobs workers against the leanest psycopg loop -------------------------------


def _noop(**_: Any) -> None:
    return None


def _noop_middleware(job: Any, call_next: Callable[[], Any]) -> Any:
    return call_next()


def _bench_app(dsn: str, middleware: bool = False) -> App:
    """The no-op job; with `middleware`, behind one no-op middleware (its cost per job)."""
    app = App(dsn)
    app.job(kind=BENCH_KIND)(_noop)
    if middleware:
        app.middleware(_noop_middleware)
    return app


def _fastjobs_drainer(
    dsn: str, batch: int, overlap: bool, keep: bool, middleware: bool, ready: Any, start: Any
) -> None:
    app = _bench_app(dsn, middleware)

    def on_ready() -> None:
        ready.wait()
        start.wait()

    config = WorkerConfig(batch_max=batch, overlap=overlap, keep_completed=keep)
    worker = Worker(app, config=config, exit_when_empty=True, on_ready=on_ready)
    worker.run()


def _raw_drainer(dsn: str, batch: int, keep: bool, locked: bool, ready: Any, start: Any) -> None:
    """A limit: fastjobs' claim, then DELETE (or mark completed) by id array; no fastjobs code.

    Two loops, one per lane: the state lane's UPDATE claim (each job written
    'running', then deleted: two writes) in autocommit, and with `locked` the
    fast lane's claim (rows locked FOR UPDATE SKIP LOCKED, then deleted in
    the same transaction: one write). Its session has the same durability as
    a worker's (sql.worker_session).
    """
    complete = queries.bench_raw_complete_keep if keep else queries.bench_raw_complete
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        cur = psycopg.RawCursor(conn)
        cur.execute(sql.worker_session)
        worker = f"raw:{os.getpid()}"
        ready.wait()
        start.wait()
        while True:
            if locked:
                cur.execute(sql.fast_begin)
                ids = [row[0] for row in cur.execute(sql.job_lock_many, ("default", batch))]
            else:
                ids = [row[0] for row in cur.execute(sql.job_claim_many, ("default", batch, worker))]
            if ids:
                cur.execute(complete, (ids,))
            if locked:
                cur.execute(sql.fast_commit)
            if not ids:
                return


def _child(target: Callable[..., None], *args: Any) -> None:
    try:
        target(*args)
    except BaseException:
        logger.exception("benchmark process %d failed", os.getpid())
        os._exit(1)
    os._exit(0)


def _drain_once(
    dsn: str,
    jobs: int,
    processes: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
    echo: Callable[[str], None],
    reset: bool = True,
) -> tuple[float, float]:
    """Fork `processes` drainers; once they are connected, enqueue and start them together.

    Every contender meets the same table: the jobs of one fresh COPY, made
    visible by its commit just before the clock starts.
    """
    if reset:
        _reset(dsn)
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            _child(target, dsn, *args, ready, start)
        pids.append(pid)
    ready.wait()
    _enqueue_noops(dsn, jobs)
    start.wait()
    began = time.perf_counter()
    cpu = 0.0
    left = set(pids)
    ended = began
    next_echo = began + 0.5
    with psycopg.connect(dsn, autocommit=True) as watch:
        # The end is the last drainer's exit, seen within 2 ms; progress is
        # read from the database only twice a second.
        while left:
            for pid in list(left):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done:
                    ended = time.perf_counter()
                    left.discard(pid)
                    cpu += usage.ru_utime + usage.ru_stime
                    if status != 0:
                        raise FastjobsError(f"a benchmark process failed (status {status})")
            if left and time.perf_counter() >= next_echo:
                remaining = watch.execute(queries.bench_available_count).fetchone()[0]  # type: ignore[index]
                echo(f"\r    {jobs - remaining:>10,} / {jobs:,} jobs done")
                next_echo = time.perf_counter() + 0.5
            time.sleep(0.002)
    seconds = ended - began
    return seconds, cpu


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def master_running(
    make_app: Callable[[], App], processes: int, batch: int, keep: bool = False, fast_lane: bool = True
) -> Iterator[Scoreboard]:
    """A real `fastjobs run` (master, workers, leader) forked for a benchmark, its workers ready.

    Yields the master's shared-memory counters; its stderr is kept aside and
    shown only if the benchmark fails; SIGTERM stops it at the end.
    """
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    pid = os.fork()
    if pid == 0:
        os.dup2(log.fileno(), 2)
        queues = {"default": processes * DEFAULT_CONCURRENCY}
        config = WorkerConfig(batch_max=batch, keep_completed=keep, fast_lane=fast_lane)
        os._exit(Master(make_app(), processes, queues, worker=config).run())
    try:
        board = _await_slots(pid, processes)
        try:
            yield board
        finally:
            board.close()
    except BaseException:
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace"))
        raise
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        log.close()


def _master_once(
    dsn: str,
    jobs: int,
    processes: int,
    batch: int,
    keep: bool,
    middleware: bool,
    echo: Callable[[str], None],
    fast_lane: bool = True,
) -> tuple[float, float]:
    """The real `fastjobs run` path: a Master with its workers and leader (`fast_lane`: --no-fast-lane).

    The workers start idle; one COPY makes every job visible at once (its
    commit is the start); the end is read from the master's shared-memory
    counters, so no query competes with the drain.
    """
    _reset(dsn)
    with master_running(lambda: _bench_app(dsn, middleware), processes, batch, keep, fast_lane) as board:
        _enqueue_noops(dsn, jobs)
        began = time.perf_counter()
        workers = [board[i] for i in range(processes)]
        next_echo = 0.0
        while (done := sum(w["completed"] for w in workers)) < jobs:
            now = time.perf_counter()
            if now >= next_echo:
                echo(f"\r    {int(done):>10,} / {jobs:,} jobs done")
                next_echo = now + 0.5
            time.sleep(0.002)
        seconds = time.perf_counter() - began
        cpu = sum(_proc_cpu(int(w["pid"])) for w in workers)
    return seconds, cpu


def _await_slots(master_pid: int, processes: int, timeout: float = 30.0) -> Scoreboard:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = find(master_pid)
        board = Scoreboard.open(path) if path is not None else None
        if board is not None:
            if all(
                board[i]["role"] and board[i]["heartbeat"] > board[i]["started"] for i in range(processes)
            ):
                return board
            board.close()
        if os.waitpid(master_pid, os.WNOHANG)[0]:
            raise FastjobsError("the benchmark's master exited before its workers were ready")
        time.sleep(0.01)
    raise FastjobsError("the benchmark's workers did not become ready in time")


# raw: the state lane's raw loop (UPDATE claim + DELETE); raw_locked: the fast lane's (locked claim + DELETE).
CONTENDERS = ("raw", "raw_locked", "worker", "master")
# With --compare-sync: the overlapped loop against a strictly sequential one.
CONTENDERS_SYNC = ("raw", "raw_locked", "worker", "worker_sync")
# With --compare-lanes: `fastjobs run` against `fastjobs run --no-fast-lane` (the state lane alone).
CONTENDERS_LANES = ("raw", "raw_locked", "master", "master_state")
# The raw loop each contender's ratio is taken against: the one of the lane its jobs take. No-op
# jobs all take the fast lane unless it is turned off.
BASELINE = {"master_state": "raw"}


def run_drain(
    dsn: str,
    jobs: int,
    processes: int,
    batch: int,
    repeat: int,
    compare_sync: bool,
    keep: bool,
    results: Path | None,
    echo: Callable[[str], None],
    middleware: bool = False,
    compare_lanes: bool = False,
) -> dict[str, Any]:
    """Drain `jobs` no-op jobs three ways, alternating, and report medians.

    raw: the leanest psycopg loop, the same claim and completion SQL;
    worker: fastjobs Worker processes forked directly (the hot loop alone);
    master: the real `fastjobs run` (master, workers, leader);
    worker_sync (instead of master, with `compare_sync`): the hot loop
    without overlap, claim, run, complete strictly in turn;
    master_state (with `compare_lanes`, instead of worker): `fastjobs run
    --no-fast-lane`, every job claimed as 'running' then finished.
    """
    target = bench_dsn(dsn)
    contenders = CONTENDERS_LANES if compare_lanes else CONTENDERS_SYNC if compare_sync else CONTENDERS
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for run in range(repeat):
        for name in contenders:
            if name in ("raw", "raw_locked"):
                raw_args = (batch, keep, name == "raw_locked")
                measured = _drain_once(target, jobs, processes, _raw_drainer, raw_args, echo)
            elif name in ("worker", "worker_sync"):
                args = (batch, name == "worker", keep, middleware)
                measured = _drain_once(target, jobs, processes, _fastjobs_drainer, args, echo)
            else:
                fast = name == "master"
                measured = _master_once(target, jobs, processes, batch, keep, middleware, echo, fast)
            runs[name].append(measured)
            echo(
                f"\r  run {run + 1}/{repeat} {name:11s} {jobs / measured[0]:>10,.0f} jobs/s"
                f"   worker CPU {measured[1] / jobs * 1e6:6.1f} us/job\n"
            )
    rates = {name: [jobs / s for s, _ in r] for name, r in runs.items()}
    rate = {name: statistics.median(r) for name, r in rates.items()}
    cpu = {name: statistics.median(c / jobs * 1e6 for _, c in r) for name, r in runs.items()}
    raws = ("raw", "raw_locked")
    ratio = {name: rate[name] / rate[BASELINE.get(name, "raw_locked")] for name in contenders}
    record = _record(
        "drain",
        target,
        jobs=jobs,
        processes=processes,
        batch=batch,
        keep_completed=keep,
        middleware=middleware,
        repeat=repeat,
        **{f"{name}_jobs_per_s": round(rate[name]) for name in contenders},
        **{f"{name}_jobs_per_s_runs": [round(r) for r in rates[name]] for name in contenders},
        **{f"{name}_cpu_us_per_job": round(cpu[name], 2) for name in contenders},
        **{f"{name}_ratio": round(ratio[name], 3) for name in contenders if name not in raws},
        **{f"{name}_baseline": BASELINE.get(name, "raw_locked") for name in contenders if name not in raws},
    )
    labels = {
        "raw": "raw SQL: UPDATE claim + DELETE",
        "raw_locked": "raw SQL: locked claim + DELETE",
        "worker": f"fastjobs workers ({IMPLEMENTATION})",
        "worker_sync": f"  without overlap ({IMPLEMENTATION})",
        "master": f"fastjobs run ({IMPLEMENTATION})",
        "master_state": f"  --no-fast-lane ({IMPLEMENTATION})",
    }
    title = f"drain, {plural(processes, 'process', 'processes')}"
    echo(f"\n{title:<32}{'jobs/s':>12}{'runs min-max':>20}{'ratio':>8}{'CPU us/job':>12}\n")
    for name in contenders:
        shown = "" if name in raws else f"{ratio[name]:.2f}"
        echo(f"{labels[name]:<32}{rate[name]:>12,.0f}{spread(rates[name]):>20}{shown:>8}{cpu[name]:>12.1f}\n")
    echo(
        "ratio: against the raw loop of the same lane: the fast lane's (the default for these no-op"
        " jobs) is the locked claim + DELETE, one write per job; --no-fast-lane's is the UPDATE claim"
        " + DELETE, two writes\n"
    )
    _write(results, record, echo)
    return record


# --- cleaner: deleting finished jobs beside a drain ----------------------------------------


def run_cleaner(
    dsn: str,
    finished: int,
    jobs: int,
    processes: int,
    batch: int,
    results: Path | None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """Seed `finished` completed jobs past their retention; drain `jobs` without, then with, the cleaner.

    Reports the cleaner's rows/s and the drain's rate in both runs (the
    cleaner must not slow the drain by more than 10%).
    """
    target = bench_dsn(dsn)
    _reset(target)
    echo(f"  seeding {finished:,} completed jobs\n")
    with psycopg.connect(target, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(queries.bench_seed_finished, (finished,))
        cur.execute("VACUUM ANALYZE fastjobs_jobs_all")
    args = (batch, True, False, False)
    alone, _ = _drain_once(target, jobs, processes, _fastjobs_drainer, args, echo, reset=False)
    echo(f"\r  drain alone            {jobs / alone:>10,.0f} jobs/s\n")
    cleaned: dict[str, Any] = {}

    def clean() -> None:
        """The leader's pacing: turns of at most `budget` seconds, rests between them."""
        config = CleanerConfig()
        deleted = 0
        with psycopg.connect(target, autocommit=True) as conn:
            began = time.perf_counter()
            while True:
                turn = time.perf_counter()
                deleted += clean_once(conn, config=config)["completed"]
                spent = time.perf_counter() - turn
                if spent < config.budget:
                    break
                time.sleep(config.rest(spent))
            cleaned["counts"] = {"completed": deleted}
            cleaned["seconds"] = time.perf_counter() - began

    cleaner = threading.Thread(target=clean)
    cleaner.start()
    beside, _ = _drain_once(target, jobs, processes, _fastjobs_drainer, args, echo, reset=False)
    echo("\r  waiting for the cleaner to finish its backlog...")
    cleaner.join()
    deleted = cleaned["counts"]["completed"]
    echo(f"\r  drain beside cleaner   {jobs / beside:>10,.0f} jobs/s\n")
    record = _record(
        "cleaner",
        target,
        finished=finished,
        deleted=deleted,
        cleaner_seconds=round(cleaned["seconds"], 2),
        cleaner_rows_per_s=round(deleted / cleaned["seconds"]),
        jobs=jobs,
        processes=processes,
        drain_alone_jobs_per_s=round(jobs / alone),
        drain_beside_cleaner_jobs_per_s=round(jobs / beside),
        drain_ratio=round(alone / beside, 3),
    )
    echo(
        f"\ncleaner: {deleted:,} rows in {cleaned['seconds']:.1f} s"
        f" = {record['cleaner_rows_per_s']:,} rows/s;"
        f" drain beside it at {record['drain_ratio']:.2f} x its rate alone\n"
    )
    _write(results, record, echo)
    return record


# --- latency: pickup time at a steady offered rate -------------------------------------------


def _latency_worker(dsn: str, batch: int, write: bool, out: Any, ready: Any, start: Any) -> None:
    app = App(dsn)
    started: dict[int, float] = {}
    rows: list[psycopg.Connection[Any]] = []  # the handlers' own connection (with `write`)

    @app.job(kind=BENCH_KIND)
    def stamp(**_: Any) -> None:
        job = current_job()
        assert job is not None
        started[job.id] = time.time()
        if write:
            psycopg.RawCursor(rows[0]).execute(queries.bench_row, (job.id,))

    def on_ready() -> None:
        if write:  # before the first job: an application's handler finds its connection open
            rows.append(psycopg.connect(dsn, autocommit=True))
        ready.wait()
        start.wait()

    worker = Worker(app, config=WorkerConfig(batch_max=batch), on_ready=on_ready)
    worker.install_signals()
    worker.run()
    out.put(started)


# The share of the rate asked for that the latency run must offer to be reported as at that rate.
RATE_REACHED = 0.95


def run_latency(
    dsn: str,
    rate: float,
    seconds: float,
    processes: int,
    batch: int,
    results: Path | None,
    echo: Callable[[str], None],
    write: bool = False,
) -> dict[str, Any]:
    """Offer `rate` single enqueues per second for `seconds`, each in its own transaction; pickup
    latency percentiles from the enqueue call and from its commit. With `write`, each handler also
    writes one row through its own connection (autocommit, default durability), as an application's
    job does: issue 22's measurement, where the handlers' commits share the WAL with the producers'."""
    target = bench_dsn(dsn)
    _reset(target)
    if write:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(queries.bench_rows_create)
            conn.execute(queries.bench_rows_reset)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ready, start = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    procs = [
        ctx.Process(target=_latency_worker, args=(target, batch, write, out, ready, start))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    ready.wait()
    start.wait()
    total = int(rate * seconds)
    # Each enqueue is a commit (about a millisecond with fsync): several
    # producers, each offering its share of the rate, keep the rate offered.
    producers = 4
    # The rate's clock starts once every producer is connected: producers that connect after it
    # would first offer a burst of the jobs they are late with, not the rate.
    began = 0.0

    def start_clock() -> None:
        nonlocal began
        began = time.perf_counter()

    connected = threading.Barrier(producers + 1, action=start_clock)

    sent: dict[int, tuple[float, float]] = {}

    def produce(index: int) -> None:
        try:
            with contextlib.closing(App(target)) as app, psycopg.connect(target, autocommit=True) as conn:
                connected.wait()
                for i in range(index, total, producers):
                    pause = began + i / rate - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    before = time.time()
                    job_id = app.enqueue(BENCH_KIND, {"i": i}, conn=conn)
                    sent[job_id] = (before, time.time())
        except threading.BrokenBarrierError:
            pass  # another producer could not connect: the run stops with its error
        except BaseException:
            connected.abort()
            raise

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    for thread in threads:
        thread.start()
    try:
        connected.wait()
    except threading.BrokenBarrierError:
        for thread in threads:
            thread.join()
        raise FastjobsError("a producer of the latency run could not connect (its error is above)") from None
    for thread in threads:
        thread.join()
    achieved = total / (time.perf_counter() - began)
    with psycopg.connect(target, autocommit=True) as conn:
        while conn.execute(queries.bench_available_count).fetchone()[0]:  # type: ignore[index]
            time.sleep(0.05)
    for p in procs:
        p.terminate()  # SIGTERM: the graceful stop
    started: dict[int, float] = {}
    for _ in procs:
        started.update(out.get(timeout=60))
    for p in procs:
        p.join()
    if not started:
        raise FastjobsError("no job ran during the latency benchmark")
    # From the enqueue call (its INSERT and commit included), and from the
    # moment the commit returned to the producer (the job was visible).
    from_call = sorted(started[i] - sent[i][0] for i in started if i in sent)
    from_commit = sorted(started[i] - sent[i][1] for i in started if i in sent)

    def pct(samples: list[float], q: float) -> float:
        return round(samples[min(len(samples) - 1, int(q * len(samples)))] * 1000, 3)

    record = _record(
        "latency",
        target,
        rate=rate,
        achieved_rate=round(achieved),
        # Within 5% of the rate asked for: a busy machine's producers may not keep up.
        rate_reached=achieved >= RATE_REACHED * rate,
        jobs=len(from_call),
        processes=processes,
        batch=batch,
        write=write,
        p50_ms=pct(from_call, 0.50),
        p90_ms=pct(from_call, 0.90),
        p99_ms=pct(from_call, 0.99),
        max_ms=pct(from_call, 1.0),
        from_commit_p50_ms=pct(from_commit, 0.50),
        from_commit_p90_ms=pct(from_commit, 0.90),
        from_commit_p99_ms=pct(from_commit, 0.99),
    )
    shortfall = ""
    if not record["rate_reached"]:
        shortfall = (
            f"  NOTE: {rate:,.0f} jobs/s was asked for and the producers offered {achieved:,.0f}: the"
            " machine could not enqueue faster; these figures are at that lower rate\n"
        )
    echo(
        f"\npickup latency at {achieved:,.0f} jobs/s offered of {rate:,.0f} asked ({processes} processes,"
        f" {IMPLEMENTATION}), {len(from_call):,} jobs{', handlers writing a row' if write else ''}\n"
        f"{shortfall}"
        f"  from the enqueue call: p50 {record['p50_ms']} ms   p90 {record['p90_ms']} ms"
        f"   p99 {record['p99_ms']} ms\n"
        f"  from its commit:       p50 {record['from_commit_p50_ms']} ms"
        f"   p90 {record['from_commit_p90_ms']} ms   p99 {record['from_commit_p99_ms']} ms\n"
    )
    _write(results, record, echo)
    return record
