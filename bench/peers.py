"""Peers beside fastjobs: procrastinate, PgQueuer and graphile-worker drain the same no-op jobs as
`fastjobs run`, with the raw-SQL limit in the same run.

The peers are no dependencies of fastjobs; install them beside it (the Python ones in the venv
that holds fastjobs, graphile-worker under bench/peers/, Node 20 or newer):

    pip install procrastinate pgqueuer asyncpg
    npm install --prefix bench/peers
    python bench/peers.py --dsn postgresql://postgres@127.0.0.1:5432/postgres --jobs 20000 --repeat 3

Each round runs every contender once, in turn (alternating), with `--processes` worker processes
each, on the same number of no-op jobs enqueued before the clock starts; the clock stops when the
last process has exited with the queue empty, and the harness checks it is. Contenders:

- `raw`: `fastjobs bench`'s raw drainer, the UPDATE claim of `--batch` jobs then DELETE by id
  array (two writes per job), no fastjobs code: every ratio is against its median.
- `fastjobs`: the real `fastjobs run` (master, workers, leader) with its defaults, fast lane on.
- `procrastinate`: an `async` no-op task (its docs: concurrency is for async tasks), `concurrency`
  sub-workers per process (10: faster here than its docs' example of 30) with a pool of as many
  connections, `delete_jobs="always"`,
  `wait=False` (exits once it finds no job), `listen_notify=False` (a drain that never waits
  needs no listener); jobs deferred with its `batch_defer`.
- `pgqueuer`: an async no-op entrypoint, `QueueManager.run(batch_size, mode=drain)` on asyncpg;
  a finished job is deleted from its queue table and logged (its design); jobs enqueued by one
  list `Queries.enqueue`.
- `graphile-worker`: `bench/peers/graphile_drain.js` (`runOnce`) with its Performance page's
  settings: `concurrentJobs`, a local queue, batched completion; jobs added by one `add_jobs`.

Every peer gets a fresh database per run, with `synchronous_commit=off` set on it: the durability
fastjobs' worker sessions and the raw loop run with (`fastjobs sql show worker_session`). fastjobs
and the raw loop share `fastjobs bench`'s database, truncated and vacuumed before each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from psycopg.conninfo import make_conninfo

from fastjobs.bench import BENCH_DB, _drain_once, _master_once, _raw_drainer, bench_dsn, spread
from fastjobs.impl import IMPLEMENTATION

logger = logging.getLogger("bench.peers")
HERE = Path(__file__).resolve().parent
GRAPHILE = HERE / "peers"
PEER_DB = f"{BENCH_DB}_peer"  # FASTJOBS_BENCH_DB names both, for benchmarks sharing a server
CHUNK = 10_000  # jobs per enqueue statement of the peers


# A peer's drain: (its fresh database, jobs, processes, the options) -> (seconds, CPU seconds).
Drain = Callable[[str, int, int, argparse.Namespace], tuple[float, float]]


class Run(NamedTuple):
    """One contender's drain: its wall-clock seconds, its processes' CPU seconds, the load then."""

    seconds: float
    cpu: float
    load: float


class Row(NamedTuple):
    """A contender's line of the table: median rate, the runs' range, ratio to the baseline."""

    name: str
    rate: float
    low: float
    high: float
    ratio: float
    cpu_us: float


def summarise(jobs: int, runs: dict[str, list[Run]], baseline: str = "raw") -> list[Row]:
    """Median jobs/s of each contender's runs and its ratio to the baseline's median of the same runs."""
    rates = {name: [jobs / run.seconds for run in r] for name, r in runs.items()}
    limit = statistics.median(rates[baseline])
    return [
        Row(
            name,
            statistics.median(rates[name]),
            min(rates[name]),
            max(rates[name]),
            statistics.median(rates[name]) / limit,
            statistics.median(run.cpu / jobs * 1e6 for run in r),
        )
        for name, r in runs.items()
    ]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _fresh_db(dsn: str) -> str:
    """The peers' database, dropped and created empty, with a fastjobs worker's durability."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {PEER_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {PEER_DB}")
        conn.execute(f"ALTER DATABASE {PEER_DB} SET synchronous_commit = off")
    return make_conninfo(dsn, dbname=PEER_DB)


