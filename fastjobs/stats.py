"""Per-process counters in shared memory, their aggregation, and Prometheus text.

The master maps one file in /dev/shm before forking: a header, then one
fixed slot per process. A process writes only its own slot, after each
batch, with plain stores: no lock, no syscall (a torn read costs the master
one slightly wrong sample, never a wrong total). `fastjobs stats` on the same
host finds the files of the live masters of its database and reads the rates.

The file is `fastjobs-<pid>-<random token>.stats`, created exclusively (never
another master's file or a planted link, even from another PID namespace
sharing /dev/shm) and owner-only. Its master holds an flock on it for its
whole life: a file nobody holds is stale (its master was killed), whatever
process has its pid now. Stale files are removed by `fastjobs stats` and by
the next master of the same user; a master removes its own on every exit
it lives through.

A slot is float64 counters, then int64 fields that say which jobs a worker
holds in what stage: the master reads them after the worker died to give
back exactly what never started (see `Slot.crash_report`), then the
worker's counts per (queue, kind) (fastjobs.abc.ROW: outcomes, run-time and
pickup-latency histograms), bumped by the hot loop per job. After the slots,
the names of those rows: the kinds, and each slot's queues (JSON).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import secrets
import stat
import struct
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg

from . import database, sql
from .abc import (
    BUCKETS,
    BUCKETS_NS,
    COMPLETED,
    INT64_MAX,
    MAX_KINDS,
    OBSERVED_MAX_NS,
    OUTCOMES,
    PICKUP_SUM,
    ROW,
    RUN_SUM,
    BatchLoop,
)
from .types import Outcome

if TYPE_CHECKING:
    from .queues import QueueState

MAGIC = 0x66_6A_73_74  # "fjst"
VERSION = 7
# magic, version, slots, master pid, started, slow-job capacity per slot, rows of
# (queue, kind) counts per slot, token, database identity (sql.database_identity)
HEADER = struct.Struct("<IIIIdII16s128s")
_LABELS = struct.Struct("<I")  # after the slots: the length of the labels' JSON
MAX_SLOTS = 4096  # a bigger file is not one of ours
MAX_ROWS = 65_536
MAX_LABELS = 16 << 20
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
    "heartbeat",  # time.time() of the last loop turn or control-thread beat (each second while alive)
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
SLOT = len(FIELDS)
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
# The hot loop's view of them (Slot.running_view): the same offsets, by name.
RUNNING_JOB, RUNNING_WRITING, RUNNING_SUSPECT = _JOB, _WRITING, _SUSPECT
# The most slow jobs a slot records (a worker's concurrency, capped).
SLOW_CAPACITY_MAX = 10_000
ROLES = {1: "worker", 2: "leader"}
WORKER, LEADER = 1, 2

# Why a rotation try did not rotate (fastjobs.leader.Rotator.problem, the
# leader slot's rotation_problem): its name, and what the operator should do.
ROTATION_OK, ROTATION_PRIVILEGES, ROTATION_DEFERRED, ROTATION_GAVE_WAY, ROTATION_FAILED = range(5)
ROTATION_PROBLEMS = {
    ROTATION_PRIVILEGES: (
        "privileges",
        "the role it connects as may not empty the rotating slots: as the tables' owner, run the GRANTs"
        " the leader's log names (docs/operations/upgrades.md, Roles and grants)",
    ),
    ROTATION_DEFERRED: (
        "deferred",
        "the oldest slot holds a backlog, which it moves to slot 0 after RotationConfig.patience;"
        " serve or discard that queue's jobs",
    ),
    ROTATION_GAVE_WAY: (
        "gave way",
        "its lock is not granted in time: a long transaction holds the jobs table (MVCC health names the"
        " oldest); end it",
    ),
    ROTATION_FAILED: ("failed", "its statements fail: the leader's log says why"),
}


def upkeep_warnings(processes: Iterable[dict[str, float]]) -> list[str]:
    """Lines for the operator from the slots of leaders that lead: the rotation, when its last try did
    not rotate, and maintenance services that fail."""
    lines = []
    for p in processes:
        if p["role"] != LEADER or not p["leading"]:
            continue
        problem = int(p["rotation_problem"])
        if problem in ROTATION_PROBLEMS:
            name, hint = ROTATION_PROBLEMS[problem]
            last = (
                f"last rotated {time.time() - p['rotated_at']:,.0f}s ago"
                if p["rotated_at"]
                else "not rotated yet"
            )
            lines.append(
                f"WARNING: the rotation cannot do its work ({name}; {last}): the rotating slots, which"
                f" nothing else cleans, grow until it does. Why and what to do: {hint}."
            )
        if p["services_failing"]:
            lines.append(
                f"WARNING: {int(p['services_failing'])} maintenance service(s) of the leader (pid"
                f" {int(p['pid'])}) failed at their last turn ({int(p['service_failures'])} failures in all);"
                " the others go on. Its log says which and why."
            )
    return lines


class Slot:
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
        """Take this slot for the calling process, zeroing its counters."""
        for i in range(SLOT):
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
        """Copy a BatchLoop's counters into the slot (after each batch)."""
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
        """After the worker died: (the jobs it was running, or None if the slot could not record them
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
    """The slow jobs (async, with a timeout, or on threads) whose handlers run now, in the worker's slot.

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
        # a slot without counts has no histogram, and nothing would take them.
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


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def database_identity(conn: psycopg.Connection[Any], dsn: str, sql: ModuleType = sql) -> str:
    """The non-secret identity of the database (sql.database_identity), recorded in the stats file.

    A role denied pg_control_system() gets `host:port/dbname` of its DSN instead.
    """
    try:
        with psycopg.RawCursor(conn) as cur:
            row = cur.execute(sql.database_identity).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return database.describe(dsn)
    return str(row[0]) if row else database.describe(dsn)


