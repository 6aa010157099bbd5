"""The leader: one process per cluster, elected by an advisory lock, that runs maintenance.

Every service has one shape: a config with defaults and a `*_once(conn, now)`
that works in LIMIT-sized batches until a batch comes back short. For now the
service is the scheduler; a standalone Worker (no master, so no leader) runs
it itself when idle, which is safe concurrently (SKIP LOCKED).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import random
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql as pgsql

from . import database, enqueue, queues, schema, sql
from .cron import schedule
from .errors import ConfigurationError, DatabaseUnavailable
from .stats import (
    HORIZON_WARNING,
    ROTATION_DEFERRED,
    ROTATION_FAILED,
    ROTATION_GAVE_WAY,
    ROTATION_OK,
    ROTATION_PRIVILEGES,
    ROTATION_PROBLEMS,
    Horizon,
    Slot,
    health,
)
from .types import JobSpec

if TYPE_CHECKING:
    from .app import App

__all__ = [
    "CleanerConfig",
    "LeaderConfig",
    "PeriodicConfig",
    "RescuerConfig",
    "RotationConfig",
    "SchedulerConfig",
    "VacuumConfig",
]

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

# A worker's control thread heartbeats this often; the rescuer treats a
# worker silent for RescuerConfig.stale_after (15 s, at least MIN_STALE_AFTER) as dead.
HEARTBEAT_INTERVAL = 2.0
MIN_STALE_AFTER = 2.5 * HEARTBEAT_INTERVAL


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduled and retryable jobs become available when due."""

    batch: int = 10_000
    interval: float = 1.0


@dataclass(frozen=True, slots=True)
class RescuerConfig:
    """Running jobs of dead workers go back to retryable.

    A worker heartbeats every 2 s from a thread of its own, so 15 s of
    silence means its process is gone (or frozen, and the master's watchdog
    replaces it). `max_crashes` deaths of its worker quarantine a job.
    """

    stale_after: float = 15.0
    max_crashes: int = 3
    batch: int = 1_000
    interval: float = 5.0

    @classmethod
    def after(cls, stale_after: float) -> RescuerConfig:
        """Rescue after `stale_after` seconds of silence, looking three times as often (at most every 5 s)."""
        if not stale_after >= MIN_STALE_AFTER:
            raise ConfigurationError(
                f"the rescue delay must be at least {MIN_STALE_AFTER:g} s (workers heartbeat every"
                f" {HEARTBEAT_INTERVAL:g} s), not {stale_after:g}"
            )
        return cls(stale_after=stale_after, interval=min(cls().interval, stale_after / 3))


@dataclass(frozen=True, slots=True)
class CleanerConfig:
    """Finished jobs are deleted after their retention, in batches; kept results (fastjobs_results)
    once they expire (each row carries its own expiry, its job's keep_result); silent workers' rows pruned.

    A backlog (a million finished jobs, say) is deleted in turns of at most
    `budget` seconds, and the leader rests between turns so the cleaner
    takes no more than `duty` of the time: deleting flat out on a 2-core
    machine slows a concurrent drain to 0.6 x (measured); at 10% it stays
    within the 10% the cleaner may cost.
    """

    completed_retention: float = 24 * 3600.0
    discarded_retention: float = 7 * 24 * 3600.0
    worker_retention: float = 3600.0
    batch: int = 5_000
    interval: float = 30.0
    budget: float = 0.5
    duty: float = 0.1

    def rest(self, spent: float) -> float:
        """Seconds to rest after a turn that took `spent` (its whole budget: more is due)."""
        return spent * (1.0 - self.duty) / self.duty


