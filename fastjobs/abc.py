"""The hot path's contract: what `_core` (C) and `_core_py` (Python) both provide, and the figures both use.

As psycopg's `pq/abc.py`: the implementations are checked against these
Protocols by mypy where `fastjobs.impl` chooses one (`_core.pyi` stands for
the C module there), and tests/test_twins.py runs both on the same batches.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

__all__ = [
    "BATCH_SECONDS",
    "BUCKETS",
    "BUCKETS_NS",
    "CANCELLED",
    "CLAIMED_COLUMNS",
    "COL_ARGS",
    "COL_ATTEMPT",
    "COL_CREATED_AT",
    "COL_ID",
    "COL_KEEP_RESULT",
    "COL_KIND",
    "COL_MAX_ATTEMPTS",
    "COL_META",
    "COL_PRIORITY",
    "COL_RUN_AT",
    "COMPLETED",
    "CONTEXT_COLUMNS",
    "DEEP_CLAIM",
    "DISCARDED",
    "FAST_LANE_DEMOTE",
    "FRONT_CLAIM_DUTY",
    "FRONT_CLAIM_MAX_WAIT",
    "GUARD_IDLE",
    "GUARD_TICK",
    "HAND_BACK_AFTER",
    "INT64_MAX",
    "KEEPING_CLAIMS",
    "MARK_RUN_AT_MAX",
    "MARK_RUN_AT_MIN",
    "MAX_KINDS",
    "OBSERVED_MAX_NS",
    "OUTCOMES",
    "PG_EPOCH",
    "PG_EPOCH_US",
    "PICKUP",
    "PICKUP_SUM",
    "RETRIED",
    "ROW",
    "RUN",
    "RUN_SUM",
    "SIZE_DECAY",
    "SLOT_FRESH",
    "SNOOZED",
    "BatchLoop",
    "Core",
    "NewBatchLoop",
]

if TYPE_CHECKING:
    import psycopg

    from .executor import Executor
    from .planner import Planner
    from .types import JobSpec

# What one batch should take at most, judged by the last batch's pace.
BATCH_SECONDS = 0.1
# No job waits on another's run time, and no transaction outlives its batch
# (fastjobs.guard watches every loop this often). A state-lane job that has
# run HAND_BACK_AFTER seconds hands back the jobs claimed behind it (the rest
# of its batch, the batch claimed ahead) untouched and uncounted, so a free
# worker runs them; a second, ten times a batch's planned time: a batch is
# sized to run in BATCH_SECONDS, so a job this slow is not the kind's usual.
# A fast-lane handler still running at its batch's deadline (BATCH_SECONDS
# after the batch began) leaves the batch's transaction: its job becomes a
# running state-lane job (sql.job_hand_over), the jobs run so far commit and
# the rest are free, so its transaction lives about a batch whatever the
# handler does.
HAND_BACK_AFTER = 1.0
# The guard sleeps to the earliest moment a loop's handler may outrun its bound (BatchLoop.due),
# and at most GUARD_IDLE: a state-lane handler is seen well inside HAND_BACK_AFTER, and a fast
# batch's start wakes it (guard.alert). It ticked every 20 ms before: 50 wake-ups a second, each
# taking the GIL from the loop's thread (bench/RESULTS.md, issue 22 §5, tenth sitting). GUARD_TICK:
# how late past a deadline the guard may act (its thread's scheduling).
GUARD_IDLE = 0.25
GUARD_TICK = 0.02
# The next claim's size is twice what the last one found, but at most this
# factor below the last claim's size: a burst arriving between empty claims
# (a producer's COPY of hundreds of jobs every 10 ms) is claimed in one or
# two round trips, not in a doubling from batch_min (see _core_py.BatchLoop).
SIZE_DECAY = 2
# A claim that comes back full shows a backlog, and sends its queue to the
# fast lane, only when it asked for this many jobs or more (batch_max when
# smaller): at a shallow queue the size decays to batch_min, and a claim of
# 1 that finds 1 is full with nothing behind it. Without this floor, 40% of
# the jobs at 1,000 jobs/s went by the fast lane's three round trips a claim.
DEEP_CLAIM = 16

# How long a queue whose fast-lane batch ran past BATCH_SECONDS (or met a job
# that may not hold its transaction: async, timeout=, threads) takes the
# state lane before it tries the fast lane again (see sql.job_lock_many).
FAST_LANE_DEMOTE = 60.0

# How many claims after one that held a job with keep_result a loop still
# writes outcomes with the _results finish statements (sql.FINISH_RESULTS,
# sql.job_finish_locked_many_results), whose kept CTE costs a statement some
# 0.2 ms more: a batch's outcomes are sent at most two claims after its own
# (behind the claim sent ahead, or a fast batch's first writing those the
# state lane still holds), so three leaves none unkept, and a loop that
# claims no job with keep_result never sends them.
KEEPING_CLAIMS = 3

# A claim scans the claim index from its front only as often as costs 2% of
# the loop's time (it wades through the dead entries of every job claimed
# since the last VACUUM, or since its rotating slot was emptied); in between
# it starts where the last claim ended (sql.job_finish_claim_after,
# job_lock_after). Its cost is the time the loop spent sending it and waiting
# for its result: a claim sent ahead (overlap) is in flight while the
# handlers run, and counting that time made the next claim from the front
# due ~49 batches later on a clean index. At most this long between two.
# 2%, not 10%: a fast-lane claim from the front walking its slots' dead
# entries stalls its worker and set the pickup p99 (bench/RESULTS.md, issue
# 13 session 4). The cap holds that ration at the rotation's interval
# (tests/test_upkeep.py pins the two).
FRONT_CLAIM_DUTY = 0.02
FRONT_CLAIM_MAX_WAIT = 10.0
# How long (seconds) a loop goes by the rotating slot its last claim after the mark saw current
# (fastjobs.planner.Planner.slots): less than three rotation intervals (RotationConfig.interval, 2 s;
# 0.1 s in the tests that rotate fastest), so that four rotations, back to the same slot, cannot
# pass between two of its claims unseen (tests/test_upkeep.py pins it).
SLOT_FRESH = 0.25
# A mark is kept only for a run_at a second or more inside timestamptz's range
# (microseconds since 2000): the claim after it subtracts its margin, and
# -infinity or 4713 BC would overflow.
MARK_RUN_AT_MIN = -211_813_488_000_000_000 + 1_000_000
MARK_RUN_AT_MAX = 9_223_371_331_200_000_000 - 1_000_000

# A claimed row's columns, in the order the claim and finish statements return them (sql._returned)
# and the hot loops read them at these offsets; META and CREATED_AT only with context (a whole
# JobContext). A stale outcome's row after the claimed ones has a NULL kind and its state in args.
CLAIMED_COLUMNS = ("id", "kind", "args", "attempt", "max_attempts", "priority", "run_at", "keep_result")
CONTEXT_COLUMNS = ("meta", "created_at")
(
    COL_ID, COL_KIND, COL_ARGS, COL_ATTEMPT, COL_MAX_ATTEMPTS, COL_PRIORITY, COL_RUN_AT, COL_KEEP_RESULT,
    COL_META, COL_CREATED_AT,
) = range(len(CLAIMED_COLUMNS + CONTEXT_COLUMNS))  # fmt: skip

# A worker's counts per (queue, kind), in its stats card: one row of int64
# cells per queue it serves times (its kinds + one for every other kind),
# written by the hot loop with plain stores (see stats.KindTable). A row: the
# outcome counters, then two histograms of nanoseconds, each a sum and
# len(BUCKETS) + 1 bucket counts (not cumulative; the last one is +Inf).
OUTCOMES = ("completed", "retried", "discarded", "cancelled", "snoozed")
COMPLETED, RETRIED, DISCARDED, CANCELLED, SNOOZED = range(len(OUTCOMES))
# Upper bounds, in seconds, of both histograms' buckets: run time (the
# handler's call) and pickup latency (from due to its batch's start, by the worker's clock
# against the row's run_at).
BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
)  # fmt: skip
BUCKETS_NS = tuple(round(b * 1e9) for b in BUCKETS)
# The most one observation adds to a histogram's sum (a day, in ns), and the
# most a sum holds: a run_at centuries back (year 1 is accepted) must neither
# overflow an int64 cell nor, summed over a worker's life, wrap it.
OBSERVED_MAX_NS = 86_400 * 10**9
INT64_MAX = 2**63 - 1
RUN_SUM = len(OUTCOMES)
RUN = RUN_SUM + 1
PICKUP_SUM = RUN + len(BUCKETS) + 1
PICKUP = PICKUP_SUM + 1
ROW = PICKUP + len(BUCKETS) + 1
# The row of kinds beyond MAX_KINDS, and of kinds with no handler, is the last of each queue's.
MAX_KINDS = 255
# PostgreSQL's epoch: timestamps travel in binary as microseconds since it (run_at, COPY's rows).
PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
PG_EPOCH_US = int(PG_EPOCH.timestamp()) * 1_000_000  # from the Unix epoch


class BatchLoop(Protocol):
    """One worker's hot loop: claims, runs and completes batches on one connection.

    A statement or connection failure raises errors.LoopError. The counters
    count outcomes as they are sent (a stale one is taken back when PostgreSQL
    drops it); the worker copies them into its stats card after each batch.
    """

    claimed: int
    completed: int
    failed: int
    retried: int
    discarded: int
    stale: int  # outcomes dropped because their job no longer ran that attempt here
    fast: int  # outcomes written on the fast lane (sql.job_lock_many: one write per job)
    batch_min: int  # the planner's (fastjobs.planner), set by the worker's careful mode
    batch_max: int
    overlap: bool  # send the next claim before the handlers run (from a deep queue)
    stopping: bool  # set from a signal handler: claim no more, give back what was not started

    @property
    def planner(self) -> Planner:
        """The per-batch decisions (fastjobs.planner); the worker's heartbeat sets its `limited`."""

    @property
    def size(self) -> int:
        """The next claim's size, between batch_min and batch_max (the planner's)."""

    @property
    def recheck(self) -> float:
        """After an empty step: seconds until a claim from the front is due (inf: none)."""

    def prepare(self, plan_ahead: bool = False) -> None:
        """Prepare the loop's statements on its connection; with `plan_ahead`, plan them too
        (sql.plan_ahead: on sql.worker_session's generic plans, before the first job)."""

    def step(self) -> int:
        """Run one batch; 0 when there was nothing to claim (outcomes are flushed then)."""

    def finish(self) -> None:
        """Give back the batch claimed ahead and write every outcome still held."""

    def due(self) -> float:
        """When (time.monotonic()) a handler running may outrun its bound, for the guard: the fast
        batch's deadline, or HAND_BACK_AFTER after the state-lane job's start; 0.0: none runs."""

    def hand_back(self) -> bool:
        """From the guard's thread: when a handler outran its bound, hand back what its batch holds.

        Acts only while the loop's thread is inside a handler; True when it did.
        """