# The lock on a master's file must be the master's alone: a child holding
# the inherited descriptor would keep a killed master's file looking alive.
# (fork() has no close-on-fork flag; every fork of this process closes them.)
_held_locks: set[int] = set()


def _close_held_locks() -> None:
    for fd in _held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_held_locks)


@dataclass(frozen=True, slots=True)
class Labels:
    """The names of a slot's (queue, kind) rows: the kinds every worker of the master knows (in
    `App.runnable()` order), and each slot's queues (in the order its worker serves them; none for
    the leader). Row q * stride + k counts kind k of queue q; the last of a queue's is OTHER."""

    kinds: list[str] = field(default_factory=list)
    queues: list[list[str]] = field(default_factory=list)

    @property
    def stride(self) -> int:
        return min(len(self.kinds), MAX_KINDS) + 1

    @property
    def rows(self) -> int:
        return max((len(q) for q in self.queues), default=0) * self.stride

    def names(self, index: int) -> Iterator[tuple[int, str, str]]:
        """(row offset in int64 cells, queue, kind) of slot `index`'s rows."""
        kinds = [*self.kinds[:MAX_KINDS], OTHER]
        queues = self.queues[index] if index < len(self.queues) else []
        for q, queue in enumerate(queues):
            for k, kind in enumerate(kinds):
                yield (q * self.stride + k) * ROW, queue, kind


# The kind label of jobs of kinds beyond MAX_KINDS or with no handler.
OTHER = "(other)"


class Slots:
    """The shared mapping: created by the master, inherited by its children, read by `fastjobs stats`."""

    def __init__(
        self,
        path: Path,
        mapping: mmap.mmap,
        count: int,
        capacity: int,
        lock: int | None = None,
        labels: Labels | None = None,
    ) -> None:
        self.path = path
        self._map = mapping
        self._lock = lock
        self.count = count
        self.capacity = capacity
        self.labels = labels or Labels()
        self.rows = self.labels.rows
        self._slot_size = slot_size(capacity, self.rows)
        self._values: Any = memoryview(mapping)

    @classmethod
    def create(cls, count: int, identity: str = "", capacity: int = 0, labels: Labels | None = None) -> Slots:
        """A new file of `count` slots for this process (the master), locked while it lives.

        Each slot records up to `capacity` slow jobs running (a worker's concurrency, capped),
        and its worker's counts per (queue, kind) named by `labels`.
        """
        sweep_stale()
        capacity = min(max(capacity, 0), SLOW_CAPACITY_MAX)
        labels = labels or Labels()
        if labels.rows > MAX_ROWS:
            labels = Labels()  # a plan this large goes without counts per kind
        names = json.dumps({"kinds": labels.kinds, "queues": labels.queues}).encode()
        token = secrets.token_hex(8)
        path = shm_dir() / f"fastjobs-{os.getpid()}-{token}.stats"
        end = HEADER.size + count * slot_size(capacity, labels.rows)
        size = end + _LABELS.size + len(names)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            # Locked before it has a header: a reader never sees a valid unlocked file of a live master.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            # Mapped through a second open of the file: mmap keeps a dup of its
            # descriptor, which every child inherits, and a dup shares the lock.
            try:
                unlocked = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # no /proc: the path, ours in a sticky directory
                unlocked = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mapping = mmap.mmap(unlocked, size)
            finally:
                os.close(unlocked)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        ident = identity.encode()[:128]
        _LABELS.pack_into(mapping, end, len(names))
        mapping[end + _LABELS.size : size] = names
        HEADER.pack_into(
            mapping,
            0,
            MAGIC,
            VERSION,
            count,
            os.getpid(),
            time.time(),
            capacity,
            labels.rows,
            token.encode(),
            ident,
        )
        _held_locks.add(fd)
        return cls(path, mapping, count, capacity, fd, labels)

    @classmethod
    def open(cls, path: Path) -> Slots | None:
        """Map a live master's file read-only (a benchmark reads its own master's); None if it is not one."""
        found = read_master(path)
        if not isinstance(found, MasterFile):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = HEADER.size + found.slots * slot_size(found.capacity, found.labels.rows)
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return cls(path, mapping, found.slots, found.capacity, labels=found.labels)

    def __getitem__(self, index: int) -> Slot:
        base = HEADER.size + index * self._slot_size
        floats = base + SLOT * 8
        counts = base + self._slot_size - self.rows * ROW * 8
        return Slot(
            self._values[base:floats].cast("d"),
            self._values[floats:counts].cast("q"),
            self._values[counts : base + self._slot_size].cast("q"),
        )

    def kinds(self) -> list[KindCounts]:
        """The workers' counts per (queue, kind), summed over the slots (rows never used left out)."""
        return kind_counts(self.labels, ((i, self[i].counts) for i in range(self.count)))

    def __iter__(self) -> Iterator[Slot]:
        return (self[i] for i in range(self.count))

    @property
    def master_pid(self) -> int:
        return int(HEADER.unpack_from(self._map, 0)[3])

    def close(self, unlink: bool = False) -> None:
        self._values.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._lock is not None:
            _held_locks.discard(self._lock)
            os.close(self._lock)
            self._lock = None


