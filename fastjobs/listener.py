"""A worker's LISTEN connection: wake-ups, its health, and the sleep deadline producers read."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
import uuid
from types import ModuleType
from typing import Any

import psycopg

from . import database, sql
from .errors import ConfigurationError, DatabaseUnavailable
from .stats import Card

logger = logging.getLogger("fastjobs.worker")  # the name users filter on: these run in the worker

__all__ = ["Listener", "check_sleep_deadline"]


def check_sleep_deadline(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> None:
    """Move the sleep deadline to now (a no-op for the producers): a role that may not move it
    fails at start, with the grant it lacks, rather than at its first idle moment, restarting."""
    try:
        with psycopg.RawCursor(conn) as cur:
            cur.execute(sql.worker_sleep, (0.0,))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigurationError(
            f"this role cannot move the workers' sleep deadline ({exc.diag.message_primary}):"
            " GRANT UPDATE ON SEQUENCE fastjobs_sleep_until TO the role workers connect as"
        ) from None


class Listener:
    """The worker's dedicated LISTEN connection.

    Health is checked by a self-notification round trip (a ping on the
    fastjobs_ping channel carrying this listener's id); a dead listener is
    reconnected, and while it is down the worker simply polls.

    Every change of its state is written to the worker's `card` when it
    happens, so `fastjobs stats` shows the connection as it is, busy or idle,
    not as the worker's last sleep left it. While the worker
    is busy, `poll` reads the connection once a second: a lost listener shows
    at once, and the server's notifications never pile up unread.
    """

    def __init__(
        self,
        dsn: str,
        queues: list[str],
        wake_fd: int | None = None,
        card: Card | None = None,
        sql: ModuleType = sql,
    ) -> None:
        self.dsn = dsn
        self.sql = sql  # the statements (and channels) of the app's schema
        self.queues = set(queues)
        self.wake_fd = wake_fd
        self.card = card
        self.conn: psycopg.Connection[Any] | None = None
        self.ping = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.last_check = 0.0
        self.healthy_at = 0.0  # time.time() of the last connect or ping that worked (for stats)
        self.reconnects = 0
        self._woken = False  # a wake-up read while checking, for the next wait

    def connect(self) -> bool:
        try:
            self.conn = database.connect(self.dsn, autocommit=True)
            self.conn.execute(self.sql.listen_jobs)
            self.conn.execute(self.sql.listen_ping)
            self.last_check = time.monotonic()
            self.healthy_at = time.time()
            return True
        except (psycopg.Error, DatabaseUnavailable) as exc:
            logger.warning("listener connection failed, polling meanwhile: %s", exc)
            self.conn = None
            return False
        finally:
            self._report()

    def _report(self) -> None:
        if self.card is not None:
            self.card.listener(self.conn is not None, self.healthy_at, self.reconnects)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def wait(self, timeout: float) -> bool:
        """Sleep until a notification for one of our queues, a wake-up, or `timeout`; True if woken."""
        if self._woken:
            self._woken = False
            return True
        deadline = time.monotonic() + timeout
        if self.conn is None and not self.connect():
            self.reconnects += 1
            self._report()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fds = [self.wake_fd] if self.wake_fd is not None else []
            if self.conn is not None:
                fds.append(self.conn.pgconn.socket)
            readable, _, _ = select.select(fds, [], [], left)
            if self.wake_fd is not None and self.wake_fd in readable:
                return True
            if self.conn is not None and readable:
                try:
                    if self._read()[0]:
                        return True
                except psycopg.Error:
                    self._lost()

    def _read(self) -> tuple[bool, bool]:
        """Read what arrived: (a wake-up for our queues, our ping came back)."""
        assert self.conn is not None
        pgconn = self.conn.pgconn
        pgconn.consume_input()
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError("listener connection lost")
        hit = pinged = False
        while (n := pgconn.notifies()) is not None:
            payload = n.extra.decode()
            if n.relname == self.sql.PING_CHANNEL.encode():
                pinged = pinged or payload == self.ping
            elif payload in self.queues:
                hit = True
        return hit, pinged

    def check(self, timeout: float = 5.0) -> bool:
        """Self-notification round trip; reconnect when it does not come back in `timeout` seconds."""
        self.last_check = time.monotonic()
        if self.conn is None:
            return self.connect()
        try:
            # Through libpq, not cursor.execute: psycopg would consume the
            # notification the ping triggers before _read could see it.
            res = self.conn.pgconn.exec_params(self.sql.listener_ping.encode(), [self.ping.encode()])
            if res.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise psycopg.OperationalError(res.error_message.decode(errors="replace"))
            deadline = time.monotonic() + timeout
            while True:
                # libpq may have queued the ping already while reading the result.
                hit, pinged = self._read()
                self._woken = self._woken or hit
                if pinged:
                    self.healthy_at = time.time()
                    self._report()
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                select.select([self.conn.pgconn.socket], [], [], left)
        except psycopg.Error:
            pass
        self._lost()
        return self.connect()

    def poll(self) -> None:
        """Read what arrived without waiting (the busy worker's look, once a second).

        A wake-up is kept for the next `wait`; a lost connection is reported
        now and made again when the worker next sleeps.
        """
        if self.conn is None:
            return
        try:
            self._woken = self._read()[0] or self._woken
        except psycopg.Error:
            self._lost()

    def _lost(self) -> None:
        logger.warning("listener connection lost; reconnecting, polling meanwhile")
        self.reconnects += 1
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
        self.conn = None
        self._report()
