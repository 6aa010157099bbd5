"""A process's card in the stats file: its counters, the jobs it holds, its counts per (queue, kind).

A process writes only its own card, after each batch, with plain stores: no
lock, no syscall (a torn read costs the master one slightly wrong sample,
never a wrong total). A card is float64 counters (FIELDS), then int64 fields
that say which jobs a worker holds in what stage: the master reads them after
the worker died to give back exactly what never started (`Card.crash_report`;
docs/internals.md, crash accounting), then the worker's counts per (queue,
kind) (fastjobs.abc.ROW: outcomes, run-time and pickup-latency histograms),
bumped by the hot loop per job. fastjobs.scoreboard lays the cards out in the
file.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from .abc import (
    BUCKETS_NS,
    COMPLETED,
    INT64_MAX,
    MAX_KINDS,
    OBSERVED_MAX_NS,
    OUTCOMES,
    ROW,
    RUN_SUM,
    BatchLoop,
)
from .types import Outcome

__all__ = [
    "CARD_FLOATS",
    "FIELDS",
    "INTEGER_FIELDS",
    "INT_FIELDS",
    "LEADER",
    "ROLES",
    "ROTATION_DEFERRED",
    "ROTATION_FAILED",
    "ROTATION_GAVE_WAY",
    "ROTATION_OK",
    "ROTATION_PRIVILEGES",
    "RUNNING_JOB",
    "RUNNING_SUSPECT",
    "RUNNING_WRITING",
    "SLOW_CAPACITY_MAX",
    "WORKER",
    "Card",
    "F",
    "SlowJobs",
    "card_size",
    "count_slow",
    "kind_rows",
    "observe",
    "outcome_column",
    "worker_counters",
]

FIELDS = (
    "pid",
    "role",  # 0 empty, 1 worker, 2 leader
    "index",
    "claimed",
    "completed",
    "failed",
    "retried",
    "discarded",
    "busy",  # seconds spent in batches that ran jobs
    "heartbeat",  # time.time() of the last loop turn or heartbeat-thread beat (each second while alive)
    "started",
    "rate",  # completed jobs/s over the last second, written by the master
    "progress",  # jobs started, bumped by the hot loop per job (the watchdog's signal)
    "listening",  # 1 while the worker's LISTEN connection is up
    "listener_ok",  # time.time() of its last connect or ping round trip that worked
    "listener_reconnects",
    "leading",  # the leader: 1 while it holds the cluster's lock (its metrics then show the cluster)
    "rotated_at",  # the leader: time.time() of its last rotation (0: none yet)
    "rotation_problem",  # the leader: why its last rotation try did not rotate (ROTATION_PROBLEMS; 0: it did)
    "services_failing",  # the leader: maintenance services whose last turn raised
    "service_failures",  # the leader: turns of its services that raised, in all
)
# The fields that hold whole numbers (stored as float64 like the rest): integers in `stats --json`.
INTEGER_FIELDS = frozenset(
    {"pid", "role", "index", "claimed", "completed", "failed", "retried", "discarded", "progress"}
    | {"listening", "listener_reconnects", "rotation_problem", "services_failing", "service_failures"}
)
CARD_FLOATS = len(FIELDS)
F = {name: i for i, name in enumerate(FIELDS)}
_CLAIMED, _COMPLETED, _FAILED, _RETRIED, _DISCARDED, _BUSY, _HEARTBEAT = (
    F[name] for name in ("claimed", "completed", "failed", "retried", "discarded", "busy", "heartbeat")
)
_LISTENING, _LISTENER_OK, _LISTENER_RECONNECTS = (
    F[name] for name in ("listening", "listener_ok", "listener_reconnects")
)
# The int64 fields after the floats, then `capacity` ids of the slow jobs
# whose handlers are running (0: a free entry).
INT_FIELDS = (
    "job",  # the job the hot loop's fast path runs (0: none): set before it starts
    "writing",  # outcomes of failed jobs in the batch statement in flight (0: none)
    "suspect",  # the job whose outcome that is, when there is exactly one
    "overflow",  # slow jobs running that found no free entry below
)
_JOB, _WRITING, _SUSPECT, _OVERFLOW = range(len(INT_FIELDS))
# The hot loop's view of them (Card.running_view): the same offsets, by name.
RUNNING_JOB, RUNNING_WRITING, RUNNING_SUSPECT = _JOB, _WRITING, _SUSPECT
# The most slow jobs a card records (a worker's concurrency, capped).
SLOW_CAPACITY_MAX = 10_000
ROLES = {1: "worker", 2: "leader"}
WORKER, LEADER = 1, 2

# Why a rotation try did not rotate (fastjobs.maintenance.Rotator.problem, the
# leader card's rotation_problem): its name, and what the operator should do.
ROTATION_OK, ROTATION_PRIVILEGES, ROTATION_DEFERRED, ROTATION_GAVE_WAY, ROTATION_FAILED = range(5)


class Card:
    """One process's counters (a window of float64) and its jobs in hand (int64) in the shared mapping."""

    def __init__(self, view: Any, ints: Any, counts: Any = None) -> None:
        self.view = view  # memoryview of float64
        self.ints = ints  # memoryview of int64: INT_FIELDS, then the slow jobs running
        self.counts = counts  # memoryview of int64: the rows per (queue, kind), fastjobs.abc.ROW each

    def __getitem__(self, name: str) -> float:
        return float(self.view[F[name]])

    def __setitem__(self, name: str, value: float) -> None:
        self.view[F[name]] = value

    def claim(self, role: int, index: int) -> None:
        """Take this card for the calling process, zeroing its counters."""
        for i in range(CARD_FLOATS):
            self.view[i] = 0.0
        for i in range(len(self.ints)):
            self.ints[i] = 0
        if self.counts is not None and len(self.counts):
            self.counts.cast("B")[:] = bytes(len(self.counts) * 8)
        self.view[F["pid"]] = os.getpid()
        self.view[F["role"]] = role
        self.view[F["index"]] = index
        self.view[F["started"]] = self.view[F["heartbeat"]] = time.time()

    def record(self, loop: BatchLoop, busy: float) -> None:
        """Copy a BatchLoop's counters into the card (after each batch)."""
        view = self.view
        view[_CLAIMED] = loop.claimed
        view[_COMPLETED] = loop.completed
        view[_FAILED] = loop.failed
        view[_RETRIED] = loop.retried
        view[_DISCARDED] = loop.discarded
        view[_BUSY] += busy
        view[_HEARTBEAT] = time.time()

    def progress_view(self) -> Any:
        """The float the hot loop bumps per job started (the watchdog's signal)."""
        return self.view[F["progress"] : F["progress"] + 1]

    def running_view(self) -> Any:
        """The int64 fields the hot loop writes: the job it runs, and the outcomes it is writing."""
        return self.ints[RUNNING_JOB : RUNNING_SUSPECT + 1]

    def slow_jobs(self) -> SlowJobs:
        """Where the worker's executor records the slow jobs whose handlers run."""
        return SlowJobs(self.ints, timed=self.counts_view() is not None)

    def counts_view(self) -> Any:
        """The int64 rows per (queue, kind) the hot loop bumps per job (None in a file without them)."""
        return self.counts if self.counts is not None and len(self.counts) else None

    def crash_report(self) -> tuple[list[int] | None, int]:
        """After the worker died: (the jobs it was running, or None if the card could not record them
        all; how many failed jobs' outcomes it was writing)."""
        ints = self.ints
        if ints[_OVERFLOW]:
            return None, 0
        running = [int(job) for job in ints[len(INT_FIELDS) :] if job]
        if ints[_JOB] > 0:
            running.append(int(ints[_JOB]))
        return running, int(ints[_WRITING])

    def clear_jobs(self) -> None:
        """Name no job: every outcome the worker held is written (its death then charges none)."""
        self.ints.cast("B")[:] = bytes(len(self.ints) * 8)

    def clear_writing(self) -> None:
        """Name no outcome as being written: its statement was lost with the connection, not its fault."""
        self.ints[_WRITING] = 0
        self.ints[_SUSPECT] = 0

    def suspect(self) -> int:
        """The one failed job whose outcome was being written (0: none, or more than one)."""
        return int(self.ints[_SUSPECT]) if self.ints[_WRITING] == 1 else 0

    def beat(self) -> None:
        self.view[_HEARTBEAT] = time.time()

    def listener(self, up: bool, healthy_at: float, reconnects: int) -> None:
        view = self.view
        view[_LISTENING] = 1.0 if up else 0.0
        view[_LISTENER_OK] = healthy_at
        view[_LISTENER_RECONNECTS] = reconnects

    def as_dict(self) -> dict[str, float]:
        return {name: float(self.view[i]) for i, name in enumerate(FIELDS)}