@dataclass(frozen=True, slots=True)
class MasterFile:
    """A live master's stats file, as read by `fastjobs stats`."""

    path: Path
    master_pid: int  # in the master's own PID namespace
    started: float
    database: str
    slots: int
    capacity: int  # slow jobs each slot records
    processes: list[dict[str, float]]  # the slots in use
    labels: Labels = field(default_factory=Labels)
    kinds: list[KindCounts] = field(default_factory=list)  # summed over its workers


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file that looked like a stats file and is not one a live master of ours holds."""

    path: Path
    reason: str
    stale: bool = False  # a valid file its master no longer holds
    ours: bool = False  # owned by this user


def slot_size(capacity: int, rows: int = 0) -> int:
    """Bytes of one slot: its float64 counters, its int64 fields, `capacity` slow jobs and `rows` rows."""
    return (SLOT + len(INT_FIELDS) + capacity + rows * ROW) * 8


# No more than this is read from a file that claims to be a stats file.
MAX_FILE = 1 << 30


@dataclass(frozen=True, slots=True)
class Histogram:
    """Seconds observed: how many, their sum, and per bucket upper bound (BUCKETS, then inf) how many
    were at most that (cumulative, as Prometheus has them)."""

    count: int
    sum: float
    buckets: list[int]


@dataclass(frozen=True, slots=True)
class KindCounts:
    """One (queue, kind)'s outcomes (fastjobs.abc.OUTCOMES) and its run-time and pickup histograms."""

    queue: str
    kind: str
    outcomes: dict[str, int]
    run_seconds: Histogram
    pickup_seconds: Histogram


def _histogram(cells: Sequence[int], at: int) -> Histogram:
    running, cumulative = 0, []
    for n in cells[at + 1 : at + 2 + len(BUCKETS)]:
        running += n
        cumulative.append(running)
    return Histogram(running, cells[at] / 1e9, cumulative)


def kind_counts(labels: Labels, slots: Iterable[tuple[int, Sequence[int] | None]]) -> list[KindCounts]:
    """Sum the rows of the (slot index, its int64 cells) given by (queue, kind); the rows never used
    are left out."""
    totals: dict[tuple[str, str], list[int]] = {}
    for index, cells in slots:
        if cells is None or not len(cells):
            continue
        values = cells.tolist() if isinstance(cells, memoryview) else cells
        for at, queue, kind in labels.names(index):
            row = values[at : at + ROW]
            if not any(row):
                continue
            total = totals.get((queue, kind))
            if total is None:
                totals[queue, kind] = list(row)
            else:
                for i, n in enumerate(row):
                    total[i] += n
    return [
        KindCounts(
            queue,
            kind,
            dict(zip(OUTCOMES, row, strict=False)),
            _histogram(row, RUN_SUM),
            _histogram(row, PICKUP_SUM),
        )
        for (queue, kind), row in sorted(totals.items())
    ]


