"""The maintenance services: scheduler, rescuer, cleaner, periodic jobs and the rotation.

Every service has one shape: a frozen config with defaults, and a
`*_once(conn, now, config)` that works in LIMIT-sized batches until a batch
comes back short and returns its counts (the rotation needs no clock; the
periodic service is given the cron jobs' specs). The leader runs them all; a
standalone Worker (no master, so no leader) runs the scheduler itself when
idle, and the rotation when the leader's lock is free, both safe
concurrently (SKIP LOCKED; the rotation's own lock). The leader's VACUUM,
which needs a thread of its own, is fastjobs.vacuum.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql as pgsql

from . import enqueue, sql
from .cron import schedule
from .errors import ConfigurationError
from .report import ROTATION_PROBLEMS
from .stats import (
    ROTATION_DEFERRED,
    ROTATION_FAILED,
    ROTATION_GAVE_WAY,
    ROTATION_OK,
    ROTATION_PRIVILEGES,
)
from .types import JobSpec

__all__ = [
    "CleanerConfig",
    "PeriodicConfig",
    "RescuerConfig",
    "RotationConfig",
    "SchedulerConfig",
    "clean_once",
    "periodic_once",
    "rescue_once",
    "rotate_once",
    "schedule_once",
]

logger = logging.getLogger("fastjobs.leader")  # the name users filter on: the services run in the leader

if TYPE_CHECKING:
    from .app import App


# A worker's heartbeat thread beats this often; the rescuer treats a
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
    once they expire (each row carries its own expiry, its job's keep_result); the token buckets of
    keys (fastjobs_limits) once left alone long enough to be full again (sql.key_bucket_clean_many),
    `batch` rows read a statement; silent workers' rows pruned.

    A backlog (a million finished jobs, say) is deleted in turns of at most
    `budget` seconds, and the leader rests between turns so the cleaner
    takes no more than `duty` of the time: deleting flat out would slow a
    concurrent drain by a third on a 2-core machine (bench/RESULTS.md, Cleaner).
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
class RotationConfig:
    """The rotation: the oldest rotating slot emptied by TRUNCATE and made current, every `interval`.

    Why it exists and what it costs: docs/internals.md, rotation. It waits at
    most `lock_timeout` for its lock, then gives way and tries again `retry`
    seconds later, doubling while it keeps giving way (up to `interval`). A
    slot holding more than `max_move` available rows (a backlog) is not
    copied under the lock; after `patience` seconds of that, its available
    rows move to slot 0 by row locks, for at most `evacuate_budget` seconds a
    try. A turn rotates only while the rotating slots take at least `worth`
    bytes, or while it works off a backlog (0: every `interval`). A Rotator
    that finds the slot moved since its last turn (another in-process Worker
    rotated) waits a whole `interval`: N in-process Workers rotate as often
    as one leader.
    """

    # Off, nothing cleans the rotating slots (autovacuum is off on them): for tests and tools only.
    enabled: bool = True
    # How long a dead index entry lives (SLOTS intervals) sets what a claim from the front walks:
    # test_upkeep pins it against FRONT_CLAIM_DUTY and FRONT_CLAIM_MAX_WAIT.
    interval: float = 2.0
    # Longer than a fast-lane batch's transaction lives, or it mostly gives way (test_upkeep pins it).
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
            logger.log(level, "%s rotator: %s", self.who, describe(result))
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
                describe(result),
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
    """Delete finished jobs past their retention, expired results, full buckets of idle keys, and prune
    silent workers; counts of each.

    Works in batches until one comes back short or `config.budget` seconds
    are spent (then the caller comes back after `config.rest`).
    """
    now = now or _db_now(conn)
    counts = {"completed": 0, "discarded": 0, "results": 0, "buckets": 0, "workers": 0}
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
        after: tuple[str, str] = ("", "")  # kinds are not empty: before every row
        while time.monotonic() - began < config.budget:
            row = cur.execute(sql.key_bucket_clean_many, (now, *after, config.batch)).fetchone()
            assert row is not None
            read, deleted, *last = row
            counts["buckets"] += deleted
            if read < config.batch:
                break
            after = (last[0], last[1])
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


def describe(result: Any) -> str:
    """A turn's result for the log: its non-zero counts, or the periodic jobs it enqueued."""
    if isinstance(result, dict):
        return ", ".join(f"{k} {v}" for k, v in result.items() if v)
    return ", ".join(f"{kind} at {tick:%Y-%m-%d %H:%M}" for kind, tick in result)