class NewBatchLoop(Protocol):
    """The BatchLoop class of an implementation: its constructor."""

    def __call__(
        self,
        conn: psycopg.Connection[Any],
        specs: dict[str, JobSpec],
        executor: Executor,
        worker_id: str,
        queues: list[str],
        *,
        keep_completed: bool = ...,
        batch_min: int = ...,
        batch_max: int = ...,
        overlap: bool = ...,
        progress: memoryview | None = ...,  # the card's float64 [0]: counts the jobs started
        front_claim_duty: float = ...,
        running: memoryview | None = ...,  # the card's int64 [0:3]: the job running, the outcomes written
        counts: memoryview | None = ...,  # the card's int64 rows per (queue, kind): see ROW
        whole_context: bool = ...,  # claim meta and created_at, fill each JobContext whole (middleware)
        fast_lane: bool = ...,  # short sync jobs take the fast lane (sql.job_lock_many)
        sql: ModuleType = ...,  # the statements of the app's schema (fastjobs.sql.of)
    ) -> BatchLoop: ...


class Core(Protocol):
    """An implementation of the hot path: the module `_core` or `_core_py`."""

    @property
    def IMPLEMENTATION(self) -> str: ...

    @property
    def BatchLoop(self) -> NewBatchLoop: ...

    def dump_args(
        self, kind: str, args: Any, params: frozenset[str] | None, required: frozenset[str]
    ) -> bytes:
        """Check one job's arguments against its handler and serialise them with orjson."""

    def encode_copy_rows(
        self,
        kind: str,
        rows: Iterator[Any],
        prefix: bytes,
        suffix: bytes,
        limit: int,
        params: frozenset[str] | None,
        required: frozenset[str],
    ) -> tuple[bytes, int]:
        """Encode up to `limit` rows of binary COPY data: prefix, the args as jsonb, suffix."""
