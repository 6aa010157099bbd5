"""A worker process: its connections, LISTEN wake-ups, heartbeat, and the hot loop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from setproctitle import setproctitle

from . import database, schema
from . import maintenance as leader
from .abc import BatchLoop
from .app import App
from .errors import ConfigurationError, LoopError
from .executor import Executor
from .heartbeat import Heartbeat, host_id, make_worker_id
from .impl import core
from .listener import Listener, check_sleep_deadline
from .scoreboard import Labels
from .stats import Card
from .types import DEFAULT_QUEUE

__all__ = [
    "Worker",
    "WorkerConfig",
]

logger = logging.getLogger(__name__)

LISTENER_CHECK_INTERVAL = 30.0
# An orphaned worker stops now when its grace is over, and exits this much later whatever it is doing.
ORPHAN_EXIT_AFTER = 2.0
# How long inserts keep notifying past the end of a worker's sleep
# (sql.worker_sleep): one deadline covers the many short sleeps of a worker
# between jobs (a statement per WAKE_MARGIN, not one per sleep); and once the
# workers are busy, commits notify for at most poll_interval + WAKE_MARGIN.
WAKE_MARGIN = 0.25
# A worker whose predecessor died writing several failed jobs' outcomes runs
# one job per batch this long, so the outcome that kills it is found alone.
CAREFUL_FOR = 60.0


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGTERM, SIGINT and SIGQUIT (delivered after the block) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker's settings, checked once here: `fastjobs run` builds one from its options.

    Each field's default is the setting's only default: the CLI's options,
    the master and the benchmark refer to it. Under a master, `concurrency`
    becomes the worker's share of the `--queues` plan, `threads` its share of
    each queue given a concurrency (`name:N`), and `schedule` is off (the
    leader promotes due jobs).
    """

    batch_max: int = 1000  # the largest batch one claim takes (a worker starts at one and doubles)
    poll_interval: float = 1.0  # seconds between claims when no notification wakes the worker
    concurrency: int = 100  # async jobs in flight at once
    # Per queue: how many of its sync jobs run at once, on a pool of threads
    # (pool.Pool); a queue not named runs them one at a time on the loop's thread.
    threads: Mapping[str, int] = field(default_factory=dict)
    keep_completed: bool = False  # keep completed jobs' rows instead of deleting them
    overlap: bool = True  # send the next claim while the batch's handlers run
    # Short sync jobs take the fast lane: their rows stay locked in a
    # transaction while their batch runs, one write per job (sql.job_lock_many).
    fast_lane: bool = True
    schedule: bool = True  # promote due scheduled and retryable jobs when idle
    # Without a master (the in-process Worker): rotate the slots whenever the leader's lock is free,
    # from the control thread (leader.Rotator). Under a master, its leader does.
    rotate: bool = True
    rotation: leader.RotationConfig = field(default_factory=leader.RotationConfig)
    # Seconds a stop waits for in-flight jobs: the master's deadline, and how
    # long a worker whose master died finishes before it stops now.
    grace: float = 30.0

    def __post_init__(self) -> None:
        for name in ("batch_max", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"the worker's {name} must be an integer of at least 1, not {value!r}"
                )
        if not isinstance(self.threads, Mapping) or not all(
            isinstance(queue, str) and type(n) is int and n >= 1 for queue, n in self.threads.items()
        ):
            raise ConfigurationError(
                f"the worker's threads must map queue names to integers of at least 1, not {self.threads!r}"
            )
        object.__setattr__(self, "threads", dict(self.threads))  # a copy the caller cannot change
        if not 0 < self.poll_interval < float("inf"):
            raise ConfigurationError(
                "the worker's poll_interval must be a finite number of seconds above 0,"
                f" not {self.poll_interval!r}"
            )
        if not self.grace >= 0:
            raise ConfigurationError(f"the grace period must be at least 0 seconds, not {self.grace!r}")


@dataclass(frozen=True, slots=True)
class Supervision:
    """What a worker under a master gets from it besides its settings (see Master._child_main)."""

    parent: int  # the master's pid: the worker stops when it is gone
    card: Card  # its shared-memory card: beats, counters, the running jobs
    title: str  # process title prefix; the live rate is appended each second
    careful: bool = False  # one job per batch for CAREFUL_FOR seconds (see Master._blame)
    host: str = ""  # host_id() as the master resolved it


