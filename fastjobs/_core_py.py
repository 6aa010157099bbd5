"""The hot path in plain Python: the readable reference `_core.pyx` matches name for name."""

from __future__ import annotations

import contextlib
import select
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import orjson
import psycopg
from psycopg import pq

from . import guard, handlers, sql, stats
from .abc import (
    BATCH_SECONDS,
    COMPLETED,
    DEEP_CLAIM,
    FAST_LANE_DEMOTE,
    FULL_CLAIM_DUTY,
    FULL_CLAIM_MAX_WAIT,
    HAND_BACK_AFTER,
    KEEPING_CLAIMS,
    MARK_RUN_AT_MAX,
    MARK_RUN_AT_MIN,
    PG_EPOCH_US,
    PICKUP_SUM,
    ROW,
    RUN_SUM,
    SIZE_DECAY,
)
from .args import dump_args as dump_args
from .errors import LoopError
from .handlers import Executor
from .stats import RUNNING_JOB, RUNNING_SUSPECT, RUNNING_WRITING
from .types import JobSpec, Outcome

IMPLEMENTATION = "python"

_JSONB_VERSION = b"\x01"

# A claimed job: id, kind, args (binary jsonb), attempt, max_attempts, run_at
# (binary timestamptz: microseconds since 2000), with full context its meta
# (binary jsonb, or None), created_at and run_at, and whether it keeps its
# result (keep_result is set: its value goes with its outcome).
Row = tuple[int, str, bytes, int, int, int, "tuple[bytes | None, int, int] | None", bool]


def encode_copy_rows(
    kind: str,
    rows: Iterator[Any],
    prefix: bytes,
    suffix: bytes,
    limit: int,
    params: frozenset[str] | None,
    required: frozenset[str],
) -> tuple[bytes, int]:
    """Encode up to `limit` rows of binary COPY data: prefix, the args as jsonb, suffix.

    Every column but args is the same for the whole call, so the caller
    encodes it once into prefix and suffix. Returns the data and the row count
    (0 when `rows` is exhausted).
    """
    parts: list[bytes] = []
    count = 0
    for args in rows:
        data = dump_args(kind, args, params, required)
        parts.append(prefix)
        parts.append((len(data) + 1).to_bytes(4, "big"))
        parts.append(_JSONB_VERSION)
        parts.append(data)
        parts.append(suffix)
        count += 1
        if count == limit:
            break
    return b"".join(parts), count


def _int(value: bytes) -> int:
    return int.from_bytes(value, "big", signed=True)


# The signals whose Python handlers wait while the fast lane's transaction
# begins or ends (all but the faults a process must not outlive): a stop-now
# raised while its statement was in flight left the reply unread, finish()
# took it for a claim, and the batch rolled back to run again. `_core` skips
# running the handlers in its waits instead; either way they run once the
# transaction's end is read.
_DEFERRED = signal.valid_signals() - {
    signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT,
}  # fmt: skip


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _wait(pgconn: Any, write: bool = False) -> None:
    fd = pgconn.socket
    if write:
        select.select([fd], [fd], [])
    else:
        select.select([fd], [], [])


