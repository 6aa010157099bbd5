"""The leader's VACUUM of the jobs table (slot 0), on a thread and a connection of its own, while it leads."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg

from . import database, sql
from .errors import DatabaseUnavailable
from .report import HORIZON_WARNING, Horizon, health

__all__ = ["VacuumConfig"]

logger = logging.getLogger("fastjobs.leader")  # the name users filter on: the vacuum runs in the leader


@dataclass(frozen=True, slots=True)
class VacuumConfig:
    """Slot 0, fastjobs_jobs, is vacuumed by the leader as soon as `threshold` dead rows pile up.

    Slot 0 keeps what must outlive the rotation (unique-key and scheduled
    jobs, and the rows the rotation settles there: retryable, finished, a
    moved backlog); every update of them leaves a dead row version, and
    autovacuum visits a database once a minute at best, never where it is
    off. The rotating slots are truncated instead (RotationConfig). The
    leader runs VACUUM on a connection of its own (it may take seconds; the
    other services keep their pace), resting between runs so it vacuums at
    most `duty` of the time: a transaction holding the horizon back makes
    every VACUUM long and useless until it ends.
    """

    enabled: bool = True
    threshold: int = 20_000
    interval: float = 1.0
    duty: float = 0.5
    # The leader's log also says when one snapshot has held cleanup back this
    # long (checked every `horizon_interval` seconds), as `fastjobs stats` does.
    horizon_warning: float = HORIZON_WARNING
    horizon_interval: float = 30.0

    def rest(self, spent: float) -> float:
        return max(self.interval, spent * (1.0 - self.duty) / self.duty)


class Vacuumer:
    """VACUUM of the jobs table, from a thread of the leader, while it leads (see VacuumConfig)."""

    def __init__(
        self, dsn: str, config: VacuumConfig, leading: Callable[[], bool], sql: ModuleType = sql
    ) -> None:
        self.dsn = dsn
        self.sql = sql  # the catalogue of the app's schema
        self.config = config
        self.leading = leading
        self.runs = 0
        self.held_back: Horizon | None = None  # the snapshot that made the last VACUUM futile
        self._conn: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastjobs-vacuum", daemon=True)

    def start(self) -> None:
        if self.config.enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop, cancelling a VACUUM under way (it may have minutes to go; the next leader redoes it)."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.cancel_safe()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        wait = self.config.interval
        next_horizon = 0.0
        try:
            while not self._stop.wait(wait):
                wait = self.config.interval
                if not self.leading():
                    continue
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = database.connect(self.dsn, autocommit=True)
                    if time.monotonic() >= next_horizon:
                        next_horizon = time.monotonic() + self.config.horizon_interval
                        for line in health(self._conn, self.sql).warnings(self.config.horizon_warning):
                            logger.warning("leader: %s", line)
                    wait = self.vacuum_once(self._conn)
                except (psycopg.Error, DatabaseUnavailable) as exc:
                    if not self._stop.is_set():
                        logger.warning("leader vacuum: %s", exc)
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
        finally:
            if self._conn is not None:
                self._conn.close()

    def vacuum_once(self, conn: psycopg.Connection[Any]) -> float:
        """VACUUM the jobs table if enough rows are dead; the seconds to wait before looking again.

        A VACUUM that left most dead rows in place was held back by the
        oldest snapshot; while that same snapshot stays open, another would
        scan the whole (growing) table for nothing, taking CPU from the drain.
        """
        sql = self.sql
        with psycopg.RawCursor(conn) as cur:
            row = cur.execute(sql.jobs_dead_rows).fetchone()
            if row is None or row[0] < self.config.threshold:
                return self.config.interval
            holder = cur.execute(sql.mvcc_horizon).fetchone()
            horizon = Horizon(*holder) if holder else None
            if self.held_back is not None and _same_snapshot(self.held_back, horizon):
                return self.config.interval
            began = time.monotonic()
            cur.execute(sql.vacuum_jobs)
            spent = time.monotonic() - began
            after = cur.execute(sql.jobs_dead_rows).fetchone()
        self.runs += 1
        futile = after is not None and after[0] >= FUTILE_VACUUM * row[0]
        self.held_back = horizon if futile else None
        return self.config.rest(spent)


# A VACUUM that leaves this share of the dead rows in place was held back.
FUTILE_VACUUM = 0.5


def _same_snapshot(before: Horizon, now: Horizon | None) -> bool:
    """Whether `now` is the snapshot `before` still open (same holder, open at least as long)."""
    return (
        now is not None
        and (now.source, now.ident) == (before.source, before.ident)
        and (now.seconds or 0.0) >= (before.seconds or 0.0)
    )
