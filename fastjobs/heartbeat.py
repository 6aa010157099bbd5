"""A worker's heartbeat thread: its row in fastjobs_workers, cancel requests, its master's death."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import orjson
import psycopg

from . import database, sql
from . import maintenance as leader
from .errors import ConfigurationError, DatabaseUnavailable
from .executor import Executor
from .stats import Card, worker_counters

logger = logging.getLogger("fastjobs.worker")  # the name users filter on: these run in the worker

__all__ = ["Heartbeat", "host_id", "make_worker_id"]

HEARTBEAT_INTERVAL = leader.HEARTBEAT_INTERVAL
# A worker under a master looks this often whether its master is still there.
PARENT_CHECK_INTERVAL = 0.5


def host_id(override: str | None = None) -> str:
    """The name this host's workers go by in the cluster view: `override` (`fastjobs run --host-id`),
    else FASTJOBS_HOST_ID, else the host name. ConfigurationError for one a worker id cannot carry."""
    host = override or os.environ.get("FASTJOBS_HOST_ID") or socket.gethostname()
    if not host.isprintable() or ":" in host or " " in host or len(host) > 255:
        raise ConfigurationError(
            f"the host id must be at most 255 printable characters without spaces or ':', not {host!r}"
        )
    return host


def make_worker_id(token: str, pid: int | None = None, host: str | None = None) -> str:
    """A worker's identity, `host:pid:token`: the one place it is built.

    The token (chosen by the master per worker before it forks, or at random
    here) makes it one no other process can share, even in containers that
    share a hostname and pids; host and pid are there for people.
    """
    return f"{host or host_id()}:{pid or os.getpid()}:{token}"


class Heartbeat(threading.Thread):
    """The worker's second connection, on a thread: heartbeats and cancellations.

    It keeps the worker's row fresh while the main thread runs a long batch
    (so the rescuer never takes the jobs of a live worker) and hears
    `app.cancel` of running jobs (NOTIFY, and a poll each heartbeat in case
    a notification was missed) and passes them to the executor.
    """

    def __init__(
        self,
        dsn: str,
        worker_id: str,
        executor: Executor,
        register: tuple[str, str, int, list[str]] | None = None,
        watch: Callable[[], None] | None = None,
        card: Card | None = None,
        names: list[tuple[int, str, str]] | None = None,
        rotator: leader.Rotator | None = None,
        handles: list[str] | None = None,
        limited: Callable[[Iterable[tuple[str, bool, bool, bool]]], None] | None = None,
        sql: ModuleType = sql,
        events: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(name="fastjobs-control", daemon=True)
        self.sql = sql  # the statements of the app's schema
        # The engine's events the heartbeat carries (Worker.events): slow jobs, demotions, careful mode.
        self.events = events
        # Told at each heartbeat which queues have a concurrency limit, keyed jobs or a fair mark
        # (sql.queue_limited).
        self.limited = limited
        # The kinds this worker has handlers for: the heartbeat carries them, so that `fastjobs
        # stats` can flag pending kinds that no live worker handles.
        self.handles = handles
        # A worker without a leader rotates the slots here, off the hot loop, whenever it finds
        # the leader's lock free (see Worker).
        self.rotator = rotator
        self.card = card  # beaten each turn: the master's watchdog reads it as "this process is alive"
        # The card's rows of counts per (queue, kind), named: the heartbeat carries them.
        self.names = names or []
        self._last_count: tuple[float, float] | None = None
        self.dsn = dsn
        self.worker_id = worker_id
        self.executor = executor
        # sql.worker_heartbeat's parameters: each heartbeat re-registers a pruned row.
        self.register = register or (worker_id, host_id(), os.getpid(), [])
        self.watch = watch  # called every PARENT_CHECK_INTERVAL (the worker's master-death check)
        self._stop_event = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._heard: set[int] = set()  # job ids whose cancellation was announced

    def stop(self) -> None:
        self._stop_event.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def run(self) -> None:
        # Stop signals are the main thread's: taken here, they would run its
        # handler even while it holds them (_signals_held) for its final writes.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
        conn: psycopg.Connection[Any] | None = None
        next_beat = 0.0
        # The first try one interval in: a worker that drains and stops at once has nothing to rotate.
        next_rotation = time.monotonic() + (self.rotator.config.interval if self.rotator else float("inf"))
        while not self._stop_event.is_set():
            if self.card is not None and not self.executor.hung:
                self.card.beat()
            try:
                if conn is None:
                    conn = database.connect(self.dsn, autocommit=True)
                    # Notifications psycopg reads while it executes the
                    # heartbeat are handed here rather than lost.
                    conn.add_notify_handler(lambda n: self._ids([n.payload]))
                    conn.execute(self.sql.listen_cancel)
                    next_beat = 0.0
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_INTERVAL
                    self._beat(conn)
                if now >= next_rotation:
                    next_rotation = time.monotonic() + self._rotate(conn)
                # At most a second between the card's beats, whatever the heartbeat's
                # interval, and PARENT_CHECK_INTERVAL between checks of the master.
                wait = min(next_beat, next_rotation) - time.monotonic()
                wait = max(0.0, min(wait, 1.0 if self.watch is None else PARENT_CHECK_INTERVAL))
                readable, _, _ = select.select([conn.pgconn.socket, self._wake_r], [], [], wait)
                if conn.pgconn.socket in readable:
                    self._notified(conn)
                if self.watch is not None:
                    self.watch()
            except (psycopg.Error, DatabaseUnavailable, OSError) as exc:
                if self._stop_event.is_set():
                    break
                logger.warning("worker control connection failed, retrying: %s", exc)
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                conn = None
                if self.watch is None:
                    self._stop_event.wait(HEARTBEAT_INTERVAL)
                    continue
                retry_at = time.monotonic() + HEARTBEAT_INTERVAL
                while time.monotonic() < retry_at and not self._stop_event.wait(PARENT_CHECK_INTERVAL):
                    self.watch()
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _counters(self) -> str | None:
        """The heartbeat's counters (stats.worker_counters); its rate is over the time since the last."""
        doc: dict[str, Any] = {}
        if self.card is not None:
            now, done = time.monotonic(), self.card["completed"] + self.card["failed"]
            last, self._last_count = self._last_count, (now, done)
            rate = (done - last[1]) / (now - last[0]) if last is not None and now > last[0] else 0.0
            doc = worker_counters(self.card, self.names, max(rate, 0.0))
        if self.handles is not None:
            doc["handles"] = self.handles
        if self.events is not None:
            doc.update(self.events())
        return orjson.dumps(doc).decode() if doc else None

    def _beat(self, conn: psycopg.Connection[Any]) -> None:
        with psycopg.RawCursor(conn) as cur:
            cur.execute(self.sql.worker_heartbeat, (*self.register, self._counters()))
            requested = {row[0] for row in cur.execute(self.sql.job_cancel_requested, (self.worker_id,))}
            if self.limited is not None:
                self.limited(cur.execute(self.sql.queue_limited).fetchall())
        # The poll covers whatever was announced; ids no longer running here
        # are dropped (in place: the hot loop holds this set).
        self._heard.clear()
        self.executor.cancelled &= requested
        for job_id in requested:
            self.executor.cancel(job_id)

    def _rotate(self, conn: psycopg.Connection[Any]) -> float:
        """One rotation try if the leader's lock is free, held only for the try (a `fastjobs run`
        leader started later takes it at its next attempt); the seconds until the next try."""
        rotator = self.rotator
        assert rotator is not None
        with psycopg.RawCursor(conn) as cur:
            row = cur.execute(sql.leader_try_lock, (self.sql.LEADER_LOCK_KEY,)).fetchone()
            if not (row and row[0]):
                return rotator.config.interval  # a leader, or another worker, rotates
            try:
                _, wait = rotator.turn(conn)
            except psycopg.Error as exc:
                if conn.broken:
                    raise
                # Counted and logged; heartbeats and cancellations go on.
                logger.error("worker rotator failed, the worker goes on: %s: %s", type(exc).__name__, exc)
                wait = rotator.config.interval
            finally:
                if not conn.broken:
                    cur.execute(sql.leader_unlock, (self.sql.LEADER_LOCK_KEY,))
        # Jitter: the in-process workers of one database try in turn, not in step.
        return wait * random.uniform(0.9, 1.1)

    def _notified(self, conn: psycopg.Connection[Any]) -> None:
        pgconn = conn.pgconn
        pgconn.consume_input()
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError("control connection lost")
        payloads = []
        while (n := pgconn.notifies()) is not None:
            payloads.append(n.extra.decode())
        self._ids(payloads)
        if self._heard:
            # The notification goes to every worker; act only on our own running jobs.
            heard, self._heard = self._heard, set()
            with psycopg.RawCursor(conn) as cur:
                mine = {row[0] for row in cur.execute(self.sql.job_cancel_requested, (self.worker_id,))}
            for job_id in heard & mine:
                self.executor.cancel(job_id)

    def _ids(self, payloads: list[str]) -> None:
        for payload in payloads:
            with contextlib.suppress(ValueError):
                self._heard.add(int(payload))
