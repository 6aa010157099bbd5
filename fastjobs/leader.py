"""The leader: one process per cluster, elected by an advisory lock, that runs the maintenance services.

The services themselves (fastjobs.maintenance) take a connection and a
clock; the leader gives them its lock-holding connection at each one's
interval, counts the turns that fail, and runs the vacuum on a thread of
its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from . import database, queues, samples, schema, sql
from .errors import ConfigurationError, DatabaseUnavailable
from .maintenance import (
    CleanerConfig,
    PeriodicConfig,
    RescuerConfig,
    RotationConfig,
    Rotator,
    SchedulerConfig,
    clean_once,
    describe,
    periodic_once,
    rescue_once,
    schedule_once,
)
from .stats import Card
from .vacuum import VacuumConfig, Vacuumer

if TYPE_CHECKING:
    from .app import App

__all__ = ["Leader", "LeaderConfig"]

logger = logging.getLogger(__name__)


# The leader's keepalives, on both ends of its connection (ignored on Unix
# sockets): silent for KEEPALIVE_IDLE seconds, probed every KEEPALIVE_INTERVAL,
# given up after KEEPALIVE_COUNT unanswered probes.
KEEPALIVE_IDLE = 5
KEEPALIVE_INTERVAL = 2
KEEPALIVE_COUNT = 3
# libpq's side; the server's is sql.leader_keepalive.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": KEEPALIVE_IDLE,
    "keepalives_interval": KEEPALIVE_INTERVAL,
    "keepalives_count": KEEPALIVE_COUNT,
    "tcp_user_timeout": 10_000,
}


# The leader's lock session carries this application_name: a candidate
# terminates only a session so named (never an application's own holder of
# the key), once it has been idle past the lease (leader_take_over).
LEADER_APPLICATION = "fastjobs leader"
# How long a leader's session may stay silent before another may take over.
DEFAULT_LEASE = 10.0
MIN_LEASE = 3.0


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    """The leader's election and its services' settings."""

    # None: the key of the app's schema (sql.LEADER_LOCK_KEY of its catalogue): each schema has a leader.
    lock_key: int | None = None
    retry_interval: float = 2.0  # how often a non-leader tries the lock
    # A leader speaks on its lock's session at least every lease / 4; a
    # candidate terminates a leader session idle for longer than `lease`
    # (its process stopped, or its host cut off with the socket still open),
    # which frees the lock. Failover after a frozen leader: lease + retry_interval.
    lease: float = DEFAULT_LEASE
    scheduler: SchedulerConfig = SchedulerConfig()
    rescuer: RescuerConfig = RescuerConfig()
    cleaner: CleanerConfig = CleanerConfig()
    vacuum: VacuumConfig = VacuumConfig()
    rotation: RotationConfig = RotationConfig()
    periodic: PeriodicConfig = PeriodicConfig()

    def __post_init__(self) -> None:
        if not self.lease >= MIN_LEASE:
            raise ConfigurationError(
                f"the leader's lease must be at least {MIN_LEASE:g} s, not {self.lease:g}"
            )


class Leader:
    """The one maintenance process of a cluster, elected by a session-level advisory lock.

    Every host's master runs one; the one whose connection holds the lock
    acts, the others retry every `retry_interval`. Every service runs on the
    lock-holding connection, so a leader whose session died cannot act: it
    finds out at its next statement and steps down, while PostgreSQL has
    released the lock for another to take.

    A session ends when its process dies, but not when the process is
    stopped (SIGSTOP, a frozen VM) or cut off while the server still sees
    the socket open: the lock would stay held. So the lock is a lease: the
    leader speaks on its session at least every `lease / 4`, and a
    candidate that finds the holder's session (named LEADER_APPLICATION)
    idle for longer than `lease` terminates it and takes the lock. A stale
    leader that wakes up can do nothing before it notices: its next
    statement fails on the terminated session (and its vacuum thread, on a
    connection of its own, stands still while the lease is not renewed).
    """

    def __init__(self, app: App, config: LeaderConfig = LeaderConfig(), card: Card | None = None) -> None:
        self.app = app
        self.config = config
        self.card = card
        self.leading = False
        self.periodic = [spec for spec in app.jobs.values() if spec.cron]
        self._due: dict[str, float] = {}
        self.rotator = Rotator(config.rotation, sql=app.sql)
        # The election's lock: the configured key, else the app's schema's.
        self.lock_key: int = app.sql.LEADER_LOCK_KEY if config.lock_key is None else config.lock_key
        # Each service's failed turns (an error it raised; the other services still ran that turn).
        self.failures: dict[str, int] = {}
        self._failing: set[str] = set()  # services whose last turn raised
        self._warned_privilege = False
        self._renewed = 0.0  # time.monotonic() of the last statement on the lock's session while leading
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
        vacuumer = Vacuumer(self.app.dsn, self.config.vacuum, self._leading_within_lease, self.app.sql)
        vacuumer.start()
        try:
            while not self._stop:
                if conn is None or conn.closed or conn.broken:
                    self._step_down()
                    conn = self._connect()
                if conn is not None:
                    try:
                        self._turn(conn)
                    except psycopg.OperationalError as exc:
                        logger.warning("leader lost its connection: %s", exc)
                        self._step_down()
                        conn.close()
                        conn = None
                if self.card is not None:
                    self.card.beat()
                    self.card["leading"] = 1.0 if self._leading_within_lease() else 0.0
                wait = self._next_due() if self.leading else self.config.retry_interval
                # At most a second between beats, whatever the intervals: the
                # master's watchdog reads them.
                select.select([self._wake_r], [], [], min(max(wait, 0.0), 1.0))
        finally:
            vacuumer.stop()
            if conn is not None and not conn.closed:
                if self.leading and not conn.broken:
                    with contextlib.suppress(psycopg.Error), psycopg.RawCursor(conn) as cur:
                        cur.execute(sql.leader_unlock, (self.lock_key,))
                conn.close()

    def _leading_within_lease(self) -> bool:
        return self.leading and time.monotonic() - self._renewed < self.config.lease

    def _step_down(self) -> None:
        if self.leading:
            logger.warning("leader (pid %d) stepped down", os.getpid())
        self.leading = False

    def _connect(self) -> psycopg.Connection[Any] | None:
        try:
            # Keepalives on both ends: a leader cut off by the network must lose
            # its session (and lock) in seconds, not the kernel's two hours.
            conn = database.connect(
                self.app.dsn, autocommit=True, application_name=LEADER_APPLICATION, **KEEPALIVES
            )
            schema.check(conn, self.app.sql)
            with psycopg.RawCursor(conn) as cur:
                lease = int(self.config.lease * 1000)
                cur.execute(
                    sql.leader_keepalive, (KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT, lease)
                )
            return conn
        except DatabaseUnavailable as exc:
            logger.warning("leader cannot connect, retrying: %s", exc)
            return None

    def _next_due(self) -> float:
        return min(self._due.values(), default=time.monotonic()) - time.monotonic()

    def _turn(self, conn: psycopg.Connection[Any]) -> None:
        if not self.leading:
            # The take-over first: its lock attempt is then the last statement a candidate sent.
            self.leading = self._try_lock(conn, wait=1.0 if self._take_over(conn) else 0.0)
            if not self.leading:
                return
            logger.info("leader elected (pid %d)", os.getpid())
            self._due = {}
            self._renewed = time.monotonic()
        elif time.monotonic() - self._renewed >= self.config.lease / 4:
            with psycopg.RawCursor(conn) as cur:
                cur.execute(sql.leader_renew)
            self._renewed = time.monotonic()
        config = self.config
        app = self.app.sql
        services: list[tuple[str, float, Callable[[], Any]]] = [
            ("rescuer", config.rescuer.interval, lambda: rescue_once(conn, config=config.rescuer, sql=app)),
            (
                "scheduler",
                config.scheduler.interval,
                lambda: schedule_once(conn, config=config.scheduler, sql=app),
            ),
            ("cleaner", config.cleaner.interval, lambda: clean_once(conn, config=config.cleaner, sql=app)),
            ("samples", samples.SamplesConfig().interval, lambda: samples.turn(conn, sql=app)),
        ]
        if config.rotation.enabled:
            services.append(("rotator", config.rotation.interval, lambda: self.rotator.turn(conn)))
        # The backlogs of queues with a max_backlog, for their producers (fastjobs.queues).
        services.append(
            ("backlogs", queues.COUNT_INTERVAL, lambda: queues.count_backlogs(conn, app) and None)
        )
        if self.periodic:
            services.append(
                (
                    "periodic",
                    config.periodic.interval,
                    lambda: periodic_once(conn, self.periodic, app=self.app),
                )
            )
        for name, interval, run_once in services:
            now = time.monotonic()
            if now < self._due.get(name, 0.0):
                continue
            # Jitter keeps the leaders of many clusters on one server from beating in step.
            self._due[name] = now + interval * random.uniform(0.9, 1.1)
            try:
                result = run_once()
                self._failing.discard(name)
            except Exception as exc:
                if conn.broken or conn.closed:
                    raise  # the session is gone: step down (Leader.run)
                self._failed(name, exc)
                continue
            finally:
                self._record()
            self._renewed = time.monotonic()
            spent = time.monotonic() - now
            if name == "backlogs":  # counts bounded by the limits, at most 10% of the leader's time
                self._due[name] = time.monotonic() + max(queues.COUNT_INTERVAL, spent * 9)
            if name == "cleaner" and spent >= config.cleaner.budget:
                self._due[name] = time.monotonic() + config.cleaner.rest(spent)  # a backlog: paced
            if name == "rotator":
                result, wait = result
                self._due[name] = time.monotonic() + wait
                continue
            if result and (not isinstance(result, dict) or any(result.values())):
                # Rescued jobs are trouble (their workers died or fell silent); the rest is routine.
                level = logging.WARNING if name == "rescuer" else logging.INFO
                logger.log(level, "leader %s: %s", name, describe(result))

    def _failed(self, name: str, exc: Exception) -> None:
        """A service's turn raised: logged with why and counted; the other services run on.

        One failing service (a privilege revoked, a bad row, a bug) must not
        take the others with it, nor restart the leader at every turn.
        """
        self.failures[name] = self.failures.get(name, 0) + 1
        self._failing.add(name)
        logger.error(
            "leader %s failed (%d times so far), the other services go on: %s: %s",
            name,
            self.failures[name],
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, psycopg.Error),  # a bug: its traceback
        )

    def _record(self) -> None:
        """The services' health into the leader's card, for `fastjobs stats` and the metrics."""
        if self.card is not None:
            self.card["rotation_problem"] = self.rotator.problem
            self.card["rotated_at"] = self.rotator.rotated_at
            self.card["services_failing"] = len(self._failing)
            self.card["service_failures"] = sum(self.failures.values())

    def _try_lock(self, conn: psycopg.Connection[Any], wait: float = 0.0) -> bool:
        """Take the lock if it is free; keep trying for `wait` seconds (a terminated holder exits soon)."""
        deadline = time.monotonic() + wait
        with psycopg.RawCursor(conn) as cur:
            while True:
                row = cur.execute(sql.leader_try_lock, (self.lock_key,)).fetchone()
                if row and row[0]:
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)

    def _take_over(self, conn: psycopg.Connection[Any]) -> bool:
        """Terminate the session of a leader silent past its lease; whether there was one."""
        lease = self.config.lease
        try:
            with psycopg.RawCursor(conn) as cur:
                rows = cur.execute(
                    sql.leader_take_over, (self.lock_key, lease, LEADER_APPLICATION)
                ).fetchall()
        except psycopg.errors.InsufficientPrivilege as exc:
            # Another role's leader (or a superuser's): only its session's end frees the lock.
            if not self._warned_privilege:
                self._warned_privilege = True
                logger.warning("leader (pid %d) cannot take over a silent leader: %s", os.getpid(), exc)
            return False
        for pid, client, idle, _ in rows:
            logger.warning(
                "leader (pid %d): the leader's session (backend %s, client %s) was silent for %.1fs, past its"
                " lease of %gs: terminated it",
                os.getpid(),
                pid,
                client,
                idle,
                lease,
            )
        return bool(rows)