def read_master(path: Path) -> MasterFile | Skipped | None:
    """Read one file with read(2), never a mapping (another user's file can shrink under a mapping).

    None if it vanished meanwhile. Only regular files of this user (of
    anyone, for root) are read, and only when their master holds the lock.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Skipped(path, f"cannot be opened: {exc.strerror}")
    try:
        info = os.fstat(fd)
        ours = info.st_uid == os.geteuid()
        if not stat.S_ISREG(info.st_mode):
            return Skipped(path, "not a regular file")
        if not ours and os.geteuid() != 0:
            return Skipped(path, f"owned by uid {info.st_uid}, not this user")
        if not HEADER.size <= info.st_size <= MAX_FILE:
            return Skipped(path, f"not a fastjobs stats file ({info.st_size} bytes)", ours=ours)
        data = os.pread(fd, info.st_size, 0)
        if len(data) < HEADER.size:
            return Skipped(path, "truncated", ours=ours)
        magic, version, count, pid, started, capacity, rows, _, ident = HEADER.unpack_from(data)
        if magic != MAGIC:
            return Skipped(path, "not a fastjobs stats file", ours=ours)
        if version != VERSION:
            return Skipped(
                path,
                f"written by another version of fastjobs (stats format {version}; this one reads {VERSION})",
                ours=ours,
            )
        end = HEADER.size + count * slot_size(capacity, rows)
        if count > MAX_SLOTS or capacity > SLOW_CAPACITY_MAX or rows > MAX_ROWS or len(data) < end + 4:
            return Skipped(path, "truncated", ours=ours)
        (length,) = _LABELS.unpack_from(data, end)
        if length > MAX_LABELS or len(data) != end + _LABELS.size + length:
            return Skipped(path, "truncated", ours=ours)
        try:
            names = json.loads(data[end + _LABELS.size :])
            labels = Labels(list(names["kinds"]), [list(q) for q in names["queues"]])
        except (ValueError, TypeError, KeyError):
            return Skipped(path, "its names of kinds and queues are not readable", ours=ours)
        if labels.rows != rows:
            return Skipped(path, "its names of kinds and queues do not match its slots", ours=ours)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # its master holds it: live
        else:
            return Skipped(path, "its master is gone", stale=True, ours=ours)
    finally:
        os.close(fd)
    step = slot_size(capacity, rows)
    processes = [
        dict(zip(FIELDS, struct.unpack_from(f"<{SLOT}d", data, HEADER.size + i * step), strict=True))
        for i in range(count)
    ]
    counts_at = step - rows * ROW * 8
    kinds = kind_counts(
        labels,
        (
            (i, struct.unpack_from(f"<{rows * ROW}q", data, HEADER.size + i * step + counts_at))
            for i in range(count)
            if processes[i]["role"] == WORKER
        ),
    )
    identity = ident.rstrip(b"\0").decode(errors="replace")
    live = [p for p in processes if p["role"]]
    return MasterFile(path, pid, started, identity, count, capacity, live, labels, kinds)


def _stats_files() -> list[Path]:
    return sorted(shm_dir().glob("fastjobs-*.stats"))


def sweep_stale() -> list[Path]:
    """Remove this user's stale stats files (their masters were killed); the paths removed."""
    removed = []
    for path in _stats_files():
        found = read_master(path)
        if isinstance(found, Skipped) and found.stale and found.ours:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def live_masters(identity: str | None = None) -> tuple[list[MasterFile], list[Skipped]]:
    """The live masters on this host (of the database `identity` only, when given), and the files skipped.

    A stale file of this user is removed on the way (its Skipped says so).
    """
    found, skipped = [], []
    for path in _stats_files():
        item = read_master(path)
        if item is None:
            continue
        if isinstance(item, Skipped):
            if item.stale and item.ours:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            skipped.append(item)
        elif identity is None or item.database == identity:
            found.append(item)
    return found, skipped


def find(master_pid: int) -> Path | None:
    """The stats file of the live master of pid `master_pid` started from this PID namespace."""
    for path in shm_dir().glob(f"fastjobs-{master_pid}-*.stats"):
        if isinstance(read_master(path), MasterFile):
            return path
    return None


def worker_counters(slot: Slot, names: list[tuple[int, str, str]], rate: float) -> dict[str, Any]:
    """What a worker's heartbeat carries into fastjobs_workers.counters: its totals, its rate (jobs
    finished per second since its last heartbeat), and per (queue, kind) row used its outcomes."""
    d = slot.as_dict()
    cells = slot.counts.tolist() if slot.counts is not None else []
    kinds = [
        [queue, kind, *cells[at : at + len(OUTCOMES)]]
        for at, queue, kind in names
        if any(cells[at : at + ROW])
    ]
    totals = {name: int(d[name]) for name in ("claimed", "completed", "failed", "retried", "discarded")}
    return {**totals, "busy": round(d["busy"], 6), "rate": round(rate, 3), "kinds": kinds}


# A worker heartbeats every leader.HEARTBEAT_INTERVAL (2 s): three missed and
# the cluster view calls it stale (the rescuer waits for --rescue-after, 15 s).
STALE_AFTER = 6.0