class SlowJobs:
    """The slow jobs (async, with a timeout, or on threads) whose handlers run now, in the worker's card.

    The executor adds a job just before its handler starts and removes it
    when the handler returns: if the worker dies, exactly these count a
    crash, and every other job it holds goes back uncounted. Entries are
    reused from a free list (no scan); a job that finds none sets `overflow`,
    and the master then leaves all of that worker's jobs to the rescuer.
    """

    def __init__(self, ints: Any, timed: bool = True) -> None:
        self._ints = ints
        base = len(INT_FIELDS)
        self._free = list(range(len(ints) - 1, base - 1, -1))
        self._at: dict[int, int] = {}
        self._over: set[int] = set()
        # Each slow job's run time in ns (from add to discard), which the hot
        # loop takes for its run-time histogram (count_slow); only `timed`:
        # a card without counts has no histogram, and nothing would take them.
        self._timed = timed
        self._began: dict[int, int] = {}
        self.took: dict[int, int] = {}

    def add(self, job_id: int) -> None:
        if self._timed:
            self._began[job_id] = time.perf_counter_ns()
        if self._free:
            index = self._free.pop()
            self._at[job_id] = index
            self._ints[index] = job_id
        else:
            self._over.add(job_id)
            self._ints[_OVERFLOW] = len(self._over)

    def discard(self, job_id: int) -> None:
        began = self._began.pop(job_id, None)
        if began is not None:
            self.took[job_id] = time.perf_counter_ns() - began
        index = self._at.pop(job_id, None)
        if index is not None:
            self._ints[index] = 0
            self._free.append(index)
        elif job_id in self._over:
            self._over.discard(job_id)
            self._ints[_OVERFLOW] = len(self._over)


