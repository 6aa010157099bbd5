"""The leader: one process per cluster, elected by an advisory lock, that runs maintenance.

Every service has one shape: a config with defaults and a `*_once(conn, now)`
that works in LIMIT-sized batches until a batch comes back short. For now the
service is the scheduler; a standalone Worker (no master, so no leader) runs
it itself when idle, which is safe concurrently (SKIP LOCKED).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import select
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from . import database, schema, sql
from .errors import DatabaseUnavailable
from .stats import Slot

if TYPE_CHECKING:
    from .app import App


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    batch: int = 10_000
    interval: float = 1.0


def schedule_once(
    conn: psycopg.Connection[Any], now: dt.datetime | None = None, config: SchedulerConfig = SchedulerConfig()
) -> dict[str, int]:
    """Make due scheduled and retryable jobs available; returns the count per queue."""
    counts: dict[str, int] = {}
    with psycopg.RawCursor(conn) as cur:
        while True:
            rows = cur.execute(sql.job_schedule_many, (config.batch, now)).fetchall()
            moved = 0
            for queue, count, _ in rows:
                counts[queue] = counts.get(queue, 0) + count
                moved += count
            if moved < config.batch:
                return counts


class Leader:
    """The one maintenance process of a cluster, elected by a session-level advisory lock.

    Every host's master runs one; the one whose connection holds the lock
    acts, the others retry. When the leader's session dies PostgreSQL
    releases the lock and another leader takes over at its next try.
    """

    def __init__(
        self,
        app: App,
        *,
        lock_key: int = sql.LEADER_LOCK_KEY,
        scheduler: SchedulerConfig = SchedulerConfig(),
        retry_interval: float = 2.0,
        slot: Slot | None = None,
    ) -> None:
        self.app = app
        self.lock_key = lock_key
        self.scheduler = scheduler
        self.retry_interval = retry_interval
        self.slot = slot
        self.leading = False
        self._stop = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def stop(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: self.stop())
        signal.signal(signal.SIGINT, lambda signum, frame: self.stop())

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop:
                if conn is None or conn.closed or conn.broken:
                    self.leading = False
                    conn = self._connect()
                if conn is not None:
                    try:
                        self._turn(conn)
                    except psycopg.OperationalError as exc:
                        print(f"fastjobs: leader lost its connection: {exc}", file=sys.stderr)
                        self.leading = False
                        conn.close()
                        conn = None
                if self.slot is not None:
                    self.slot.beat()
                interval = self.scheduler.interval if self.leading else self.retry_interval
                select.select([self._wake_r], [], [], interval)
        finally:
            if conn is not None and not conn.closed:
                if self.leading and not conn.broken:
                    with contextlib.suppress(psycopg.Error), psycopg.RawCursor(conn) as cur:
                        cur.execute(sql.leader_unlock, (self.lock_key,))
                conn.close()

    def _connect(self) -> psycopg.Connection[Any] | None:
        try:
            conn = database.connect(self.app.dsn, autocommit=True)
            schema.check(conn)
            return conn
        except DatabaseUnavailable as exc:
            print(f"fastjobs: leader cannot connect, retrying: {exc}", file=sys.stderr)
            return None

    def _turn(self, conn: psycopg.Connection[Any]) -> None:
        if not self.leading:
            with psycopg.RawCursor(conn) as cur:
                row = cur.execute(sql.leader_try_lock, (self.lock_key,)).fetchone()
            self.leading = bool(row and row[0])
            if self.leading:
                print(f"fastjobs: leader elected (pid {os.getpid()})", file=sys.stderr, flush=True)
        if self.leading:
            schedule_once(conn, config=self.scheduler)