@dataclass(frozen=True, slots=True)
class ClusterWorker:
    """One row of fastjobs_workers as the cluster view shows it."""

    id: str
    pid: int
    queues: list[str]
    age: float  # seconds since it registered
    heartbeat_age: float  # seconds since its last heartbeat, by the database's clock
    stale: bool
    rate: float  # jobs finished per second between its last two heartbeats (0 when stale)
    counters: dict[str, Any]  # its heartbeat's (worker_counters); {} from a worker that sends none


@dataclass(frozen=True, slots=True)
class ClusterHost:
    """The workers of one host (host id) against this database, and their sums."""

    host: str
    workers: list[ClusterWorker]
    queues: list[str]
    stale: int  # workers whose heartbeat is older than STALE_AFTER
    heartbeat_age: float  # its freshest worker's
    rate: float
    totals: dict[str, int]  # claimed, completed, failed, retried, discarded over its workers
    kinds: list[dict[str, Any]]  # {queue, kind, and each of OUTCOMES} summed over its workers


def cluster(
    conn: psycopg.Connection[Any], stale_after: float = STALE_AFTER, sql: ModuleType = sql
) -> list[ClusterHost]:
    """Every host with workers registered in this database (from their heartbeats), by host id."""
    with psycopg.RawCursor(conn) as cur:
        rows = cur.execute(sql.worker_list).fetchall()
    by_host: dict[str, list[ClusterWorker]] = {}
    for worker_id, host, pid, queues, age, beat, counters in rows:
        counters = counters if isinstance(counters, dict) else {}
        stale = beat > stale_after
        rate = 0.0 if stale else float(counters.get("rate", 0.0))
        worker = ClusterWorker(worker_id, pid, list(queues), age, beat, stale, rate, counters)
        by_host.setdefault(host, []).append(worker)
    hosts = []
    for host, workers in by_host.items():
        totals = {name: 0 for name in ("claimed", "completed", "failed", "retried", "discarded")}
        kinds: dict[tuple[str, str], dict[str, Any]] = {}
        for w in workers:
            for name in totals:
                totals[name] += int(w.counters.get(name, 0))
            for queue, kind, *outcomes in w.counters.get("kinds", []):
                row = kinds.setdefault(
                    (queue, kind), {"queue": queue, "kind": kind, **dict.fromkeys(OUTCOMES, 0)}
                )
                for name, n in zip(OUTCOMES, outcomes, strict=False):
                    row[name] += int(n)
        hosts.append(
            ClusterHost(
                host,
                workers,
                sorted({q for w in workers for q in w.queues}),
                sum(w.stale for w in workers),
                min(w.heartbeat_age for w in workers),
                sum(w.rate for w in workers),
                totals,
                [kinds[key] for key in sorted(kinds)],
            )
        )
    return hosts


@dataclass(frozen=True, slots=True)
class UnhandledKind:
    """A kind with pending jobs on a queue that live workers serve, none of which has its handler."""

    queue: str
    kind: str
    pending: int
    workers: int  # the live workers serving the queue, each failing the kind's jobs when it claims them

    def warning(self) -> str:
        jobs = f"{self.pending:,} pending job{'' if self.pending == 1 else 's'}"
        return (
            f"WARNING: {jobs} of kind {self.kind!r} on queue {self.queue!r}, and no live worker handles"
            f" that kind: the {self.workers} serving the queue fail each with 'no handler registered'"
            " and it retries. Deploy workers whose application imports its handler, or `fastjobs jobs"
            f" discard --kind {self.kind}`."
        )


def unhandled_kinds(kinds: Iterable[tuple[str, str, int]], hosts: list[ClusterHost]) -> list[UnhandledKind]:
    """The (queue, kind, pending) of `kinds` with pending jobs that no live worker handles.

    Only queues that live workers serve, and whose workers all say what they
    handle (a heartbeat's "handles"; older workers' do not) are judged: a
    queue nobody serves is another matter. The jobs are left to retry, since a
    rolling deploy may bring their handler.
    """
    live = [w for h in hosts for w in h.workers if not w.stale]
    found = []
    for queue, kind, pending in kinds:
        serving = [w for w in live if queue in w.queues]
        if not pending or not serving or any("handles" not in w.counters for w in serving):
            continue
        if not any(kind in w.counters["handles"] for w in serving):
            found.append(UnhandledKind(queue, kind, pending, len(serving)))
    return found


@dataclass(frozen=True, slots=True)
class QueueDepth:
    queue: str
    state: str
    count: int
    oldest_seconds: float | None