def _url(dsn: str) -> str:
    """The DSN as a URL, for the clients that take nothing else (asyncpg, node-postgres)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    auth = str(params.get("user", "postgres")) + (f":{params['password']}" if "password" in params else "")
    host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
    return f"postgresql://{auth}@{host}:{port}/{params['dbname']}"


def _forked(processes: int, work: Callable[[Any, Any], None]) -> tuple[float, float]:
    """Fork `processes` children running `work(ready, start)`; time them from the start to the last exit."""
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    cpu = _children_cpu()
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            try:
                work(ready, start)
            except BaseException:
                logger.exception("peer worker %d failed", os.getpid())
                os._exit(1)
            os._exit(0)
        pids.append(pid)
    ready.wait()
    start.wait()
    began = time.perf_counter()
    failed = [status for pid in pids if (status := os.waitpid(pid, 0)[1]) != 0]
    seconds = time.perf_counter() - began
    if failed:
        raise SystemExit(f"a peer worker failed (status {failed[0]})")
    return seconds, _children_cpu() - cpu


def _analyze(dsn: str) -> None:
    """Statistics of the enqueued jobs, taken before the clock starts, as autovacuum's analyze would.

    This server runs with autovacuum off: without them procrastinate's planner takes its 20,000
    jobs for 11 and sorts all of them for each job it fetches (28 ms a fetch, measured).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE")


def _left(dsn: str, table: str) -> None:
    with psycopg.connect(dsn) as conn:
        left = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    if left != (0,):
        raise SystemExit(f"{table} still holds {left} jobs after the drain")


# --- procrastinate ---------------------------------------------------------------------------


def _procrastinate_app(dsn: str, connections: int) -> Any:
    import procrastinate

    connector = procrastinate.PsycopgConnector(conninfo=dsn, min_size=connections, max_size=connections)
    app = procrastinate.App(connector=connector)

    @app.task(name="noop", queue="bench")
    async def noop() -> None:
        return None

    return app


def procrastinate_once(
    dsn: str, jobs: int, processes: int, options: argparse.Namespace
) -> tuple[float, float]:
    app = _procrastinate_app(dsn, 1)

    async def prepare() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            task = app.tasks["noop"]
            for first in range(0, jobs, CHUNK):
                await task.batch_defer_async(*({} for _ in range(min(CHUNK, jobs - first))))

    asyncio.run(prepare())
    _analyze(dsn)
    concurrency = options.procrastinate_concurrency

    def work(ready: Any, start: Any) -> None:
        worker_app = _procrastinate_app(dsn, concurrency)

        async def run() -> None:
            async with worker_app.open_async():  # its pool open before the clock
                ready.wait()
                start.wait()
                await worker_app.run_worker_async(
                    queues=["bench"],
                    concurrency=concurrency,
                    wait=False,
                    delete_jobs="always",
                    listen_notify=False,
                    install_signal_handlers=False,
                )

        asyncio.run(run())

    measured = _forked(processes, work)
    _left(dsn, "procrastinate_jobs")
    return measured


# --- PgQueuer ----------------------------------------------------------------------------------


def pgqueuer_once(dsn: str, jobs: int, processes: int, options: argparse.Namespace) -> tuple[float, float]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    url = _url(dsn)

    async def prepare() -> None:
        conn = await asyncpg.connect(url)
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        for first in range(0, jobs, CHUNK):
            n = min(CHUNK, jobs - first)
            await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
        await conn.close()

    asyncio.run(prepare())
    _analyze(dsn)

    def work(ready: Any, start: Any) -> None:
        async def run() -> None:
            conn = await asyncpg.connect(url)
            qm = QueueManager(Queries(AsyncpgDriver(conn)))

            @qm.entrypoint("noop")
            async def noop(job: Any) -> None:
                return None

            ready.wait()
            start.wait()
            await qm.run(batch_size=options.pgqueuer_batch, mode=QueueExecutionMode.drain)
            await conn.close()

        asyncio.run(run())

    measured = _forked(processes, work)
    _left(dsn, "pgqueuer")
    return measured


# --- graphile-worker ---------------------------------------------------------------------------

# graphile_add_noops: $1 no-op jobs by graphile-worker's documented bulk enqueue, add_jobs.
graphile_add_noops = """
SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(
    SELECT ROW('noop', '{}'::json, NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec
      FROM generate_series(1, %s)))"""