class BatchLoop:
    """Claims, runs and completes batches on one connection, one statement per batch.

    With `overlap`, the statement that completes batch k-1 and claims batch
    k+1 is sent before batch k's handlers run, so PostgreSQL works while
    Python does: on two cores a strictly sequential loop leaves each side
    idle half the time. The price is one batch claimed ahead, given back
    (uncounted) by `finish`.

    The batch size adapts: twice what the last claim found, between
    `batch_min` and `batch_max`, so a shallow queue is claimed a few jobs at
    a time (latency) and a deep one in large batches (throughput); and no
    more than the last batch's pace runs in BATCH_SECONDS, so a deep queue
    of slow jobs is shared among workers instead of hoarded by one. A short
    or empty claim halves the size at most (SIZE_DECAY): a producer that
    commits hundreds of jobs at once, between claims that found none, had
    each of its batches claimed 1, 2, 4, ... jobs at a time, a round trip
    per doubling, and after a stall the backlog was climbed the same way.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        specs: dict[str, JobSpec],
        executor: Executor,
        worker_id: str,
        queues: list[str],
        keep_completed: bool = False,
        batch_min: int = 1,
        batch_max: int = 1000,
        overlap: bool = True,
        progress: memoryview | None = None,
        full_claim_duty: float = FULL_CLAIM_DUTY,
        running: memoryview | None = None,
        counts: memoryview | None = None,
        full_context: bool = False,
        fast_lane: bool = False,
        sql: ModuleType = sql,
    ) -> None:
        self._pgconn = conn.pgconn
        # Shared memory written per job started (plain stores): a float
        # count, so the master can tell a long batch from a hung one, and
        # the job's id (int64 `running[RUNNING_JOB]`), so it knows which job
        # a dead worker was running. Per statement (_writing, _written): how
        # many failed jobs' outcomes it carries, and the job when there is
        # one, so a worker that dies writing an outcome implicates that job alone.
        if (progress is None) != (running is None):
            raise ValueError("progress and running are the one slot's: pass both or neither")
        self._progress: Any = progress
        self._running: Any = running
        # Counts per (queue, kind) (fastjobs.abc.ROW), plain stores per job:
        # its outcome, its handler's run time, its pickup latency. A queue's
        # rows start at its index times _stride; _batch_base is the batch's.
        self._counts: Any = counts
        self._kind_rows, self._other = stats.kind_rows(specs)
        self._stride = self._other + ROW
        self._batch_base = 0
        if counts is not None and len(counts) < len(queues) * self._stride:
            raise ValueError(
                f"the counts view holds {len(counts)} cells; these queues and kinds"
                f" need {len(queues) * self._stride}"
            )
        # Once a statement failed, its record stays: the worker dies of it,
        # though `finish` may still write other outcomes first.
        self._write_failed = False
        self._specs = specs
        self._executor = executor
        self._worker_id = worker_id.encode()
        self._queues = [q.encode() for q in queues]
        self._turn = 0
        # With `full_context` (the app has middleware) the claim returns each
        # job's meta and created_at too, and each job's JobContext is filled
        # whole; without, neither costs a job anything.
        self._full_context = full_context
        finish = sql.FINISH_CONTEXT if full_context else sql.FINISH
        kept = sql.FINISH_CONTEXT_RESULTS if full_context else sql.FINISH_RESULTS
        pairs = [table[keep_completed, after] for table in (finish, kept) for after in (False, True)]
        self._statements = {name: (name.encode(), text) for name, text in pairs}
        self._full_name, self._after_name, self._full_kept, self._after_kept = (
            name.encode() for name, _ in pairs
        )
        # How many claims more outcomes go by the _results statements (KEEPING_CLAIMS).
        self._keeping = 0
        # The fast lane (sql.job_lock_many): a queue takes it when every kind
        # registered on it is sync without a timeout and its sync jobs do not
        # run on threads; kept completed rows stay on the state lane. A batch
        # that runs long or finds a job that may not run on it (async, timeout,
        # pooled) moves its queue to the state lane for FAST_LANE_DEMOTE seconds.
        self._fast_queues = [
            fast_lane
            and not keep_completed
            and all(
                not spec.is_async and spec.timeout is None for spec in specs.values() if spec.queue == queue
            )
            for queue in queues
        ]
        # The fast lane's claims, from the front and after the mark (as the state lane's).
        locks = [sql.LOCK[full_context, after] for after in (False, True)]
        self._lock_names = tuple(name.encode() for name, _ in locks)
        if any(self._fast_queues):
            for name, text in locks:
                self._statements[name] = (name.encode(), text)
            for name in (
                "job_finish_locked_many",
                "job_finish_locked_many_results",
                "job_hand_over",
                "queue_wake",
            ):
                self._statements[name] = (name.encode(), sql.STATEMENTS[name])
        self._state_until = [0.0] * len(queues)
        # A queue takes the fast lane only once a batch of it on the state lane
        # ran in under half BATCH_SECONDS: a long sync job that polls
        # current_job().cancelled must not hold a lock its cancel waits for.
        self._proven = [False] * len(queues)
        # A fast claim that comes back empty (three round trips, where the
        # state lane's takes one) sends the queue to the state lane until a
        # claim of it comes back full (DEEP_CLAIM): the lane saves a write per job at two
        # more round trips a batch, a gain on a backlog, and on a queue the
        # workers keep up with a loss in pickup latency.
        self._deep = [True] * len(queues)
        self._tx = False  # a fast-lane batch's transaction is open
        self._deadline = 0.0  # when the fast batch running stops starting jobs
        self.fast = 0  # outcomes written on the fast lane
        # What the guard (fastjobs.guard) reads while a handler runs on this
        # loop's thread: since when (time.monotonic(); 0 while no handler
        # runs), the batch's rows and the index of the job running (-1: the
        # executor runs the batch's slow jobs), the slow jobs set aside; and
        # what it did: handed the batch back, or failed to (raised here).
        # _guard_lock orders the two threads: the guard holds it while it
        # acts, this thread takes it to leave a handler.
        self._guard_lock = threading.Lock()
        self._job_began = 0.0
        self._batch: list[Row] = []
        self._at = -1
        self._slow: list[handlers.SlowJob] = []
        self._handed = False
        self._guard_error: LoopError | None = None
        # Per queue: where its last claim ended (priority, run_at as binary
        # timestamptz), and when a claim from the front is due again.
        self._marks: list[tuple[int, int] | None] = [None] * len(queues)
        self._next_full = [0.0] * len(queues)
        self._duty = full_claim_duty
        self._sent: tuple[int, bool, float] = (0, True, 0.0)  # queue index, from the front, when
        self.recheck = float("inf")  # seconds until an idle loop should claim from the front
        self.batch_min = batch_min
        self.batch_max = batch_max
        # Per queue, as its marks: a claim's size and the pace cap of its last
        # batch. One size for all made an empty queue's claim halve the size
        # of a busy one's, which was then claimed 1-2 jobs at a time.
        self._sizes = [batch_min] * len(queues)
        self._caps = [batch_max] * len(queues)
        self.size = batch_min  # the size the last claim chose for its queue
        self.overlap = overlap
        self.stopping = False
        self._pooled = False  # this batch's sync jobs run on the executor's pool
        self.claimed = 0
        self.completed = 0
        self.failed = 0
        self.retried = 0
        self.discarded = 0
        self._in_flight = False
        self._limit = 0
        self._full = False
        self.stale = 0  # outcomes dropped because their job no longer ran that attempt here
        self._rows: list[Row] = []
        # Jobs completed at their first attempt (by id), and every other outcome.
        self._done: list[int] = []
        self._failures: list[Outcome] = []
        # The outcomes of the statement in flight, isolated if PostgreSQL rejects it.
        self._sent_outcomes: tuple[list[int], list[Outcome]] = ([], [])

    def prepare(self) -> None:
        for name, text in self._statements.values():
            try:
                res = self._pgconn.prepare(name, text.encode())
            except psycopg.OperationalError:
                raise self._lost() from None
            if res.status != pq.ExecStatus.COMMAND_OK:
                raise LoopError(res.error_message.decode(errors="replace"))
        guard.watch(self)

    def _lost(self) -> LoopError:
        """The error of a failed libpq call: libpq's message, without psycopg's prefix (as in C)."""
        self._in_flight = False
        return LoopError(self._pgconn.error_message.decode(errors="replace"))

    def _send_prepared(self, name: bytes, params: list[bytes]) -> None:
        try:
            self._pgconn.send_query_prepared(name, params, result_format=1)
            while self._pgconn.flush():
                _wait(self._pgconn, write=True)
                self._pgconn.consume_input()
        except psycopg.OperationalError:
            raise self._lost() from None

    def _fast_for(self, index: int) -> bool:
        """Whether the next claim of queue `index` takes the fast lane."""
        if (
            not (self._fast_queues[index] and self._proven[index] and self._deep[index])
            or self._state_until[index] > time.monotonic()
        ):
            return False
        return not (self._executor.threads and self._executor.pooled(self._queues[index]))

    def _demote(self, index: int) -> None:
        """Send queue `index` to the state lane for a while; its next claim is from the front.

        The jobs its fast batch gave back (or rolled back) are behind the mark
        that batch set: a claim after it would leave them for the next claim
        from the front, seconds away when the index is full of dead entries.
        """
        self._state_until[index] = time.monotonic() + FAST_LANE_DEMOTE
        self._proven[index] = False
        self._marks[index] = None

    def _simple(self, text: str) -> None:
        """Run a statement without parameters or rows (the fast lane's BEGIN, COMMIT, ROLLBACK)."""
        try:
            self._pgconn.send_query(text.encode())
            while self._pgconn.flush():
                _wait(self._pgconn, write=True)
                self._pgconn.consume_input()
            error = None
            while True:
                self._pgconn.consume_input()
                while self._pgconn.is_busy():
                    _wait(self._pgconn)
                    self._pgconn.consume_input()
                res = self._pgconn.get_result()
                if res is None:
                    break
                if res.status != pq.ExecStatus.COMMAND_OK and error is None:
                    error = res.error_message.decode(errors="replace")
        except psycopg.OperationalError:
            raise self._lost() from None
        if error is not None:
            raise LoopError(error)

    def _lock(self, limit: int) -> list[Row]:
        """The fast lane's claim: BEGIN, lock up to `limit` jobs; the transaction stays open if any came."""
        if self._done or self._failures:
            # Outcomes of the state lane still held go first, by its own statement.
            turn = self._turn
            self._send(0)
            self._receive()
            self._turn = turn
        index = self._turn % len(self._queues)
        self._turn += 1
        now = time.monotonic()
        params = [self._queues[index], str(limit).encode()]
        mark = self._marks[index]
        full = mark is None or now >= self._next_full[index]
        if not full:
            assert mark is not None
            params += [str(mark[0]).encode(), str(mark[1]).encode()]
        self._sent = (index, full, now)
        with _quiet():
            self._simple(sql.fast_begin)
            self._send_prepared(self._lock_names[not full], params)
            res, error, _ = self._results()
            if error is not None:
                with contextlib.suppress(LoopError):
                    self._simple(sql.fast_rollback)
                raise LoopError(error)
            n = res.ntuples
            if not n:
                self._simple(sql.fast_commit)
            else:
                self._tx = True
        self._mark(res, n)
        rows = self._rows_of(res, n)
        self._note_keeping(rows)
        self._deep[index] = n > 0
        if not n:
            return rows
        self._limit = limit
        self._full = n >= limit
        self.claimed += n
        self._resize(index, n)
        return rows

    def _commit(self, wake: bool = False) -> None:
        """Write the fast batch's outcomes in its transaction and commit it (releases are left as they were).

        A statement PostgreSQL rejects rolls the batch back (its jobs run
        again: at least once) and moves the queue to the state lane, whose
        statement isolates a bad outcome. Jobs it leaves unstarted (released,
        or behind a handed-over job: `wake`) wake the queue's sleeping workers.
        The lists are emptied in place: the batch running holds them.
        """
        with _quiet():
            self._end(wake)

    def _end(self, wake: bool) -> None:
        done, failures = self._done[:], handlers.started(self._failures)
        wake = wake or len(failures) < len(self._failures)
        del self._done[:], self._failures[:]
        self._tx = False
        self._writing(failures)
        ids = ("{" + ",".join(map(str, done)) + "}").encode()
        name = b"job_finish_locked_many_results" if self._keeping else b"job_finish_locked_many"
        self._send_prepared(name, [ids, handlers.encode(failures), self._worker_id])
        _, error, _ = self._results()
        if error is None and wake:
            self._send_prepared(b"queue_wake", [self._queues[self._batch_base // self._stride]])
            _, error, _ = self._results()
        if error is not None:
            self._simple(sql.fast_rollback)
            self._demote(self._sent[0])
            handlers.say_rolled_back(len(done) + len(failures), error)
        else:
            self._simple(sql.fast_commit)
            self.completed += len(done)
            if failures:
                completed, failed, retried, discarded = handlers.tally(failures)
                self.completed += completed
                self.failed += failed
                self.retried += retried
                self.discarded += discarded
            self.fast += len(done) + len(failures)
        self._written()

    def _writing(self, failures: Sequence[Outcome]) -> None:
        """Note in the slot the failed jobs' outcomes the statement about to be sent carries."""
        if self._running is not None and not self._write_failed:
            self._running[RUNNING_WRITING] = len(failures)
            if failures:
                self._running[RUNNING_SUSPECT] = failures[0]["id"]

    def _written(self) -> None:
        if self._running is not None and not self._write_failed:
            self._running[RUNNING_WRITING] = 0

    def _send(self, limit: int) -> None:
        """Send the outcomes gathered so far and a claim of `limit` jobs."""
        done = ("{" + ",".join(map(str, self._done)) + "}").encode()
        self._writing(self._failures)
        failures = handlers.encode(self._failures)
        index = self._turn % len(self._queues)
        queue = self._queues[index]
        self._turn += 1
        self.completed += len(self._done)
        if self._failures:
            completed, failed, retried, discarded = handlers.tally(self._failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
        self._sent_outcomes = (self._done, self._failures)
        self._done = []
        self._failures = []
        params = [done, failures, queue, str(limit).encode(), self._worker_id]
        now = time.monotonic()
        mark = self._marks[index]
        full = limit == 0 or mark is None or now >= self._next_full[index]
        if not full:
            assert mark is not None
            params += [str(mark[0]).encode(), str(mark[1]).encode()]
        self._sent = (index, full, now)
        if self._keeping:
            self._send_prepared(self._full_kept if full else self._after_kept, params)
        else:
            self._send_prepared(self._full_name if full else self._after_name, params)
        self._in_flight = True
        self._limit = limit

    def _results(self) -> tuple[Any, str | None, bool]:
        """The in-flight statement's result: (rows, None, _) or (None, error, whether an outcome is why)."""
        pgconn = self._pgconn
        result = None
        error = None
        isolatable = False
        try:
            pgconn.consume_input()
            while True:
                while pgconn.is_busy():
                    _wait(pgconn)
                    pgconn.consume_input()
                res = pgconn.get_result()
                if res is None:
                    break
                if res.status == pq.ExecStatus.TUPLES_OK:
                    result = res
                elif error is None:
                    error = res.error_message.decode(errors="replace")
                    state = res.error_field(pq.DiagnosticField.SQLSTATE) or b""
                    isolatable = state[:2].decode() in handlers.OUTCOME_ERROR_CLASSES
        except psycopg.OperationalError:
            raise self._lost() from None
        self._in_flight = False
        if error is None and result is None:
            error = pgconn.error_message.decode(errors="replace")
        return (None if error is not None else result), error, isolatable

    def _claimed(self, res: Any) -> int:
        """How many rows of `res` are claimed jobs; the stale outcomes after them are counted and logged."""
        n = res.ntuples
        if n and res.get_value(n - 1, 1) is None:
            stale = []
            while n and res.get_value(n - 1, 1) is None:
                n -= 1
                state = orjson.loads(res.get_value(n, 2)[1:])
                stale.append((_int(res.get_value(n, 0)), _int(res.get_value(n, 3)), state))
                if state == "completed":
                    self.completed -= 1
            self.stale += len(stale)
            handlers.say_stale(stale[::-1])
        return int(n)

    def _write(self, done: list[int], failures: list[Outcome]) -> str | None:
        """Write outcomes alone, claiming nothing; the error if one of them is rejected."""
        ids = ("{" + ",".join(map(str, done)) + "}").encode()
        params = [ids, handlers.encode(failures), self._queues[0], b"0", self._worker_id]
        self._send_prepared(self._full_kept, params)  # a hand-back's, or isolation's: rare, never unkept
        res, error, isolatable = self._results()
        if error is None:
            self._claimed(res)
            return None
        if not isolatable:
            raise LoopError(error)
        return error

    def _receive(self) -> list[Row]:
        rows: list[Row] = []
        res, error, isolatable = self._results()
        if error is not None:
            done, failures = self._sent_outcomes
            self._sent_outcomes = ([], [])
            if not (isolatable and (done or failures)):
                self._write_failed = True
                raise LoopError(error)
            # One outcome made PostgreSQL reject the statement, claim and
            # all: write the outcomes apart, then carry on with nothing claimed.
            handlers.isolate(self._write, done, failures, error)
            res = None
        self._sent_outcomes = ([], [])
        self._written()
        n = self._claimed(res) if res is not None else 0
        rows = self._rows_of(res, n)
        self.claimed += n
        if self._limit > 0:
            self._mark(res, n)
            self._note_keeping(rows)
            if n >= self._limit >= min(DEEP_CLAIM, self.batch_max):
                self._deep[self._sent[0]] = True
            self._resize(self._sent[0], n)
        self._full = self._limit > 0 and n >= self._limit
        return rows

    def _resize(self, index: int, n: int) -> None:
        """The next claim of queue `index` asks twice what this one found, halving at most."""
        halved = self._sizes[index] // SIZE_DECAY
        size = min(self.batch_max, self._caps[index], max(self.batch_min, 2 * n, halved))
        self._sizes[index] = self.size = size

    def _next_size(self) -> int:
        """The size of the next claim, of the queue whose turn it is (batch_max may have shrunk)."""
        return min(self._sizes[self._turn % len(self._queues)], self.batch_max)

    def _rows_of(self, res: Any, n: int) -> list[Row]:
        rows: list[Row] = []
        for i in range(n):
            claimed = None
            if self._full_context:
                claimed = (res.get_value(i, 8), _int(res.get_value(i, 9)), _int(res.get_value(i, 6)))
            rows.append(
                (
                    _int(res.get_value(i, 0)),
                    res.get_value(i, 1).decode(),
                    res.get_value(i, 2),
                    _int(res.get_value(i, 3)),
                    _int(res.get_value(i, 4)),
                    _int(res.get_value(i, 6)),
                    claimed,
                    res.get_value(i, 7) is not None,
                )
            )
        return rows

    def _note_keeping(self, rows: list[Row]) -> None:
        """Count this claim in the window of KEEPING_CLAIMS: restarted when a job claimed keeps its result."""
        if any(row[7] for row in rows):
            self._keeping = KEEPING_CLAIMS
        elif self._keeping:
            self._keeping -= 1

    def _mark(self, res: Any, n: int) -> None:
        """Remember where this claim ended, and when to claim from the front of its queue.

        Where it ended: its lowest priority, and the latest run_at within it.
        """
        lowest, latest = 1 << 15, 0
        now = time.monotonic()
        index, from_front, sent = self._sent
        for i in range(n):
            priority, run_at = _int(res.get_value(i, 5)), _int(res.get_value(i, 6))
            if priority < lowest:
                lowest, latest = priority, run_at
            elif priority == lowest and run_at > latest:
                latest = run_at
        if n:
            self._marks[index] = (lowest, latest) if MARK_RUN_AT_MIN < latest < MARK_RUN_AT_MAX else None
        if from_front:
            wait = (now - sent) * (1.0 - self._duty) / self._duty
            self._next_full[index] = now + min(wait, FULL_CLAIM_MAX_WAIT)
        elif not n:
            # An empty claim after the mark may have missed a job behind
            # it: an idle loop claims from the front as soon as that is due
            # (step() resets this; the soonest over the queues tried wins).
            self.recheck = min(self.recheck, max(0.0, self._next_full[index] - now))

    def _claim(self) -> list[Row]:
        """Claim synchronously, trying each queue once before giving up.

        The claim shares its statement's snapshot with the outcomes it writes,
        so it cannot see a job those outcomes made available (Retry(0),
        Snooze(0)): when outcomes went along, one more claim looks again.
        """
        tries = len(self._queues) + (1 if self._failures else 0)
        for _ in range(tries):
            if self._fast_for(self._turn % len(self._queues)):
                rows = self._lock(self._next_size())
            else:
                self._send(self._next_size())
                rows = self._receive()
            if rows:
                return rows
        return []

    def step(self) -> int:
        """Run one batch; 0 when there was nothing to claim (outcomes are flushed then)."""
        self.recheck = float("inf")
        rows = self._rows or self._claim()
        self._rows = []
        if not rows:
            return 0
        queue = self._queues[self._sent[0]]
        self._executor.queue = queue  # the rows' queue, for the records of failures
        # Its sync jobs run on the executor's threads when it was given concurrency (checked per batch).
        self._pooled = bool(self._executor.threads) and self._executor.pooled(queue)
        self._batch_base = self._sent[0] * self._stride
        self._batch, self._handed = rows, False
        if self._tx:
            return self._fast(rows)
        # Claim ahead only from a deep queue (the last claim came back full):
        # on a shallow one it would mostly return nothing, one more round trip
        # per wake-up; nor when the next claim takes the fast lane.
        if (
            self.overlap
            and self._full
            and not self.stopping
            and not self._fast_for(self._turn % len(self._queues))
        ):
            self._send(self._next_size())
        began = time.perf_counter()
        self._run(rows)
        ran = time.perf_counter() - began
        if self._in_flight:
            # The claim sent ahead is rationed by its own time: the loop's wait
            # for it, not the handlers' time it spent in flight (see _receive).
            index, from_front, sent = self._sent
            self._sent = (index, from_front, sent + ran)
        # Slow jobs get small batches, so siblings share a deep queue of them;
        # but async jobs and pooled sync ones run a wave at a time and a wave
        # takes the time of one job, so they are never capped below the
        # concurrency they were given.
        cap = int(BATCH_SECONDS * len(rows) / max(ran, 1e-9))
        wave = self._executor.wave
        if ran < BATCH_SECONDS / 2 and not wave and not self._pooled:
            self._proven[self._batch_base // self._stride] = True
        if wave:
            # Whole waves, the nearest count: 19 jobs on 10 threads take as long as 20.
            cap = max(wave, (cap + wave // 2) // wave * wave)
            self._executor.wave = 0
        self._caps[self._batch_base // self._stride] = max(self.batch_min, cap)
        if self._in_flight:
            self._rows = self._receive()
        return len(rows)

    def _fast(self, rows: list[Row]) -> int:
        """Run a fast-lane batch in its transaction, then write its outcomes and commit.

        No claim is sent ahead: it would share the transaction, and the commit
        would unlock its rows. The batch stops starting jobs once it has run
        BATCH_SECONDS (the rest stay available, untouched), and is sized for
        half that, so no transaction stays open much longer than one job over it.
        """
        began = time.perf_counter()
        self._deadline = time.monotonic() + BATCH_SECONDS
        try:
            self._run(rows)
        finally:
            if self._tx:
                self._commit()
        ran = time.perf_counter() - began
        pace = int(BATCH_SECONDS / 2 * len(rows) / max(ran, 1e-9))
        self._caps[self._batch_base // self._stride] = max(self.batch_min, pace)
        return len(rows)

    def finish(self) -> None:
        """Give back the batch claimed ahead and write every outcome still held."""
        if self._tx:
            self._commit()
        if self._in_flight:
            self._rows = self._receive()
        self._failures.extend(handlers.release(row[0], row[3]) for row in self._rows)
        self._rows = []
        if self._done or self._failures:
            self._send(0)
            self._receive()

    def _tally(self, row: int, outcome: Outcome) -> Outcome:
        """Count `outcome` in the (queue, kind) row at `row` (-1: no counts kept)."""
        if row >= 0:
            column = stats.outcome_column(outcome)
            if column >= 0:
                self._counts[row + column] += 1
        return outcome

    def _run(self, rows: list[Row]) -> None:
        done = self._done
        failures = self._failures
        specs = self._specs
        executor = self._executor
        context = executor.context
        slow = self._slow = []
        counts = self._counts
        at = -1
        if counts is not None:
            base, kind_rows, other = self._batch_base, self._kind_rows, self._other
            claimed_us = time.time_ns() // 1000 - PG_EPOCH_US  # run_at's clock: microseconds since 2000
        queue = executor.queue.decode() if isinstance(executor.queue, bytes) else executor.queue
        fast = self._tx
        if executor.keeping:
            executor.keeping.clear()
        for index, (job_id, kind, raw, attempt, max_attempts, run_at, claimed_raw, keep) in enumerate(rows):
            if self.stopping:
                failures.extend(handlers.release(row[0], row[3]) for row in rows[index:])
                break
            if fast and time.monotonic() > self._deadline:
                # Jobs slower than the queue's pace: the rest go back and the
                # queue takes the state lane for a while.
                self._demote(self._sent[0])
                failures.extend(handlers.release(row[0], row[3]) for row in rows[index:])
                break
            if self._running is not None:
                self._progress[0] += 1
                self._running[RUNNING_JOB] = job_id
            if counts is not None:
                at = base + kind_rows.get(kind, other)
                stats.observe(counts, at + PICKUP_SUM, (claimed_us - run_at) * 1000)
            spec = specs.get(kind)
            if spec is None:
                failures.append(
                    self._tally(
                        at, handlers.unknown_kind(job_id, kind, attempt, max_attempts, specs.values())
                    )
                )
                continue
            try:
                args = orjson.loads(raw[1:])
            except orjson.JSONDecodeError as exc:
                failures.append(
                    self._tally(at, handlers.discard(job_id, attempt, f"args do not decode: {exc}"))
                )
                continue
            if type(args) is not dict:
                reason = f"args must be a JSON object, not {type(args).__name__}"
                failures.append(self._tally(at, handlers.discard(job_id, attempt, reason)))
                continue
            claimed = None
            if claimed_raw is not None:
                meta_raw, enqueued, scheduled = claimed_raw
                try:  # an undecodable meta (jsonb nests deeper than orjson reads) reads as {}
                    meta = orjson.loads(meta_raw[1:]) if meta_raw is not None else None
                except orjson.JSONDecodeError:
                    meta = None
                claimed = (meta if type(meta) is dict else {}, enqueued, scheduled)
            if spec.is_async or spec.timeout is not None or self._pooled:
                if fast:
                    # A kind registered on another queue: it may not hold the
                    # transaction open. It goes back, and the queue to the state lane.
                    self._demote(self._sent[0])
                    failures.append(handlers.release(job_id, attempt))
                    continue
                slow.append((spec, job_id, args, attempt, max_attempts, claimed))
                if keep:
                    executor.keeping.add(job_id)
                continue
            if executor.cancelled and job_id in executor.cancelled:
                executor.cancelled.discard(job_id)
                failures.append(self._tally(at, handlers.cancelled(job_id, attempt)))
                continue
            context.id, context.kind, context.attempt, context.cancelled = job_id, kind, attempt, False
            began = time.perf_counter_ns() if at >= 0 else 0
            if claimed is not None:
                context.fill(queue, args, max_attempts, claimed)
            self._at = index
            self._job_began = time.monotonic()
            try:
                result = spec.target(**args)
            except Exception as exc:
                self._returned()
                if at >= 0:
                    stats.observe(counts, at + RUN_SUM, time.perf_counter_ns() - began)
                failures.append(self._tally(at, executor.raised(spec, job_id, attempt, max_attempts, exc)))
                if self._handed:
                    break
                continue
            except BaseException as exc:
                # SystemExit, KeyboardInterrupt: record this job, give the rest
                # back, write it all, then let the exception stop the worker.
                self._returned()
                if at >= 0:
                    stats.observe(counts, at + RUN_SUM, time.perf_counter_ns() - began)
                failures.append(self._tally(at, executor.raised(spec, job_id, attempt, max_attempts, exc)))
                if not self._handed:
                    failures.extend(handlers.release(row[0], row[3]) for row in rows[index + 1 :])
                    failures.extend(handlers.release(job[1], job[3]) for job in slow)
                self.stopping = True
                self.finish()
                raise
            self._returned()
            if at >= 0:
                stats.observe(counts, at + RUN_SUM, time.perf_counter_ns() - began)
            outcome = executor.returned(spec, job_id, attempt, max_attempts, result)
            if outcome is None and keep:
                outcome = handlers.kept(spec, job_id, attempt, max_attempts, result)
            if outcome is not None:
                failures.append(self._tally(at, outcome))
            else:
                if at >= 0:
                    counts[at + COMPLETED] += 1
                if attempt == 1:
                    done.append(job_id)
                else:
                    failures.append(handlers.completed(job_id, attempt))
            if self._handed:
                # The guard handed back the jobs behind this one (and wrote
                # those run before it): this batch is over.
                break
        # No fast job runs from here on: the executor records the slow ones
        # it starts (stats.SlowJobs), and a crash is blamed on those alone.
        if self._running is not None:
            self._running[RUNNING_JOB] = 0
        if slow:
            slow_done: list[int] = []
            first = len(failures)
            self._at = -1
            self._job_began = time.monotonic()
            try:
                executor.run(slow, slow_done, failures)
            except BaseException:
                # Every slow job is recorded by now: write it all, then stop.
                self._returned()
                self._attempts_of(slow, slow_done, failures, first)
                self.stopping = True
                self.finish()
                raise
            self._returned()
            self._attempts_of(slow, slow_done, failures, first)
        if self._guard_error is not None:
            error, self._guard_error = self._guard_error, None
            raise error

    def _returned(self) -> None:
        """This thread is back from a handler: the guard, if it is handing the batch back, finishes first.

        A stop-now signal (KeyboardInterrupt) raised while it waits still waits:
        the guard is using the connection the loop's final writes need.
        """
        try:
            self._guard_lock.acquire()
        except BaseException:
            self._guard_lock.acquire()
            self._job_began = 0.0
            self._guard_lock.release()
            raise
        self._job_began = 0.0
        self._guard_lock.release()

    def hand_back(self) -> bool:
        """From the guard's thread: when a handler outran its bound, hand back what its batch holds.

        On the fast lane, past the batch's deadline: the job running becomes
        a running state-lane job, the outcomes so far are written and the
        transaction commits (the jobs behind it are free again, untouched).
        On the state lane, once the job has run HAND_BACK_AFTER: the jobs
        behind it and the batch claimed ahead are released (uncounted), with
        the outcomes so far. Either way the batch is over when the handler
        returns; its outcome is written by the state lane's next statement.
        """
        if not self._job_began or self._handed:
            return False
        with self._guard_lock:
            began, now = self._job_began, time.monotonic()
            if not began or self._handed:
                return False
            if self._tx:
                if now <= self._deadline:
                    return False
            elif now - began < HAND_BACK_AFTER or not self._holding():
                return False
            self._handed = True
            try:
                if self._tx:
                    self._hand_over()
                else:
                    self._hand_back_state()
            except LoopError as exc:
                self._guard_error = exc
            return True

    def _holding(self) -> bool:
        """Whether the state-lane batch running holds anything a hand-back would give or write."""
        if self._in_flight or self._at < 0:  # the executor's phase: it knows which jobs have not started
            return True
        return bool(self._at + 1 < len(self._batch) or self._slow or self._done or self._failures)

    def _hand_over(self) -> None:
        """The fast lane's hand-back: the job running leaves the transaction, which commits."""
        job_id, attempt = self._batch[self._at][0], self._batch[self._at][3]
        params = [str(job_id).encode(), self._worker_id, str(attempt).encode()]
        self._send_prepared(b"job_hand_over", params)
        _, error, _ = self._results()
        self._demote(self._batch_base // self._stride)
        if error is not None:
            # The transaction is aborted: the whole batch runs again (at least once).
            outcomes = len(self._done) + len(self._failures)
            del self._done[:], self._failures[:]
            self._tx = False
            self._simple(sql.fast_rollback)
            handlers.say_rolled_back(outcomes, error)
            return
        self._commit(wake=True)

    def _hand_back_state(self) -> None:
        """The state lane's hand-back: release what waits behind the job running, write what ran."""
        releases: list[Outcome] = []
        done: list[int] = []
        failures: list[Outcome] = []
        if self._in_flight:
            ahead = self._receive()
            releases += [handlers.release(row[0], row[3]) for row in ahead]
            self._marks[self._sent[0]] = None
        if self._at >= 0:
            releases += [handlers.release(row[0], row[3]) for row in self._batch[self._at + 1 :]]
            releases += [handlers.release(job[1], job[3]) for job in self._slow]
            del self._slow[:]
            done, failures = self._done[:], self._failures[:]
            del self._done[:], self._failures[:]
            self.completed += len(done)
            completed, failed, retried, discarded = handlers.tally(failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
            # The jobs released lie behind the mark this batch's claim set.
            self._marks[self._batch_base // self._stride] = None
        else:
            # The executor's phase: it keeps the outcomes; the jobs it has not started come back.
            releases += [handlers.release(job[1], job[3]) for job in self._executor.hand_back()]
        failures += releases
        if not (done or failures):
            return
        self._writing(failures)
        error = self._write(done, failures)
        if error is not None:
            handlers.isolate(self._write, done, failures, error)
        self._written()

    def _attempts_of(
        self, slow: list[handlers.SlowJob], slow_done: list[int], failures: list[Outcome], first: int
    ) -> None:
        """Take the executor's completions with their attempts, and fill in those its releases lack."""
        if self._counts is not None:
            took = self._executor.running.took if self._executor.running is not None else {}
            stats.count_slow(
                self._counts,
                self._batch_base,
                self._kind_rows,
                self._other,
                slow,
                slow_done,
                failures[first:],
                took,
            )
        attempts = {job[1]: job[3] for job in slow}
        for outcome in failures[first:]:
            if not outcome["attempt"]:
                outcome["attempt"] = attempts.get(outcome["id"], 0)
        for job_id in slow_done:
            if attempts[job_id] == 1:
                self._done.append(job_id)
            else:
                failures.append(handlers.completed(job_id, attempts[job_id]))