def queue_depths(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[QueueDepth]:
    with psycopg.RawCursor(conn) as cur:
        return [QueueDepth(*row) for row in cur.execute(sql.job_stats_by_queue)]


# `fastjobs stats` warns about a transaction pinning the horizon this long:
# at 100k jobs/s a minute leaves millions of dead rows behind the claim index.
HORIZON_WARNING = 60.0
NOTIFY_WARNING = 0.05


@dataclass(frozen=True, slots=True)
class Horizon:
    """The oldest snapshot holding back cleanup of this database's dead rows."""

    source: str  # backend, prepared transaction or replication slot
    ident: str  # its pid, gid or slot name
    seconds: float | None  # how long its transaction has been open (None for a slot)
    xid_age: int | None  # transactions since its snapshot
    detail: str


@dataclass(frozen=True, slots=True)
class TableHealth:
    table: str
    live: int
    dead: int
    table_bytes: int
    index_bytes: int
    last_autovacuum: float | None  # epoch seconds
    last_vacuum: float | None
    autovacuums: int
    last_autoanalyze: float | None


@dataclass(frozen=True, slots=True)
class Health:
    """MVCC health: what keeps dead rows from being removed, and how many there are."""

    horizon: Horizon | None
    tables: list[TableHealth]
    notify_queue: float  # fraction of the NOTIFY queue in use

    def warnings(self, pinned_after: float = HORIZON_WARNING) -> list[str]:
        """Lines for the operator: a horizon pinned longer than `pinned_after` s, a filling NOTIFY queue."""
        lines = []
        h = self.horizon
        if h is not None and h.seconds is not None and h.seconds > pinned_after:
            dead = sum(t.dead for t in self.tables)
            lines.append(
                f"WARNING: cleanup horizon pinned for {h.seconds:,.0f}s by {h.source} {h.ident} ({h.detail}):"
                f" VACUUM cannot remove dead rows newer than it ({dead:,} dead in fastjobs tables)."
                " End or kill that transaction."
            )
        if self.notify_queue >= NOTIFY_WARNING:
            lines.append(
                f"WARNING: the NOTIFY queue is {self.notify_queue:.0%} full: a listening session is stuck"
                " in a transaction; enqueues fail when it is full."
            )
        return lines


def health(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> Health:
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.mvcc_horizon).fetchone()
        tables = [TableHealth(*r) for r in cur.execute(sql.mvcc_tables)]
        usage = cur.execute(sql.notify_queue_usage).fetchone()
    return Health(Horizon(*row) if row else None, tables, float(usage[0]) if usage else 0.0)


def prometheus(
    slots: Slots,
    depths: list[QueueDepth] | None,
    health: Health | None = None,
    hosts: list[ClusterHost] | None = None,
    steered: Sequence[QueueState] = (),
) -> str:
    """Prometheus text exposition of the counters (and queue depths with the queues an operator
    `steered`, MVCC health and the cluster's hosts when given)."""
    lines = []
    counters = (
        ("claimed", "jobs claimed"),
        ("completed", "jobs completed"),
        ("failed", "attempts that failed"),
        ("retried", "failed attempts scheduled to run again"),
        ("discarded", "jobs discarded after their last attempt"),
    )
    live = [
        (f'role="{ROLES.get(int(d["role"]), "?")}",index="{int(d["index"])}"', d)
        for d in map(Slot.as_dict, slots)
        if d["role"]
    ]
    now = time.time()

    def family(name: str, kind: str, help_text: str, value: Callable[[dict[str, float]], str]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value(d)}" for labels, d in live)

    for counter, help_text in counters:

        def count(d: dict[str, float], field: str = counter) -> str:
            return str(int(d[field]))

        family(f"fastjobs_jobs_{counter}_total", "counter", help_text, count)
    family(
        "fastjobs_busy_seconds_total", "counter", "time spent running batches", lambda d: f"{d['busy']:.6f}"
    )
    family(
        "fastjobs_heartbeat_age_seconds",
        "gauge",
        "seconds since the process last reported",
        lambda d: f"{now - d['heartbeat']:.3f}",
    )
    leaders = [(labels, d) for labels, d in live if d["role"] == LEADER and d["leading"]]
    lines.extend(_upkeep_metrics(leaders, now))
    live = [(labels, d) for labels, d in live if d["role"] == WORKER]
    family(
        "fastjobs_listener_up",
        "gauge",
        "1 while the worker's LISTEN connection is up",
        lambda d: str(int(d["listening"])),
    )
    family(
        "fastjobs_listener_ok_age_seconds",
        "gauge",
        "seconds since the listener's last working connect or ping",
        lambda d: f"{now - d['listener_ok']:.3f}",
    )
    family(
        "fastjobs_listener_reconnects_total",
        "counter",
        "listener connections lost and made again",
        lambda d: str(int(d["listener_reconnects"])),
    )
    if depths is not None:
        lines.append("# HELP fastjobs_queue_jobs jobs in the table by queue and state")
        lines.append("# TYPE fastjobs_queue_jobs gauge")
        for q in depths:
            lines.append(f'fastjobs_queue_jobs{{queue="{_escape(q.queue)}",state="{q.state}"}} {q.count}')
        lines.append("# HELP fastjobs_queue_oldest_seconds age of the oldest job by queue and state")
        lines.append("# TYPE fastjobs_queue_oldest_seconds gauge")
        for q in depths:
            if q.oldest_seconds is not None:
                labels = f'queue="{_escape(q.queue)}",state="{q.state}"'
                lines.append(f"fastjobs_queue_oldest_seconds{{{labels}}} {q.oldest_seconds:.3f}")
        paused = {q.name for q in steered if q.paused_at}
        lines.append("# HELP fastjobs_queue_paused 1 while the queue is paused (fastjobs queues pause)")
        lines.append("# TYPE fastjobs_queue_paused gauge")
        for name in sorted({q.queue for q in depths} | paused):
            lines.append(f'fastjobs_queue_paused{{queue="{_escape(name)}"}} {int(name in paused)}')
        lines.append(
            "# HELP fastjobs_queue_concurrency the most jobs of the queue running at once, cluster-wide"
        )
        lines.append("# TYPE fastjobs_queue_concurrency gauge")
        lines.extend(
            f'fastjobs_queue_concurrency{{queue="{_escape(q.name)}"}} {q.concurrency}'
            for q in steered
            if q.concurrency is not None
        )
        limited = [q for q in steered if q.max_backlog is not None]
        lines.append("# HELP fastjobs_queue_max_backlog the backlog past which enqueues are held back")
        lines.append("# TYPE fastjobs_queue_max_backlog gauge")
        lines.extend(
            f'fastjobs_queue_max_backlog{{queue="{_escape(q.name)}"}} {q.max_backlog}' for q in limited
        )
        lines.append("# HELP fastjobs_queue_held_back_total enqueues held back by the queue's max_backlog")
        lines.append("# TYPE fastjobs_queue_held_back_total counter")
        lines.extend(
            f'fastjobs_queue_held_back_total{{queue="{_escape(q.name)}"}} {q.held_back}'
            for q in steered
            if q.max_backlog is not None or q.held_back
        )
    lines.extend(kind_metrics(slots.kinds()))
    if health is not None:
        lines.extend(_health_metrics(health))
    if hosts is not None:
        lines.extend(cluster_metrics(hosts))
    return "\n".join(lines) + "\n"


def _upkeep_metrics(leaders: list[tuple[str, dict[str, float]]], now: float) -> list[str]:
    """The leading leader's maintenance health: the rotation's problem and age, failing services."""
    lines = [
        "# HELP fastjobs_rotation_problem 1 for why the leader's last rotation try did not rotate"
        " (privileges, deferred, gave way, failed); all 0 when it rotated",
        "# TYPE fastjobs_rotation_problem gauge",
    ]
    for labels, d in leaders:
        problem = int(d["rotation_problem"])
        lines.extend(
            f'fastjobs_rotation_problem{{{labels},reason="{name}"}} {int(code == problem)}'
            for code, (name, _) in ROTATION_PROBLEMS.items()
        )
    lines += [
        "# HELP fastjobs_rotation_age_seconds seconds since the leader last rotated (-1: not yet)",
        "# TYPE fastjobs_rotation_age_seconds gauge",
    ]
    lines.extend(
        f"fastjobs_rotation_age_seconds{{{labels}}} {now - d['rotated_at'] if d['rotated_at'] else -1.0:.3f}"
        for labels, d in leaders
    )
    lines += [
        "# HELP fastjobs_maintenance_services_failing leader services whose last turn raised",
        "# TYPE fastjobs_maintenance_services_failing gauge",
    ]
    lines.extend(
        f"fastjobs_maintenance_services_failing{{{labels}}} {int(d['services_failing'])}"
        for labels, d in leaders
    )
    lines += [
        "# HELP fastjobs_maintenance_failures_total leader service turns that raised",
        "# TYPE fastjobs_maintenance_failures_total counter",
    ]
    lines.extend(
        f"fastjobs_maintenance_failures_total{{{labels}}} {int(d['service_failures'])}"
        for labels, d in leaders
    )
    return lines


_LE = [*(repr(b) for b in BUCKETS), "+Inf"]


def kind_metrics(kinds: list[KindCounts]) -> list[str]:
    """The outcome counters and the two histograms per (queue, kind)."""
    lines = [
        "# HELP fastjobs_job_outcomes_total jobs finished by queue, kind and outcome",
        "# TYPE fastjobs_job_outcomes_total counter",
    ]
    labelled = [(f'queue="{_escape(k.queue)}",kind="{_escape(k.kind)}"', k) for k in kinds]
    for labels, k in labelled:
        lines.extend(
            f'fastjobs_job_outcomes_total{{{labels},outcome="{outcome}"}} {n}'
            for outcome, n in k.outcomes.items()
        )
    for name, help_text in (
        ("run", "time the handler took (jobs this worker ran itself, or timed by its executor)"),
        ("pickup", "from when a job was due to when its worker started its batch, by the worker's clock"),
    ):
        family = f"fastjobs_job_{name}_seconds"
        lines.append(f"# HELP {family} {help_text}")
        lines.append(f"# TYPE {family} histogram")
        for labels, k in labelled:
            h: Histogram = getattr(k, f"{name}_seconds")
            lines.extend(
                f'{family}_bucket{{{labels},le="{le}"}} {n}' for le, n in zip(_LE, h.buckets, strict=True)
            )
            lines.append(f"{family}_sum{{{labels}}} {h.sum!r}")
            lines.append(f"{family}_count{{{labels}}} {h.count}")
    return lines


def cluster_metrics(hosts: list[ClusterHost]) -> list[str]:
    """The cluster's hosts, from the workers' heartbeats in the database (the leader's master serves them)."""
    lines = []

    def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, object]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

    tagged = [(f'host="{_escape(h.host)}"', h) for h in hosts]
    family(
        "fastjobs_cluster_workers",
        "gauge",
        "workers registered by host",
        [(t, len(h.workers)) for t, h in tagged],
    )
    family(
        "fastjobs_cluster_workers_stale",
        "gauge",
        f"workers whose last heartbeat is older than {STALE_AFTER:g} s, by host",
        [(t, h.stale) for t, h in tagged],
    )
    family(
        "fastjobs_cluster_heartbeat_age_seconds",
        "gauge",
        "seconds since the freshest heartbeat of the host's workers",
        [(t, f"{h.heartbeat_age:.3f}") for t, h in tagged],
    )
    family(
        "fastjobs_cluster_jobs_per_second",
        "gauge",
        "jobs finished per second by the host's live workers (between their last two heartbeats)",
        [(t, f"{h.rate:.3f}") for t, h in tagged],
    )
    for name in ("completed", "failed", "retried", "discarded"):
        family(
            f"fastjobs_cluster_jobs_{name}_total",
            "counter",
            f"jobs {name} by the host's registered workers (as of their last heartbeats)",
            [(t, h.totals[name]) for t, h in tagged],
        )
    family(
        "fastjobs_cluster_job_outcomes_total",
        "counter",
        "jobs finished by host, queue, kind and outcome (as of the workers' last heartbeats)",
        [
            (f'{t},queue="{_escape(k["queue"])}",kind="{_escape(k["kind"])}",outcome="{outcome}"', k[outcome])
            for t, h in tagged
            for k in h.kinds
            for outcome in OUTCOMES
        ],
    )
    return lines


