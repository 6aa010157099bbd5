"""The master: imports the app once, forks workers and the leader, supervises them.

It is gunicorn's arbiter: signal handlers only queue the signal and wake the
loop; one loop turns each into an action, reaps children with
waitpid(WNOHANG), restarts what died (with backoff), kills what stopped
beating (hung or stopped), and on shutdown waits for in-flight work up to a grace
period. It runs no jobs and holds no database connection (it opens one
before forking, to check the database, and closes it): what a dead worker
held is given back by a releaser, a short-lived child it forks (see _release).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from types import ModuleType

import psycopg

from . import database, schema
from .app import App
from .children import EXIT_BOOT_ERROR, EXIT_CRASH, EXIT_OK, Backoff, die_with, fork, how_it_ended
from .errors import ConfigurationError, DatabaseUnavailable, FastjobsError, SchemaMissing
from .heartbeat import host_id, make_worker_id
from .impl import IMPLEMENTATION
from .leader import Leader, LeaderConfig
from .logs import job_fields, plural
from .metrics import MetricsProcess
from .scoreboard import Labels, Scoreboard, database_identity
from .sharding import shard
from .stats import LEADER, WORKER, Card
from .worker import Supervision, Worker, WorkerConfig

__all__ = ["DEFAULT_WORKER_TIMEOUT", "RELEASE_TIMEOUT", "RELEASE_WAIT", "SAME_STOP_WINDOW", "Child", "Master"]

# A child whose card has not been beaten this long is hung or stopped (it
# beats every second, whatever length of job it runs): killed and replaced.
DEFAULT_WORKER_TIMEOUT = 60.0
# A second SIGTERM/SIGINT this soon after the first is the same stop (a
# group delivery reaching the master twice, SIGINT then SIGTERM from a
# wrapper); later, it is a deliberate "stop now".
SAME_STOP_WINDOW = 1.0
# The master waits this long for its releasers when it exits, then kills them.
RELEASE_WAIT = 15.0
# A releaser gives up on a database that does not answer within this many seconds.
RELEASE_TIMEOUT = 10


logger = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD}


@dataclass
class Child:
    index: int  # 0..N-1 workers, N the leader
    role: int
    pid: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None
    last_progress: float = 0.0
    seen_progress: float = -1.0
    killed: bool = False
    worker_id: str = ""  # make_worker_id(token, pid) of the running process
    careful: bool = False  # the next one runs one job per batch for a while (see _blame)


class Master:
    """`fastjobs run`: N workers and one leader under supervision.

    `worker` holds the workers' settings (its `grace` is also the master's
    deadline on stop); each worker's concurrency is its share of `queues`,
    and for the queues in `threaded` its share is also how many of their
    sync jobs it runs at once, on threads.
    """

    def __init__(
        self,
        app: App,
        processes: int,
        queues: dict[str, int],
        *,
        worker: WorkerConfig | None = None,
        leader: LeaderConfig | None = None,
        worker_timeout: float | None = None,
        metrics: tuple[str, int] | None = None,
        host: str | None = None,
        threaded: Collection[str] = (),
    ) -> None:
        if processes < 1:
            raise ConfigurationError("--processes must be at least 1")
        self.app = app
        self.plan = shard(queues, processes)
        self.threaded = frozenset(threaded)
        if worker_timeout is not None and not worker_timeout >= 2.0:
            raise ConfigurationError(
                "--worker-timeout must be at least 2 seconds (children beat every second)"
            )
        self.worker_timeout = worker_timeout or DEFAULT_WORKER_TIMEOUT
        self.worker_config = worker or WorkerConfig()
        self.grace = self.worker_config.grace
        self.metrics = metrics
        self.leader_config = leader or LeaderConfig()
        self.children = [Child(i, WORKER) for i in range(processes)] + [Child(processes, LEADER)]
        self.board: Scoreboard | None = None
        self._metrics: MetricsProcess | None = None
        self.stopping = False
        self.deadline = 0.0
        self.exit_code = EXIT_OK
        self.host = host_id(host)  # the host's name in worker ids and the cluster view
        self.releasers: dict[int, str] = {}  # pid -> the dead worker's name
        self._stop_at = 0.0
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._rates: dict[int, tuple[float, float]] = {}
        self.pid = os.getpid()

    # --- the arbiter loop ----------------------------------------------------------------

    def run(self) -> int:
        try:
            dsn = self.app.dsn  # resolved (an embedded server started) once, before forking
            identity = self._check_database(dsn, self.app.sql)
        except (ConfigurationError, DatabaseUnavailable, SchemaMissing) as exc:
            logger.error("%s", exc)
            return EXIT_BOOT_ERROR
        # Each card can record as many running slow jobs as a worker's concurrency.
        capacity = max((sum(share.values()) for share in self.plan), default=1)
        # The names of each worker's rows of counts per (queue, kind): its queues in the order it serves them.
        labels = Labels(list(self.app.jobs), [sorted(share) for share in self.plan] + [[]])
        self.board = Scoreboard.create(len(self.children), identity, capacity, labels)
        try:
            self._install_signals()
            self._print_plan()
            if self.metrics:
                self._start_metrics()
            for child in self.children:
                if child.role == LEADER or self.plan[child.index]:
                    self._spawn(child)
            while True:
                self._handle_signals()
                self._reap()
                now = time.monotonic()
                if self.stopping:
                    if not any(c.pid for c in self.children):
                        break
                    if now >= self.deadline:
                        self._kill_all(signal.SIGKILL, "grace period over")
                else:
                    self._watchdog(now)
                    self._restart_due(now)
                    if self._metrics is not None:
                        self._metrics.restart_due(now)
                self._titles(now)
                self._sleep(0.25)
            self._wait_releasers()
        finally:
            # The stop may still be arriving (a repeated group delivery); from
            # here on it must not kill the exiting master (Python resets its
            # handlers to the default while it finalizes, but not SIG_IGN).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            if self._metrics is not None:
                self._metrics.stop()
            self.board.close(unlink=True)
        return self.exit_code

    @staticmethod
    def _check_database(dsn: str, sql: ModuleType) -> str:
        """Connect and check the schema once, before forking anything; the database's identity.

        A database that cannot be reached at start is a boot error: each child
        would otherwise fail with DatabaseUnavailable and be restarted forever,
        since one that goes away later is rightly waited for (the children
        restart with backoff until it is back).
        """
        with database.connect(dsn, autocommit=True) as conn:
            schema.check(conn, sql)
            return database_identity(conn, dsn, sql)

    def _install_signals(self) -> None:
        def queue_signal(signum: int, frame: object) -> None:
            self._signals.append(signum)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

        for sig in _STOP_SIGNALS:
            signal.signal(sig, queue_signal)

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGCHLD:
                continue  # the reap that follows handles it
            self.handle_stop(signum)

    def handle_stop(self, signum: int) -> None:
        """First SIGTERM/SIGINT: graceful stop within the grace period. A later one: stop now.

        A repeat within SAME_STOP_WINDOW is the same stop; stopping twice is
        stopping now, never an error; SIGQUIT is always now. The workers take
        SIGTERM/SIGINT as a graceful stop only (the same signal may reach them
        directly, sent to the process group), so "now" is SIGQUIT to them.
        """
        now = time.monotonic()
        if signum != signal.SIGQUIT:
            if not self.stopping:
                self.stopping = True
                self._stop_at = now
                self.deadline = now + self.grace
                logger.info("stopping (grace %gs)", self.grace)
                self._kill_all(signal.SIGTERM, None)
                return
            if now - self._stop_at < SAME_STOP_WINDOW:
                return
        self.stopping = True
        # The workers record the running job as failed and give the rest back.
        self.deadline = min(self.deadline or float("inf"), now + 2.0)
        logger.warning("stopping now")
        self._kill_all(signal.SIGQUIT, None)

    def _sleep(self, timeout: float) -> None:
        with contextlib.suppress(InterruptedError):
            select.select([self._wake_r], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.releasers:
                name = self.releasers.pop(pid)
                if os.waitstatus_to_exitcode(status) != 0:
                    logger.error("releasing %s's jobs failed (see above)", name)
                continue
            child = next((c for c in self.children if c.pid == pid), None)
            if child is None:
                if self._metrics is not None:
                    self._metrics.exited(pid, status, self.stopping)
                continue
            self._exited(child, status)

    def _exited(self, child: Child, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        name = self._name(child)
        assert self.board is not None
        if child.role == WORKER and code not in (EXIT_OK, EXIT_BOOT_ERROR):
            self._blame(child, name)
        child.pid = 0
        if self.stopping:
            if code not in (EXIT_OK, -signal.SIGTERM):
                logger.warning("%s exited with %s while stopping", name, code)
            return
        if code == EXIT_BOOT_ERROR:
            logger.error("%s could not start; stopping (see its error above)", name)
            self.exit_code = EXIT_BOOT_ERROR
            self.handle_stop(signal.SIGTERM)
            return
        delay = child.backoff.delay()
        logger.warning("%s %s; restarting in %gs", name, how_it_ended(code), delay)
        child.restart_at = time.monotonic() + delay

    def _blame(self, child: Child, name: str) -> None:
        """Decide from its card which of a dead worker's jobs count a crash, and release the rest
        (docs/internals.md, crash accounting).

        Only the jobs whose handler was running count a crash (the rescuer
        charges them); the others go back now, uncounted. A worker can also
        die with no handler running, writing outcomes (one PostgreSQL or the
        encoder rejects: a poison outcome). With one failed job's outcome in
        that statement, the job is known: it is left to the rescuer, so it is
        quarantined after `max_crashes` deaths like a job that kills its
        worker. With several, it is not: nobody is charged, and the
        replacement runs one job per batch for a while (Worker's `careful`),
        so the next death implicates the poison job alone. Innocent jobs are
        never charged for another's outcome, nor for a lost connection: a
        worker whose session died (terminated, a failover) clears that record
        before it exits (Worker.run).
        """
        assert self.board is not None
        running, writing = self.board[child.index].crash_report()
        if running is None:
            logger.warning(
                "%s ran more slow jobs than its card records: its jobs are left to the"
                " rescuer (each counts a crash)",
                name,
                extra=job_fields(None, worker=child.worker_id),
            )
            return
        if not running and writing == 1:
            suspect = self.board[child.index].suspect()
            running = [suspect]
            logger.warning(
                "%s died writing the outcome of job %s: it counts a crash",
                name,
                suspect,
                extra=job_fields(suspect, worker=child.worker_id),
            )
        elif not running and writing > 1:
            child.careful = True
            logger.warning(
                "%s died writing the outcomes of %d failed jobs; its replacement"
                " runs one job per batch for a while, to find the one that kills it",
                name,
                writing,
                extra=job_fields(None, worker=child.worker_id),
            )
        self._release(child.worker_id, running, name)

    def _release(self, worker_id: str, running: list[int], name: str) -> None:
        """Fork a releaser: it gives back the running jobs of `worker_id` but `running`.

        (sql.job_release_unstarted.)

        The master runs no SQL and starts no thread: the releaser, forked
        from its one thread, connects, runs the statement and exits. If the
        database is down, the rescuer returns those jobs later, with a crash
        each. The master waits for its releasers before it exits.
        """
        dsn = self.app.dsn
        assert dsn
        self.releasers[fork(_STOP_SIGNALS, lambda: self._releaser_main(dsn, worker_id, running, name))] = name

    def _releaser_main(self, dsn: str, worker_id: str, running: list[int], name: str) -> int:
        try:
            # A stop signal sent to the whole group must not cut the release short.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_IGN)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            os.close(self._wake_r)
            os.close(self._wake_w)
            with (
                database.connect(dsn, autocommit=True, connect_timeout=RELEASE_TIMEOUT) as conn,
                psycopg.RawCursor(conn) as cur,
            ):
                sql = self.app.sql  # the catalogue of the app's schema
                cur.execute(sql.releaser_session, (f"{RELEASE_TIMEOUT}s",))
                released = sum(row[1] for row in cur.execute(sql.job_release_unstarted, (worker_id, running)))
                # A job it ran on the fast lane rolled back uncounted: its crash is counted here.
                max_crashes = self.leader_config.rescuer.max_crashes
                for job_id, state in cur.execute(sql.job_crash_fast, (worker_id, running, max_crashes)):
                    logger.warning(
                        "%s died running job %s on the fast lane: it counts a crash (now %s)",
                        name,
                        job_id,
                        state,
                        extra=job_fields(job_id, worker=worker_id),
                    )
            if released:
                logger.info(
                    "%s had claimed %d jobs it never started: released",
                    name,
                    released,
                    extra=job_fields(None, worker=worker_id),
                )
            return EXIT_OK
        except (FastjobsError, psycopg.Error) as exc:
            logger.warning(
                "%s's unstarted jobs are left to the rescuer: %s",
                name,
                exc,
                extra=job_fields(None, worker=worker_id),
            )
            return EXIT_CRASH

    def _wait_releasers(self) -> None:
        """Wait for the releasers still running (at most RELEASE_WAIT seconds), so nothing is left held."""
        deadline = time.monotonic() + RELEASE_WAIT
        while self.releasers and time.monotonic() < deadline:
            self._reap()
            if self.releasers:
                self._sleep(0.05)
        for pid, name in self.releasers.items():
            logger.warning(
                "releasing %s's jobs took over %gs; they are left to the rescuer", name, RELEASE_WAIT
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _restart_due(self, now: float) -> None:
        for child in self.children:
            if child.pid == 0 and child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                self._spawn(child)

    def _watchdog(self, now: float) -> None:
        """Kill a child whose process stopped beating: hung holding the GIL, stopped, deadlocked.

        A worker's heartbeat thread beats its card every second whatever its
        handlers do, so a job of any length runs undisturbed while its
        process is alive (a handler that runs too long is its `timeout=`'s
        business); only a process whose threads cannot run at all falls
        silent. The leader beats from its loop. The killed worker's jobs stay
        'running' for the rescuer; the reap restarts it.
        """
        assert self.board is not None
        for child in self.children:
            if not child.pid or child.killed:
                continue
            card = self.board[child.index]
            progress = card["progress"] + card["heartbeat"]
            if progress != child.seen_progress:
                child.seen_progress = progress
                child.last_progress = now
            elif now - child.last_progress > self.worker_timeout:
                logger.error(
                    "%s sent no heartbeat for %gs (hung or stopped); killing it",
                    self._name(child),
                    self.worker_timeout,
                )
                child.killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)

    def _kill_all(self, sig: int, reason: str | None) -> None:
        if reason:
            logger.warning("%s: sending %s", reason, signal.Signals(sig).name)
        for child in self.children:
            if child.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)

    # --- children -------------------------------------------------------------------------

    def _spawn(self, child: Child) -> None:
        assert self.board is not None
        # The worker's identity: a token chosen here, before the fork, so the
        # master knows the exact id whose jobs to release if it dies.
        token = secrets.token_hex(8)
        child.pid = fork(_STOP_SIGNALS, lambda: self._forked(child, token))
        child.worker_id = make_worker_id(token, child.pid, self.host)
        child.backoff.start()
        child.last_progress = time.monotonic()
        child.seen_progress = -1.0
        child.killed = False
        child.careful = False

    def _forked(self, child: Child, token: str) -> int:
        """The child's side of _spawn."""
        assert self.board is not None
        try:
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            die_with(self.pid, signal.SIGTERM)  # not unsupervised: the pending SIGTERM waits for the unblock
            os.close(self._wake_r)
            os.close(self._wake_w)
            card = self.board[child.index]
            card.claim(child.role, child.index)
            return self._child_main(child, card, make_worker_id(token, os.getpid(), self.host))
        except (ConfigurationError, SchemaMissing) as exc:
            logger.error("%s: %s", self._name(child), exc)
            return EXIT_BOOT_ERROR
        except BaseException:
            logger.exception("%s (pid %d) crashed", self._name(child), os.getpid())
            return EXIT_CRASH

    def _child_main(self, child: Child, card: Card, worker_id: str) -> int:
        from setproctitle import setproctitle

        if child.role == LEADER:
            setproctitle("fastjobs: leader")
            leader = Leader(self.app, self.leader_config, card=card)
            leader.install_signals()
            signal.signal(signal.SIGQUIT, lambda signum, frame: leader.stop())  # the master's "stop now"
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            leader.run()
            return EXIT_OK
        share = self.plan[child.index]
        queues = sorted(share)
        title = f"fastjobs: worker {child.index + 1} [{','.join(queues)}]"
        setproctitle(title)
        worker = Worker(
            self.app,
            queues,
            # The leader promotes due jobs; the share of the plan bounds the async jobs in flight,
            # and the sync jobs of threaded queues.
            config=replace(
                self.worker_config,
                concurrency=max(1, sum(share.values())),
                threads={q: n for q, n in share.items() if q in self.threaded and n > 1},
                schedule=False,
            ),
            worker_id=worker_id,
            supervision=Supervision(
                parent=self.pid, card=card, title=title, careful=child.careful, host=self.host
            ),
        )
        worker.install_signals()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        try:
            worker.run()
        except KeyboardInterrupt:
            if not worker.stopping_now:
                raise  # a handler's own: a crash, traceback and all
            # Asked for (a second Ctrl-C): no traceback. Still EXIT_CRASH, so the master's
            # _blame gives back what it holds, as after any death mid-batch.
            logger.warning("%s (pid %d) stopped now", self._name(child), os.getpid())
            return EXIT_CRASH
        return EXIT_OK

    def _name(self, child: Child) -> str:
        if child.role == LEADER:
            return f"leader (pid {child.pid})" if child.pid else "leader"
        return f"worker {child.index + 1}" + (f" (pid {child.pid})" if child.pid else "")

    # --- reporting ------------------------------------------------------------------------

    def _print_plan(self) -> None:
        logger.info(
            "master pid %d, %s + leader, %s, %s implementation",
            os.getpid(),
            plural(len(self.plan), "worker"),
            plural(len(self.app.jobs), "job kind"),
            IMPLEMENTATION,
        )
        for index, share in enumerate(self.plan):
            shown = ", ".join(f"{q}:{n}" for q, n in sorted(share.items())) or "(no queue: not started)"
            logger.info("  worker %d: %s", index + 1, shown)
        if self.threaded:
            logger.info(
                "  sync jobs of %s: as many at once per worker as its share, on threads",
                ", ".join(sorted(self.threaded)),
            )
        served = {queue for share in self.plan for queue in share}
        for kind, spec in sorted(self.app.declared.items()):
            if spec.queue in served:
                # A worker claims every job of its queues: this kind's would fail here, no handler.
                logger.warning(
                    "job kind %r is declared as handled elsewhere, but its queue %r is served here:"
                    " these workers would claim its jobs and fail them (no handler); give it a queue"
                    " of its own",
                    kind,
                    spec.queue,
                )

    def _titles(self, now: float) -> None:
        """Write each worker's rate to its card once a second, and the master's title."""
        assert self.board is not None
        last = self._rates.get(-1)
        if last is not None and now - last[0] < 1.0:
            return
        total = 0.0
        for child in self.children:
            card = self.board[child.index]
            done = card["completed"] + card["failed"]
            before = self._rates.get(child.index)
            rate = (done - before[1]) / (now - before[0]) if before and now > before[0] else 0.0
            self._rates[child.index] = (now, done)
            card["rate"] = max(rate, 0.0)
            total += max(rate, 0.0)
        self._rates[-1] = (now, 0.0)
        from setproctitle import setproctitle

        state = "stopping" if self.stopping else f"{total:,.0f} jobs/s"
        setproctitle(f"fastjobs: master [{plural(len(self.plan), 'worker')}] {state}")

    def _start_metrics(self) -> None:
        """Fork the metrics process before any worker; FastjobsError if it cannot listen."""
        assert self.metrics is not None and self.board is not None
        host, port = self.metrics
        self._metrics = MetricsProcess(
            host, port, self.board, self.app.dsn, self.app.sql, close_in_child=(self._wake_r, self._wake_w)
        )
        self._metrics.start()
        logger.info("metrics on %s", self._metrics.url)