def graphile_once(dsn: str, jobs: int, processes: int, options: argparse.Namespace) -> tuple[float, float]:
    url, node = _url(dsn), shutil.which("node") or "node"
    cli = GRAPHILE / "node_modules" / ".bin" / "graphile-worker"
    subprocess.run([str(cli), "--schema-only", "-c", url], check=True, capture_output=True, cwd=GRAPHILE)
    with psycopg.connect(dsn) as conn:
        for first in range(0, jobs, CHUNK):
            conn.execute(graphile_add_noops, (min(CHUNK, jobs - first),))
    _analyze(dsn)
    args = [node, "graphile_drain.js", url, str(options.graphile_jobs), str(options.graphile_local_queue)]
    cpu = _children_cpu()
    workers = [
        subprocess.Popen(args, cwd=GRAPHILE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    for worker in workers:
        if worker.stdout is None or worker.stdout.readline() != "ready\n":
            raise SystemExit("a graphile-worker process did not start")
    began = time.perf_counter()
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.close()
    failed = [code for worker in workers if (code := worker.wait()) != 0]
    seconds = time.perf_counter() - began
    if failed:
        raise SystemExit(f"a graphile-worker process failed (exit {failed[0]})")
    _left(dsn, "graphile_worker._private_jobs")
    return seconds, _children_cpu() - cpu


PEERS: dict[str, Drain] = {
    "procrastinate": procrastinate_once,
    "pgqueuer": pgqueuer_once,
    "graphile-worker": graphile_once,
}


def versions(names: Iterable[str]) -> dict[str, str]:
    """The installed version of each peer (graphile-worker's from its package.json under bench/peers)."""
    found = {}
    for name in names:
        if name == "graphile-worker":
            package = GRAPHILE / "node_modules" / "graphile-worker" / "package.json"
            found[name] = json.loads(package.read_text())["version"]
        else:
            found[name] = metadata.version(name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("FASTJOBS_DSN"), required="FASTJOBS_DSN" not in os.environ
    )
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1_000, help="the raw loop's and fastjobs' claim")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS))
    # Its docs' example is 30; on 2 cores 10 drained faster (bench/RESULTS.md).
    parser.add_argument("--procrastinate-concurrency", type=int, default=10)
    parser.add_argument("--pgqueuer-batch", type=int, default=100)
    parser.add_argument("--graphile-jobs", type=int, default=24, help="concurrentJobs, its docs' figure")
    parser.add_argument("--graphile-local-queue", type=int, default=500, help="its docs' figure")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("procrastinate", "pgqueuer"):  # their per-job and start-up lines; errors still show
        logging.getLogger(noisy).setLevel(logging.ERROR)
    peers = [name for name in options.peers.split(",") if name]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"no such peer: {', '.join(sorted(unknown))}")
    installed = versions(peers)
    target = bench_dsn(options.dsn)

    def echo(text: str) -> None:  # fastjobs' drains' progress lines: their finished lines only
        if not text.startswith("\r"):
            logger.info(text.rstrip("\n"))

    runs: dict[str, list[Run]] = {name: [] for name in ("raw", "fastjobs", *peers)}
    for run in range(options.repeat):
        for name in runs:
            load = os.getloadavg()[0]
            if name == "raw":
                measured = _drain_once(
                    target, options.jobs, options.processes, _raw_drainer, (options.batch, False, False), echo
                )
            elif name == "fastjobs":
                measured = _master_once(
                    target, options.jobs, options.processes, options.batch, False, False, echo
                )
            else:
                measured = PEERS[name](_fresh_db(options.dsn), options.jobs, options.processes, options)
            runs[name].append(Run(*measured, load))
            logger.info(
                f"  run {run + 1}/{options.repeat} {name:16s} {options.jobs / measured[0]:>10,.0f} jobs/s"
                f"   CPU {measured[1] / options.jobs * 1e6:7.1f} us/job   load {load:.1f}"
            )
    labels = {
        "raw": f"raw SQL: UPDATE claim {options.batch:,} + DELETE",
        "fastjobs": f"fastjobs run ({IMPLEMENTATION})",
        "procrastinate": f"procrastinate {installed.get('procrastinate')}",
        "pgqueuer": f"PgQueuer {installed.get('pgqueuer')}",
        "graphile-worker": f"graphile-worker {installed.get('graphile-worker')}",
    }
    with psycopg.connect(options.dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    loads = [r.load for contender in runs.values() for r in contender]
    logger.info(
        f"\ndrain of {options.jobs:,} no-op jobs, {options.processes} processes each, PostgreSQL"
        f" {version[0] if version else '?'}, load average {min(loads):.1f}-{max(loads):.1f}"
    )
    logger.info(f"{'':<36}{'jobs/s':>10}{'runs min-max':>22}{'ratio':>8}{'CPU us/job':>12}")
    for row in summarise(options.jobs, runs):
        shown = spread([row.low, row.high])
        logger.info(
            f"{labels[row.name]:<36}{row.rate:>10,.0f}{shown:>22}{row.ratio:>8.3f}{row.cpu_us:>12.1f}"
        )
    logger.info("ratio: against the raw UPDATE claim + DELETE of the same runs (two writes per job)")


if __name__ == "__main__":
    main()