@dataclass(frozen=True, slots=True)
class VacuumConfig:
    """The jobs table is vacuumed by the leader as soon as dead rows pile up.

    Every job leaves two dead row versions (its claim and its completion):
    at 30k jobs/s, 60k a second. Autovacuum visits a database once a minute
    at best (autovacuum_naptime), and never where it is off; meanwhile the
    table grows by ~10 MB/s and the claim index fills with entries of claimed
    jobs. The leader runs VACUUM on a connection of its own (it may take
    seconds; the other services keep their pace) whenever `threshold` dead
    rows are counted, resting between runs so it vacuums at most `duty` of
    the time: a transaction holding the horizon back makes every VACUUM long
    and useless until it ends.
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


@dataclass(frozen=True, slots=True)
class RotationConfig:
    """The rotating slots of fastjobs_jobs_all are emptied by TRUNCATE, one every `interval` seconds.

    VACUUM can remove no dead row that an open snapshot may still see; TRUNCATE
    frees a table's storage whatever the snapshots. Jobs due now go to the
    current one of SLOTS rotating slots (migrations/005_rotation.sql); every
    `interval` the leader empties the oldest, the one after the current, and
    makes it current, so a job's dead rows live at most SLOTS x `interval`
    seconds, and a claim never walks index entries older than that. The
    rotation waits at most `lock_timeout` for its lock, then gives way and
    tries again `retry` seconds later, doubling while it keeps giving way (up
    to `interval`), and warns after a minute without a rotation: enqueues never wait for it (an insert
    locks only the current slot), claims and finishes at most that long plus
    the time the lock is held (tens of ms: the copy, the truncation and its
    commit).

    A slot still holding more than `max_move` available rows (a backlog) is
    not copied under the lock: while it drains, oldest first, the rotation
    waits. It waits at most `patience` seconds: a backlog that outlasts it (a
    queue nobody serves) would stop every slot's cleanup for good. Then each
    try moves the slot's available rows to slot 0, the vacuumed one, by row
    locks in statements of SETTLE_BATCH (never under the slot's lock: claims
    and enqueues go on, skipping the rows being moved), for at most
    `evacuate_budget` seconds, until the slot holds no more than `max_move`
    and rotates as usual. So the rotating slots' storage stays bounded by the
    backlog plus `patience` seconds of traffic; the backlog moves once and
    costs VACUUM afterwards, as before 005. Measured (PostgreSQL 15, 2
    shared cores): 50,000 unserved rows behind 30,000 dead ones moved in
    0.9-1.2 s (10-20 ms a statement), then the rotation held its lock 12-28
    ms (bench/RESULTS.md, Upkeep).

    A rotation stalls every claim for the time its lock is queued and held
    (~10 ms: TRUNCATE rebuilds and syncs each index of the slot), and
    under light load that stall is most of a job's p99 pickup latency
    (bench/RESULTS.md, issue 22 §5). So a turn rotates only while the four
    rotating slots take at least `worth` bytes (tables and indexes), or
    while it works off a backlog: the slots' storage stays bounded by
    `worth` plus what one `interval` brings (the mass of a burst is emptied
    in a few turns after it), and a queue running 1,000 jobs/s rotates
    about every 30 s instead of every 2 s; a busy one (tens of thousands of
    jobs/s) still every `interval`. 0 rotates every `interval`. A Rotator
    that finds the slot moved since its last turn (another in-process
    Worker rotated) waits a whole `interval`: N in-process Workers rotate
    as often as one leader, not N times as often.
    """

    # Off, nothing cleans the rotating slots (autovacuum is off on them): for tests and tools only.
    enabled: bool = True
    interval: float = 2.0
    # Longer than a fast-lane batch's transaction lives (test_upkeep pins it):
    # 0.05 s mostly gave way.
    lock_timeout: float = 0.15
    retry: float = 0.2
    max_move: int = 10_000
    patience: float = 20.0
    evacuate_budget: float = 1.0
    worth: int = 32 * 1024 * 1024


# Settled rows (finished, retryable, scheduled) leave the oldest slot for
# slot 0 by row locks before each try, this many a statement, at most this
# many statements a try.
SETTLE_BATCH = 1_000
SETTLE_BATCHES = 100

# A rotator that has not rotated for this long (seconds) logs a warning, once per as long.
ROTATION_LATE = 60.0

# The rotating slots, 1..SLOTS (slot 0 is fastjobs_jobs, the durable one).
SLOTS = 4


def rotate_once(
    conn: psycopg.Connection[Any],
    config: RotationConfig = RotationConfig(),
    evacuate: bool = False,
    sql: ModuleType = sql,
) -> dict[str, int]:
    """Empty the oldest rotating slot and make it the current one (see RotationConfig).

    Counts: `rotated` 1 and the rows `moved` out of it; or `gave way` 1 (its
    lock was not granted within lock_timeout) or `deferred` 1 (it still
    holds more than max_move rows): then nothing changed, try again later.
    `settled`: finished, retryable and scheduled rows moved to slot 0 first.
    With `evacuate` (the backlog outlasted config.patience), a slot holding
    more than max_move rows first has its available ones moved to slot 0 by
    row locks, for at most config.evacuate_budget seconds: `evacuated`.
    """
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.slot_current).fetchone()
        assert row is not None
        current = row[0]
        oldest = current % SLOTS + 1
        settled = _move_out(cur, sql.slot_settle, oldest, SETTLE_BATCHES * SETTLE_BATCH, float("inf"))
        counts = {"settled": settled}
        if _holds_more(cur, oldest, config.max_move, sql):
            if not evacuate:
                return {"deferred": 1, **counts}
            counts["evacuated"] = _move_out(cur, sql.slot_evacuate, oldest, None, config.evacuate_budget)
            if _holds_more(cur, oldest, config.max_move, sql):
                return {"deferred": 1, **counts}
        partition = pgsql.Identifier(*sql.relation(f"fastjobs_jobs_{oldest}"))
        try:
            with conn.transaction():
                cur.execute(sql.slot_lock_timeout, (f"{max(1, int(config.lock_timeout * 1000))}ms",))
                cur.execute(pgsql.SQL(sql.slot_lock).format(partition=partition))
                moved = cur.execute(sql.slot_move, (oldest, current)).rowcount
                cur.execute(pgsql.SQL(sql.slot_truncate).format(partition=partition))
        except psycopg.errors.LockNotAvailable:
            return {"gave way": 1, **counts}
        # After the commit: setval is not transactional, and a slot must be empty before it is current.
        cur.execute(sql.slot_advance, (oldest,))
    return {"rotated": 1, "moved": moved, **counts}


def _move_out(cur: psycopg.RawCursor[Any], statement: str, slot: int, most: int | None, budget: float) -> int:
    """Run a moving statement in batches of SETTLE_BATCH until one comes back short, `most` rows
    are moved or `budget` seconds are spent; the rows moved."""
    began = time.monotonic()
    moved = 0
    while most is None or moved < most:
        done = cur.execute(statement, (slot, SETTLE_BATCH)).rowcount
        moved += done
        if done < SETTLE_BATCH or time.monotonic() - began >= budget:
            break
    return moved


def _holds_more(cur: psycopg.RawCursor[Any], slot: int, most: int, sql: ModuleType) -> bool:
    row = cur.execute(sql.slot_rows, (slot, most + 1)).fetchone()
    return row is not None and row[0] > most


# How often a rotator that lacks privileges checks them again (seconds).
PRIVILEGE_RECHECK = 30.0


class Rotator:
    """The rotation's pace and health, for whichever process rotates: the leader, or an in-process
    Worker that found the leader's lock free (no `fastjobs run` serves the database).

    `turn` tries once and says when to try next: after `interval`, sooner
    after giving way (doubling from `retry`), and not before PRIVILEGE_RECHECK
    when the role lacks the privileges (checked before the first try: a clear
    error naming the GRANTs instead of a failure every turn). A slot that
    deferred longer than `patience` is evacuated (rotate_once). `problem` is
    why the last try did not rotate (ROTATION_OK when it did), `rotated_at`
    the time.time() of the last rotation (0: none yet).
    """

    def __init__(self, config: RotationConfig, who: str = "leader", sql: ModuleType = sql) -> None:
        self.config = config
        self.sql = sql  # the catalogue of the schema it rotates
        self.who = who
        self.problem = ROTATION_OK
        self.rotated_at = 0.0
        self.misses = 0  # tries since the last rotation
        self._since = time.monotonic()  # of the last rotation, or since it started trying
        self._warned = 0.0
        self._deferred_since: float | None = None
        self._privileges_at: float | None = None  # when the privileges were last found lacking
        self._checked = False
        self._told = False  # the missing privileges were logged as an error
        self._slot: int | None = None  # the current slot after this rotator's last turn

    def turn(self, conn: psycopg.Connection[Any]) -> tuple[dict[str, int], float]:
        """One try: its counts (rotate_once's, or `unable` 1 without the privileges) and the seconds
        until the next. Errors other than a broken connection are counted as a failed try, then raised."""
        now = time.monotonic()
        config = self.config
        if self._privileges_at is not None and now - self._privileges_at < PRIVILEGE_RECHECK:
            return {"unable": 1}, PRIVILEGE_RECHECK - (now - self._privileges_at)
        if not self._checked:
            if not self._check(conn):
                self._privileges_at = now
                self._missed(ROTATION_PRIVILEGES, {"unable": 1})
                return {"unable": 1}, PRIVILEGE_RECHECK
            self._checked = True
            self._privileges_at = None
        evacuate = self._deferred_since is not None and now - self._deferred_since >= config.patience
        try:
            if config.worth > 0 and self._deferred_since is None:
                idle = self._idle(conn)
                if idle is not None:
                    return idle, config.interval
            result = rotate_once(conn, config, evacuate=evacuate, sql=self.sql)
        except psycopg.errors.InsufficientPrivilege:
            self._checked = False  # revoked meanwhile: say which, at the next turn
            self._missed(ROTATION_FAILED, {"failed": 1})
            raise
        except psycopg.Error:
            self._missed(ROTATION_FAILED, {"failed": 1})
            raise
        if result.get("rotated"):
            self.problem = ROTATION_OK
            self.misses = 0
            self._since = time.monotonic()
            self.rotated_at = time.time()
            self._deferred_since = None
            if self._slot is not None:  # rotate_once made the oldest slot, the one after, current
                self._slot = self._slot % SLOTS + 1
            level = logging.INFO if result.get("evacuated") else logging.DEBUG  # else routine, every 2 s
            logger.log(level, "%s rotator: %s", self.who, _describe(result))
            return result, config.interval
        if result.get("deferred"):
            if self._deferred_since is None:
                self._deferred_since = now
            self._missed(ROTATION_DEFERRED, result)
            return result, config.interval
        self._missed(ROTATION_GAVE_WAY, result)
        return result, min(config.interval, config.retry * 2 ** (self.misses - 1))

    def _idle(self, conn: psycopg.Connection[Any]) -> dict[str, int] | None:
        """This turn's counts when it need not rotate (the slots take less than config.worth bytes, or
        another rotator moved the slot since this one's last turn), None when it should. Not rotating
        then is no problem: the rotation is up to date."""
        with psycopg.RawCursor(conn) as cur:
            row = cur.execute(self.sql.slot_usage).fetchone()
        assert row is not None
        current, used = row
        moved = self._slot is not None and current != self._slot
        self._slot = current
        if not moved and used >= self.config.worth:
            return None
        self.problem = ROTATION_OK
        self.misses = 0
        self._since = time.monotonic()
        return {"idle": 1}

    def _check(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether this role may rotate; logs the GRANTs it lacks, as an error, when not."""
        with psycopg.RawCursor(conn) as cur:
            row = cur.execute(self.sql.slot_privileges).fetchone()
        assert row is not None
        lacking, role = row
        if not lacking:
            return True
        grants = "; ".join(f"GRANT {clause} TO {role}" for clause in lacking)
        # An error once; while it lasts, the late-rotation warning repeats it every ROTATION_LATE.
        logger.log(
            logging.WARNING if self._told else logging.ERROR,
            "%s rotator: role %s may not empty the rotating slots, which nothing else cleans (their"
            " dead rows grow without bound); the other maintenance goes on. As the tables' owner,"
            " run: %s",
            self.who,
            role,
            grants,
        )
        self._told = True
        return False

    def _missed(self, problem: int, result: dict[str, int]) -> None:
        """A try that did not rotate: a warning once the rotation has been late for ROTATION_LATE."""
        self.problem = problem
        self.misses += 1
        now = time.monotonic()
        if now - self._since >= ROTATION_LATE and now - self._warned >= ROTATION_LATE:
            self._warned = now
            name, hint = ROTATION_PROBLEMS[problem]
            logger.warning(
                "%s rotator: no slot rotated for %.0f s (%d tries, the last %s: %s); the rotating slots"
                " grow until one does: %s",
                self.who,
                now - self._since,
                self.misses,
                name,
                _describe(result),
                hint,
            )


@dataclass(frozen=True, slots=True)
class PeriodicConfig:
    """Cron jobs are enqueued by the leader, once per tick cluster-wide."""

    interval: float = 1.0


def schedule_once(
    conn: psycopg.Connection[Any],
    now: dt.datetime | None = None,
    config: SchedulerConfig = SchedulerConfig(),
    sql: ModuleType = sql,
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


def rescue_once(
    conn: psycopg.Connection[Any],
    now: dt.datetime | None = None,
    config: RescuerConfig = RescuerConfig(),
    sql: ModuleType = sql,
) -> dict[str, int]:
    """Return running jobs of dead workers; counts by new state (retryable, discarded)."""
    now = now or _db_now(conn)
    counts: dict[str, int] = {}
    with psycopg.RawCursor(conn) as cur:
        while True:
            rows = cur.execute(
                sql.job_rescue_many, (config.stale_after, now, config.max_crashes, config.batch)
            ).fetchall()
            for _, state in rows:
                counts[state] = counts.get(state, 0) + 1
            if len(rows) < config.batch:
                return counts


def clean_once(
    conn: psycopg.Connection[Any],
    now: dt.datetime | None = None,
    config: CleanerConfig = CleanerConfig(),
    sql: ModuleType = sql,
) -> dict[str, int]:
    """Delete finished jobs past their retention, expired results, and prune silent workers; counts of each.

    Works in batches until one comes back short or `config.budget` seconds
    are spent (then the caller comes back after `config.rest`).
    """
    now = now or _db_now(conn)
    counts = {"completed": 0, "discarded": 0, "results": 0, "workers": 0}
    passes = (
        ("completed", sql.job_clean_completed_many, config.completed_retention),
        ("discarded", sql.job_clean_discarded_many, config.discarded_retention),
        ("results", sql.result_clean_many, 0.0),  # expires_at is the row's own
    )
    began = time.monotonic()
    with psycopg.RawCursor(conn) as cur:
        for name, statement, retention in passes:
            before = now - dt.timedelta(seconds=retention)
            while time.monotonic() - began < config.budget:
                deleted = cur.execute(statement, (before, config.batch)).rowcount
                counts[name] += deleted
                if deleted < config.batch:
                    break
        before = now - dt.timedelta(seconds=config.worker_retention)
        counts["workers"] = cur.execute(sql.worker_prune_many, (before,)).rowcount
    return counts


# A tick this old or younger is on time: it runs even for a kind no leader has seen before.
PERIODIC_ON_TIME = dt.timedelta(minutes=1)


def periodic_once(
    conn: psycopg.Connection[Any],
    specs: list[JobSpec],
    now: dt.datetime | None = None,
    app: App | None = None,
) -> list[tuple[str, dt.datetime]]:
    """Enqueue each cron job whose latest tick no leader has enqueued yet; returns (kind, tick).

    The tick is recorded in fastjobs_periodic in the same transaction as the
    enqueue, so a tick is enqueued exactly once across the cluster and across
    leader changes. The missed-tick rule (docs/guides/periodic.md): ticks missed
    while no leader ran are caught up with one job, for the most recent of
    them, never a burst. A kind no leader has seen before starts at its next
    tick, as cron, River and Oban do: a tick under a minute old runs; an older
    one is not run, and not recorded as if it had been (the moment the kind
    was first seen is, so a tick missed from then on is caught up). With `app`, the enqueue goes through
    its enqueue middleware, in its schema.
    """
    statements = sql if app is None else app.sql
    now = now or _db_now(conn)
    done = []
    for spec in specs:
        assert spec.cron is not None
        tick = schedule(spec.cron, spec.tz).latest(now)
        if tick is None:
            continue
        on_time = now - tick <= PERIODIC_ON_TIME
        first = tick if on_time else first_seen(now)
        with conn.transaction(), psycopg.RawCursor(conn) as cur:
            taken = cur.execute(statements.periodic_advance, (spec.kind, tick, first)).fetchone()
            if taken is None or (taken[0] and not on_time):
                continue
            key = f"periodic:{spec.kind}:{tick.isoformat()}"
            if app is not None:
                app.enqueue(spec.kind, {}, conn=conn, unique_key=key)
            else:
                enqueue.insert(
                    conn, enqueue.insert_params(enqueue.options(spec.kind, spec, unique_key=key), {})
                )
        done.append((spec.kind, tick))
    return done


def first_seen(now: dt.datetime) -> dt.datetime:
    """What fastjobs_periodic records for a kind first seen at `now`: never a whole minute (a tick)."""
    return now if now.second or now.microsecond else now + dt.timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class PeriodicStatus:
    """A periodic job as `fastjobs periodic list` shows it."""

    kind: str
    queue: str
    schedule: str
    last_tick: dt.datetime | None  # the last tick enqueued (None: none yet)
    first_seen: dt.datetime | None  # with no tick enqueued yet: when a leader first saw the kind
    next_tick: dt.datetime | None  # None: the schedule has no tick within 8 years


def periodic_status(
    conn: psycopg.Connection[Any], specs: list[JobSpec], now: dt.datetime | None = None, sql: ModuleType = sql
) -> list[PeriodicStatus]:
    """The periodic jobs `specs`, with what fastjobs_periodic records of each, by kind."""
    now = now or _db_now(conn)
    with psycopg.RawCursor(conn) as cur:
        recorded: dict[str, dt.datetime] = dict(cur.execute(sql.periodic_list).fetchall())
    found = []
    for spec in sorted(specs, key=lambda s: s.kind):
        assert spec.cron is not None
        last = recorded.get(spec.kind)
        last = None if last is None else last.astimezone(dt.UTC)  # cron's time, whatever the session's
        # A whole minute is a tick; anything else the moment the kind was first seen (see first_seen).
        seen = last if last is not None and (last.second or last.microsecond) else None
        tick = None if seen is not None else last
        cron = schedule(spec.cron, spec.tz)
        found.append(PeriodicStatus(spec.kind, spec.queue, cron.describe(), tick, seen, cron.next(now)))
    return found


def _db_now(conn: psycopg.Connection[Any]) -> dt.datetime:
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.db_now).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


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

    def __init__(self, app: App, config: LeaderConfig = LeaderConfig(), slot: Slot | None = None) -> None:
        self.app = app
        self.config = config
        self.slot = slot
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
                if self.slot is not None:
                    self.slot.beat()
                    self.slot["leading"] = 1.0 if self._leading_within_lease() else 0.0
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
                logger.log(level, "leader %s: %s", name, _describe(result))

    def _failed(self, name: str, exc: Exception) -> None:
        """A service's turn raised: logged with why and counted; the other services run on.

        One failing service (a privilege revoked, a bad row, a bug) must not
        take the others with it: the rotator once died on TRUNCATE at every
        turn, restarting the leader for ever, and the periodic service after
        it never ran.
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
        """The services' health into the leader's slot, for `fastjobs stats` and the metrics."""
        if self.slot is not None:
            self.slot["rotation_problem"] = self.rotator.problem
            self.slot["rotated_at"] = self.rotator.rotated_at
            self.slot["services_failing"] = len(self._failing)
            self.slot["service_failures"] = sum(self.failures.values())

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


def _describe(result: Any) -> str:
    if isinstance(result, dict):
        return ", ".join(f"{k} {v}" for k, v in result.items() if v)
    return ", ".join(f"{kind} at {tick:%Y-%m-%d %H:%M}" for kind, tick in result)
