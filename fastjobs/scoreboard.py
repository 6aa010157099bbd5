"""The stats file: one card (fastjobs.stats) per process in shared memory, and the names of their rows.

The master maps one file in /dev/shm before forking: a header, the cards,
then the names of the cards' (queue, kind) rows (JSON). `fastjobs stats` on
the same host finds the files of the live masters of its database and reads
them.

The file is `fastjobs-<pid>-<random token>.stats`, created exclusively (never
another master's file or a planted link, even from another PID namespace
sharing /dev/shm) and owner-only. Its master holds an flock on it for its
whole life: a file nobody holds is stale (its master was killed), whatever
process has its pid now. Stale files are removed by `fastjobs stats` and by
the next master of the same user; a master removes its own on every exit
it lives through.
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg

from . import database, sql
from .abc import (
    BUCKETS,
    MAX_KINDS,
    OUTCOMES,
    PICKUP_SUM,
    ROW,
    RUN_SUM,
)
from .errors import FastjobsError
from .stats import CARD_FLOATS, FIELDS, SLOW_CAPACITY_MAX, WORKER, Card, card_size

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_CARDS",
    "MAX_FILE",
    "MAX_LABELS",
    "MAX_ROWS",
    "OTHER",
    "VERSION",
    "Histogram",
    "KindCounts",
    "Labels",
    "MasterFile",
    "Scoreboard",
    "Skipped",
    "database_identity",
    "find",
    "kind_counts",
    "live_masters",
    "read_master",
    "shm_dir",
    "sweep_stale",
]

MAGIC = 0x66_6A_73_74  # "fjst"
VERSION = 7
# magic, version, cards, master pid, started, slow-job capacity per card, rows of
# (queue, kind) counts per card, token, database identity (sql.database_identity)
HEADER = struct.Struct("<IIIIdII16s128s")
_LABELS = struct.Struct("<I")  # after the cards: the length of the labels' JSON
MAX_CARDS = 4096  # a bigger file is not one of ours
MAX_ROWS = 65_536
MAX_LABELS = 16 << 20


def shm_dir() -> Path:
    """Where the stats files live: $FASTJOBS_STATS_DIR, else /dev/shm, else the temporary directory.

    A directory of one's own keeps a master and its `fastjobs stats` apart from the host's others
    (a container's sidecar sharing a volume; a test beside others).
    """
    if chosen := os.environ.get("FASTJOBS_STATS_DIR"):
        return Path(chosen)
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
    """The names of a card's (queue, kind) rows: the kinds every worker of the master knows (in
    `App.runnable()` order), and each card's queues (in the order its worker serves them; none for
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
        """(row offset in int64 cells, queue, kind) of card `index`'s rows."""
        kinds = [*self.kinds[:MAX_KINDS], OTHER]
        queues = self.queues[index] if index < len(self.queues) else []
        for q, queue in enumerate(queues):
            for k, kind in enumerate(kinds):
                yield (q * self.stride + k) * ROW, queue, kind


# The kind label of jobs of kinds beyond MAX_KINDS or with no handler.
OTHER = "(other)"


class Scoreboard:
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
        self._card_size = card_size(capacity, self.rows)
        self._values: Any = memoryview(mapping)

    @classmethod
    def create(
        cls, count: int, identity: str = "", capacity: int = 0, labels: Labels | None = None
    ) -> Scoreboard:
        """A new file of `count` cards for this process (the master), locked while it lives.

        Each card records up to `capacity` slow jobs running (a worker's concurrency, capped),
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
        end = HEADER.size + count * card_size(capacity, labels.rows)
        size = end + _LABELS.size + len(names)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            raise FastjobsError(
                f"cannot create the stats file in {path.parent} ({exc.strerror}): "
                "FASTJOBS_STATS_DIR must name a directory this user may write"
            ) from None
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
    def open(cls, path: Path) -> Scoreboard | None:
        """Map a live master's file read-only (a benchmark reads its own master's); None if it is not one."""
        found = read_master(path)
        if not isinstance(found, MasterFile):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = HEADER.size + found.cards * card_size(found.capacity, found.labels.rows)
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return cls(path, mapping, found.cards, found.capacity, labels=found.labels)

    def __getitem__(self, index: int) -> Card:
        base = HEADER.size + index * self._card_size
        floats = base + CARD_FLOATS * 8
        counts = base + self._card_size - self.rows * ROW * 8
        return Card(
            self._values[base:floats].cast("d"),
            self._values[floats:counts].cast("q"),
            self._values[counts : base + self._card_size].cast("q"),
        )

    def kinds(self) -> list[KindCounts]:
        """The workers' counts per (queue, kind), summed over the cards (rows never used left out)."""
        return kind_counts(self.labels, ((i, self[i].counts) for i in range(self.count)))

    def __iter__(self) -> Iterator[Card]:
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
    cards: int
    capacity: int  # slow jobs each card records
    processes: list[dict[str, float]]  # the cards in use
    labels: Labels = field(default_factory=Labels)
    kinds: list[KindCounts] = field(default_factory=list)  # summed over its workers


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file that looked like a stats file and is not one a live master of ours holds."""

    path: Path
    reason: str
    stale: bool = False  # a valid file its master no longer holds
    ours: bool = False  # owned by this user


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


def kind_counts(labels: Labels, cards: Iterable[tuple[int, Sequence[int] | None]]) -> list[KindCounts]:
    """Sum the rows of the (card index, its int64 cells) given by (queue, kind); the rows never used
    are left out."""
    totals: dict[tuple[str, str], list[int]] = {}
    for index, cells in cards:
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
        end = HEADER.size + count * card_size(capacity, rows)
        if count > MAX_CARDS or capacity > SLOW_CAPACITY_MAX or rows > MAX_ROWS or len(data) < end + 4:
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
            return Skipped(path, "its names of kinds and queues do not match its cards", ours=ours)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # its master holds it: live
        else:
            return Skipped(path, "its master is gone", stale=True, ours=ours)
    finally:
        os.close(fd)
    step = card_size(capacity, rows)
    processes = [
        dict(zip(FIELDS, struct.unpack_from(f"<{CARD_FLOATS}d", data, HEADER.size + i * step), strict=True))
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


def live_masters(
    identity: str | None = None, remove_stale: bool = True
) -> tuple[list[MasterFile], list[Skipped]]:
    """The live masters on this host (of the database `identity` only, when given), and the files skipped.

    A stale file of this user is removed on the way (its Skipped says so), unless not `remove_stale`
    (the dashboard, which reads every few seconds and reports no skipped file, leaves that to
    `fastjobs stats`).
    """
    found, skipped = [], []
    for path in _stats_files():
        item = read_master(path)
        if item is None:
            continue
        if isinstance(item, Skipped):
            if item.stale and item.ours and remove_stale:
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