class Worker:
    """One worker: claims from `queues` until stopped.

    Stopping (SIGTERM, SIGINT, or `stop()`) makes no new claims: the running
    batch finishes its started job, the jobs claimed but not started go back
    uncounted, and every outcome is written before `run` returns.

    `config` holds its settings. Under a master (`supervision`: the master's
    pid, the worker's card, title and careful start), SIGTERM and SIGINT only ever mean a graceful
    stop, however often they come: Ctrl-C, systemd and `kill -PGID` signal the
    whole process group, and the master relays the same stop. Only the master
    decides to stop now, with SIGQUIT. A worker whose master died
    (PR_SET_PDEATHSIG, and getppid() polled as a fallback) stops the same way,
    stops now when its grace is over, and exits regardless soon after.
    `worker_id` is chosen by the master for its workers, at random otherwise.
    `exit_when_empty` and `on_ready` are for tests and benchmarks: return
    once nothing is due, and a call once the worker is ready to claim.
    """

    def __init__(
        self,
        app: App,
        queues: list[str] | None = None,
        *,
        config: WorkerConfig = WorkerConfig(),
        worker_id: str | None = None,
        supervision: Supervision | None = None,
        exit_when_empty: bool = False,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.queues = queues or sorted({spec.queue for spec in app.jobs.values()}) or [DEFAULT_QUEUE]
        self.config = config
        self.worker_id = worker_id or make_worker_id(uuid.uuid4().hex[:12])
        self.executor = Executor(config.concurrency, config.threads)
        self.exit_when_empty = exit_when_empty
        self.on_ready = on_ready
        self.card = supervision.card if supervision is not None else None
        self.parent = supervision.parent if supervision is not None else None
        self.title = supervision.title if supervision is not None else None
        self.careful = supervision is not None and supervision.careful
        self.host = (supervision.host if supervision is not None else "") or host_id()
        self.loop: BatchLoop | None = None
        self._stop = False
        self._stopping_now = False
        self._orphaned_at: float | None = None
        self._orphan_lock = threading.Lock()
        self._wake_r = self._wake_w = -1  # the pipe that wakes a sleeping run(); open only during run()
        self._careful_at = 0.0  # time.time() its careful mode began (0: never)

    def stop(self) -> None:
        """Stop claiming; safe from a signal handler and idempotent."""
        self._stop = True
        self.executor.stopping = True
        if self.loop is not None:
            self.loop.stopping = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    @property
    def stopping_now(self) -> bool:
        """Whether a stop-now signal interrupted it (KeyboardInterrupt raised in its handler)."""
        return self._stopping_now

    def install_signals(self) -> None:
        """Standalone, first SIGTERM/SIGINT: graceful stop; second: stop now (KeyboardInterrupt).

        Under a master: SIGTERM/SIGINT stop gracefully, SIGQUIT stops now.
        Stopping now raises once; a repeat must not cut the final writes short.
        """

        def now() -> None:
            self.stop()
            if not self._stopping_now:
                self._stopping_now = True
                raise KeyboardInterrupt("stopped now (a second stop signal)")  # the job's error says so

        def handle(signum: int, frame: object) -> None:
            if self._stop and self.parent is None:
                now()
            self.stop()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        if self.parent is not None:
            signal.signal(signal.SIGQUIT, lambda signum, frame: now())

    def _check_parent(self, escalate: bool = False) -> None:
        """Stop when the master is gone; with `escalate` (the control thread), stop now after the grace.

        A worker left running without its master would hold its jobs while
        heartbeating, where no rescuer takes them.
        """
        if self.parent is None or os.getppid() == self.parent:
            return
        grace = self.config.grace
        with self._orphan_lock:
            now = time.monotonic()
            if self._orphaned_at is None:
                self._orphaned_at = now
                logger.warning(
                    "worker (pid %d): its master is gone; stopping (grace %gs)", os.getpid(), grace
                )
                self.stop()
                return
            if not escalate or now < self._orphaned_at + grace:
                return
            if now >= self._orphaned_at + grace + ORPHAN_EXIT_AFTER:
                logger.error(
                    "worker (pid %d): still running %gs after stopping now; exiting (its jobs are left to the"
                    " rescuer)",
                    os.getpid(),
                    ORPHAN_EXIT_AFTER,
                )
                os._exit(1)
            if not self._stopping_now:
                logger.warning(
                    "worker (pid %d): grace period over without its master; stopping now", os.getpid()
                )
                os.kill(os.getpid(), signal.SIGQUIT)

    def events(self) -> dict[str, Any]:
        """The engine's events of this worker so far, for its heartbeat (report.cluster reads them):
        per queue its slow jobs and demotions to the state lane (Planner.events), and its careful mode
        (the seconds since it began and those left), each only once it happened. From another thread."""
        found: dict[str, Any] = {}
        loop = self.loop
        slow = loop.planner.events(self.queues) if loop is not None else []
        if slow:
            found["slow"] = slow
        if self._careful_at:
            ago = time.time() - self._careful_at
            found["careful"] = {"ago": round(ago, 3), "left": round(max(CAREFUL_FOR - ago, 0.0), 3)}
        return found

    def run(self) -> None:
        dsn = self.app.dsn
        sql = self.app.sql  # the statements of the app's schema
        conn = database.connect(dsn, autocommit=True)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        listener = Listener(dsn, self.queues, self._wake_r, self.card, sql)
        try:
            schema.check(conn, sql)
            with psycopg.RawCursor(conn) as cur:
                cur.execute(sql.worker_session)
            check_sleep_deadline(conn, sql)
            listener.connect()
            register = (self.worker_id, self.host, os.getpid(), self.queues)
            with psycopg.RawCursor(conn) as cur:
                cur.execute(sql.worker_register, register)
            specs = self.app.runnable()
            self.loop = core.BatchLoop(
                conn,
                specs,
                self.executor,
                self.worker_id,
                self.queues,
                keep_completed=self.config.keep_completed,
                # A wave of threads from the first claim on: one long I/O job
                # alone in a batch would keep the other threads idle while it runs.
                batch_min=min(self.config.batch_max, max(self.config.threads.values(), default=1)),
                batch_max=self.config.batch_max,
                overlap=self.config.overlap,
                progress=self.card.progress_view() if self.card is not None else None,
                running=self.card.running_view() if self.card is not None else None,
                counts=self.card.counts_view() if self.card is not None else None,
                whole_context=self.app.has_middleware,
                fast_lane=self.config.fast_lane,
                sql=sql,
            )
            if self.card is not None:
                self.executor.running = self.card.slow_jobs()
            self.loop.stopping = self._stop
            self.loop.prepare(plan_ahead=True)  # the first jobs wait for no planning
            self.executor.worker = self.worker_id  # for the records of its jobs' failures
            self.executor.bind()
            watch = (lambda: self._check_parent(escalate=True)) if self.parent is not None else None
            names = list(Labels(list(specs), [self.queues]).names(0))
            # Without a master there is no leader: this worker rotates when no other process does.
            rotator = (
                leader.Rotator(self.config.rotation, who="worker", sql=sql)
                if self.parent is None and self.config.rotate and self.config.rotation.enabled
                else None
            )
            # Before the first claim, so it takes the statements its queues call for.
            with psycopg.RawCursor(conn) as cur:
                self._tell(cur.execute(sql.queue_limited).fetchall())

            control = Heartbeat(
                dsn,
                self.worker_id,
                self.executor,
                register,
                watch,
                self.card,
                names,
                rotator,
                sorted(specs),
                self._tell,
                sql,
                self.events,
            )
            control.start()
            try:
                if self.on_ready is not None:
                    self.on_ready()
                self._loop(conn, listener)
            except (LoopError, psycopg.Error):
                if self.card is not None and conn.pgconn.status == psycopg.pq.ConnStatus.BAD:
                    # The session was lost (terminated, a failover) with outcomes in
                    # flight: a statement PostgreSQL rejects implicates its one failed
                    # job (Master._blame), a lost connection no job.
                    self.card.clear_writing()
                raise
            finally:
                control.stop()
            with _signals_held(), psycopg.RawCursor(conn) as cur:
                cur.execute(sql.worker_delete, (self.worker_id,))
        finally:
            listener.close()
            conn.close()
            self.executor.close()
            wake_r, wake_w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1
            os.close(wake_r)
            os.close(wake_w)

    def _tell(self, rows: Iterable[tuple[str, bool, bool, bool]]) -> None:
        """Tell the loop's planner its queues limited, keyed and fair (sql.queue_limited's rows). A
        queue that one of this app's kinds limits per key is keyed, marked or not: its first keyed
        jobs may come before the mark is read."""
        assert self.loop is not None
        planner = self.loop.planner
        told = {name: (limit, keyed, fair) for name, limit, keyed, fair in rows}
        own = {spec.queue for spec in self.app.jobs.values() if spec.limit is not None}
        marks = [(*told.get(queue, (False, False, False)), queue in own) for queue in self.queues]
        planner.limited = frozenset(i for i, (limit, _, _, _) in enumerate(marks) if limit)
        planner.keyed = frozenset(i for i, (_, keyed, _, limits) in enumerate(marks) if keyed or limits)
        planner.fair = frozenset(i for i, (_, _, fair, _) in enumerate(marks) if fair)

    def _loop(self, conn: psycopg.Connection[Any], listener: Listener) -> None:
        sql = self.app.sql
        loop = self.loop
        assert loop is not None
        card = self.card
        config = self.config
        next_schedule = 0.0 if config.schedule else float("inf")
        next_title = time.monotonic() + 1.0
        careful_until = 0.0
        # Until when (time.monotonic()) inserts notify, as this worker last moved it.
        notify_until = 0.0
        written = True  # every outcome handed to the loop was written (or is, by finish)
        if self.careful:
            # One job per batch and no claim ahead: each statement then
            # carries at most one failed job's outcome (see Master._blame).
            careful_until = time.monotonic() + CAREFUL_FOR
            self._careful_at = time.time()
            batch_min = loop.batch_min
            loop.batch_max, loop.overlap = 1, False
            loop.batch_min = 1
        try:
            while not self._stop:
                began = time.monotonic()
                ran = loop.step()
                now = time.monotonic()
                if card is not None:
                    card.record(loop, now - began if ran else 0.0)
                if now >= next_title:
                    next_title = now + 1.0
                    self._check_parent()  # the fallback to the control thread's check
                    listener.poll()
                    if self.title is not None and card is not None:
                        # The rate the master writes into the card each second.
                        setproctitle(f"{self.title} {card['rate']:,.0f} jobs/s")
                    if careful_until and now >= careful_until:
                        careful_until = 0.0
                        loop.batch_max, loop.overlap = config.batch_max, config.overlap
                        loop.batch_min = batch_min
                if ran:
                    continue
                if now >= next_schedule:
                    next_schedule = now + config.poll_interval
                    if leader.schedule_once(conn, sql=sql):
                        continue
                if self.exit_when_empty and loop.recheck == float("inf"):
                    # A queue marked keyed since the last heartbeat holds jobs its claims passed over.
                    keyed = loop.planner.keyed
                    with psycopg.RawCursor(conn) as cur:
                        self._tell(cur.execute(sql.queue_limited).fetchall())
                    if loop.planner.keyed == keyed:
                        break
                    continue
                # A claim that started after the last one's end found nothing:
                # look from the front of the queue when the loop next may.
                sleep = min(config.poll_interval, loop.recheck)
                if now + sleep > notify_until:
                    lapsed = now >= notify_until
                    with psycopg.RawCursor(conn) as cur:
                        cur.execute(sql.worker_sleep, (sleep + WAKE_MARGIN,))
                    notify_until = now + sleep + WAKE_MARGIN
                    if lapsed:
                        # A job inserted while inserts did not notify: claim
                        # once more before sleeping. One whose INSERT ran
                        # before the deadline moved and whose transaction
                        # commits after this claim is found by the poll, at
                        # most poll_interval late.
                        continue
                if now - listener.last_check >= LISTENER_CHECK_INTERVAL:
                    listener.check()
                listener.wait(sleep)
                if card is not None:
                    card.beat()
        except (LoopError, psycopg.Error):
            # A statement failed: its outcomes are not written, and the card
            # keeps naming the one failed job they held (Master._blame).
            written = False
            raise
        finally:
            loop.stopping = True
            # A second stop signal must not cut the final writes short.
            with _signals_held():
                loop.finish()
            if card is not None:
                if written:
                    # Every outcome is written, those of the jobs whose handlers stopped
                    # the worker too: the master charges a crash to no job (it would to
                    # every job the card names, sql.job_crash_fast).
                    card.clear_jobs()
                card.record(loop, 0.0)