def kind_rows(kinds: Iterable[str]) -> tuple[dict[str, int], int]:
    """The hot loop's map of kind to its row's offset within a queue's rows (int64 cells), and the
    offset of the row of every other kind; the queue's rows span (other + ROW) cells."""
    rows = {kind: i * ROW for i, kind in enumerate(kinds) if i < MAX_KINDS}
    return rows, len(rows) * ROW


# The counter of a (queue, kind) row each kind of outcome record adds one to; none for a release.
_COLUMNS: dict[str, int] = {name: column for column, name in enumerate(OUTCOMES)} | {"released": -1}


def outcome_column(outcome: Outcome) -> int:
    """The counter of a (queue, kind) row an outcome record adds one to; -1 for a job given back
    unstarted (a release)."""
    return _COLUMNS[outcome["outcome"]]


def observe(counts: Any, at: int, ns: int) -> None:
    """Add `ns` nanoseconds to the histogram whose sum is counts[at] (its buckets follow)."""
    ns = 0 if ns < 0 else min(ns, OBSERVED_MAX_NS)
    counts[at] = min(counts[at] + ns, INT64_MAX)
    counts[at + 1 + bisect_left(BUCKETS_NS, ns)] += 1


def count_slow(
    counts: Any,
    base: int,
    rows: dict[str, int],
    other: int,
    slow: list[Any],
    done: list[int],
    failures: list[Outcome],
    took: dict[int, int],
) -> None:
    """Count a batch's slow jobs (both hot loops): their outcomes, and the run time of each that
    started (`took`, from SlowJobs), in the rows of queue `base`."""
    row_of = {job[1]: base + rows.get(job[0].kind, other) for job in slow}
    for job_id in done:
        counts[row_of[job_id] + COMPLETED] += 1
    for outcome in failures:
        row = row_of.get(outcome["id"])
        column = outcome_column(outcome)
        if row is not None and column >= 0:
            counts[row + column] += 1
    for job_id, row in row_of.items():
        ns = took.pop(job_id, None)
        if ns is not None:
            observe(counts, row + RUN_SUM, ns)


def card_size(capacity: int, rows: int = 0) -> int:
    """Bytes of one card: its float64 counters, its int64 fields, `capacity` slow jobs and `rows` rows."""
    return (CARD_FLOATS + len(INT_FIELDS) + capacity + rows * ROW) * 8


def worker_counters(card: Card, names: list[tuple[int, str, str]], rate: float) -> dict[str, Any]:
    """What a worker's heartbeat carries into fastjobs_workers.counters: its totals, its rate (jobs
    finished per second since its last heartbeat), and per (queue, kind) row used its outcomes."""
    d = card.as_dict()
    cells = card.counts.tolist() if card.counts is not None else []
    kinds = [
        [queue, kind, *cells[at : at + len(OUTCOMES)]]
        for at, queue, kind in names
        if any(cells[at : at + ROW])
    ]
    totals = {name: int(d[name]) for name in ("claimed", "completed", "failed", "retried", "discarded")}
    return {**totals, "busy": round(d["busy"], 6), "rate": round(rate, 3), "kinds": kinds}