def _health_metrics(health: Health) -> list[str]:
    lines = []

    def gauge(name: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(
            f"{name}{{{labels}}} {float(value)!r}" if labels else f"{name} {float(value)!r}"
            for labels, value in samples
        )

    h = health.horizon
    gauge(
        "fastjobs_mvcc_horizon_age_seconds",
        "how long the oldest open snapshot of this database has held back cleanup (0: none)",
        [("", h.seconds or 0.0 if h is not None else 0.0)],
    )
    gauge(
        "fastjobs_mvcc_horizon_xid_age",
        "transactions since the oldest open snapshot (0: none)",
        [("", float(h.xid_age or 0) if h is not None else 0.0)],
    )
    gauge(
        "fastjobs_notify_queue_usage_ratio",
        "fraction of the NOTIFY queue in use",
        [("", health.notify_queue)],
    )
    tables = [(f'table="{t.table}"', t) for t in health.tables]
    gauge("fastjobs_table_live_rows", "live rows (statistics estimate)", [(k, t.live) for k, t in tables])
    gauge(
        "fastjobs_table_dead_rows", "dead rows not yet vacuumed (estimate)", [(k, t.dead) for k, t in tables]
    )
    gauge(
        "fastjobs_table_bytes",
        "size of the table and of its indexes",
        [(f'{k},part="table"', t.table_bytes) for k, t in tables]
        + [(f'{k},part="indexes"', t.index_bytes) for k, t in tables],
    )
    gauge(
        "fastjobs_table_last_autovacuum_timestamp_seconds",
        "when autovacuum last finished on the table (0: never)",
        [(k, t.last_autovacuum or 0.0) for k, t in tables],
    )
    gauge(
        "fastjobs_table_last_vacuum_timestamp_seconds",
        "when a VACUUM other than autovacuum (the leader's, say) last finished on the table (0: never)",
        [(k, t.last_vacuum or 0.0) for k, t in tables],
    )
    gauge(
        "fastjobs_table_autovacuums", "autovacuum runs on the table", [(k, t.autovacuums) for k, t in tables]
    )
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
