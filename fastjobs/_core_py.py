"""The hot path in plain Python: the readable reference `_core.pyx` matches name for name (four of its
parts in modules of their own: `_libpq_py`, `_claimed_py`, `_fast_lane_py`, `_hand_back_py`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import orjson
import psycopg

from . import _claimed_py, _fast_lane_py, _hand_back_py, _libpq_py, guard, outcomes, sql, stats
from .abc import (
    COMPLETED,
    FRONT_CLAIM_DUTY,
    HAND_BACK_AFTER,
    PG_EPOCH_US,
    PICKUP_SUM,
    ROW,
    RUN_SUM,
)
from .args import dump_args as dump_args
from .args import encode_copy_rows as encode_copy_rows
from .errors import LoopError
from .executor import Executor
from .planner import Planner, fast_queues, takes_keys, widths
from .stats import RUNNING_JOB, RUNNING_SUSPECT, RUNNING_WRITING
from .types import JobSpec, Outcome

IMPLEMENTATION = "python"

# A claimed job: id, kind, args (binary jsonb), attempt, max_attempts, run_at
# (binary timestamptz: microseconds since 2000), with full context its meta
# (binary jsonb, or None), created_at and run_at, and whether it keeps its
# result (keep_result is set: its value goes with its outcome).
Row = tuple[int, str, bytes, int, int, int, "tuple[bytes | None, int, int] | None", bool]


class BatchLoop:
    """Claims, runs and completes batches on one connection, one statement per batch.

    With `overlap`, the statement that completes batch k-1 and claims batch
    k+1 is sent before batch k's handlers run, so PostgreSQL works while
    Python does: on two cores a strictly sequential loop leaves each side
    idle half the time. The price is one batch claimed ahead, given back
    (uncounted) by `finish`.

    Which queue, which lane, how many and from where are the Planner's
    (fastjobs.planner), asked once per claim and once per batch.
    """

    # Four of _core.pyx's parts are modules of their own here, functions of the loop that become
    # its methods under the C class's names: the libpq calls, the reading of a claim's result, the
    # fast lane's transaction and the hand-back.
    _lost = _libpq_py._lost
    _prepare = _libpq_py._prepare
    _send_prepared = _libpq_py._send_prepared
    _simple = _libpq_py._simple
    _results = _libpq_py._results
    _claimed = _claimed_py._claimed
    _rows_of = _claimed_py._rows_of
    _plan = _claimed_py._plan
    _lock = _fast_lane_py._lock
    _commit = _fast_lane_py._commit
    _end = _fast_lane_py._end
    _fast = _fast_lane_py._fast
    _returned = _hand_back_py._returned
    hand_back = _hand_back_py.hand_back
    _holding = _hand_back_py._holding
    _hand_over = _hand_back_py._hand_over
    _hand_back_state = _hand_back_py._hand_back_state

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
        front_claim_duty: float = FRONT_CLAIM_DUTY,
        running: memoryview | None = None,
        counts: memoryview | None = None,
        whole_context: bool = False,
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
            raise ValueError("progress and running are the one card's: pass both or neither")
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
        # With `whole_context` (the app has middleware) the claim returns each job's meta and
        # created_at too, and each JobContext is filled whole; without, neither costs a job anything.
        self._whole_context = whole_context
        # By (the outcomes' statement, claim after the mark): in a queue without keyed jobs, "claim" with
        # nothing to send, "complete" for first-attempt completions; "kept" while the planner keeps.
        tables = {
            "finish": sql.FINISH_CONTEXT if whole_context else sql.FINISH,
            "kept": sql.FINISH_CONTEXT_RESULTS if whole_context else sql.FINISH_RESULTS,
            "complete": sql.COMPLETE_CONTEXT if whole_context else sql.COMPLETE,
            "claim": sql.CLAIM_ONLY_CONTEXT if whole_context else sql.CLAIM_ONLY,
        }
        chosen = {
            (key, after): table[keep_completed, after]
            for key, table in tables.items()
            for after in (0, 1, sql.IN_SLOT)
            if (keep_completed, after) in table
        }
        self._statements = {name: (name.encode(), text) for name, text in chosen.values()}
        self._finish_names = {key: name.encode() for key, (name, _) in chosen.items()}
        # A batch that runs long on the fast lane (sql.job_lock_many) or finds
        # a job that may not run on it (async, timeout, pooled) moves its queue
        # to the state lane for FAST_LANE_DEMOTE seconds.
        self.planner = Planner(
            fast_queues(specs, queues, fast_lane=fast_lane, keep_completed=keep_completed),
            batch_min=batch_min,
            batch_max=batch_max,
            duty=front_claim_duty,
            pooled=lambda index: bool(executor.threads) and executor.pooled(self._queues[index]),
            widths=widths(specs, queues, executor.concurrency, executor.threads),
        )
        # The fast lane's claims, from the front and after the mark (as the state lane's).
        keys = takes_keys(specs)
        locks = [sql.LOCK[whole_context, after, keys] for after in (False, True)]
        self._lock_names = tuple(name.encode() for name, _ in locks)
        if self.planner.any_fast:
            for name, text in locks:
                self._statements[name] = (name.encode(), text)
            for name in (
                "job_finish_locked_many",
                "job_finish_locked_many_results",
                "job_hand_over",
                "queue_wake",
            ):
                self._statements[name] = (name.encode(), sql.STATEMENTS[name])
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
        self._slow: list[outcomes.SlowJob] = []
        self._handed = False
        self._guard_error: LoopError | None = None
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
        self.stale = 0  # outcomes dropped because their job no longer ran that attempt here
        self._rows: list[Row] = []
        # Jobs completed at their first attempt (by id), and every other outcome.
        self._done: list[int] = []
        self._failures: list[Outcome] = []
        # The outcomes of the statement in flight, isolated if PostgreSQL rejects it.
        self._sent_outcomes: tuple[list[int], list[Outcome]] = ([], [])
        self._sent_slot = 0  # the rotating slot the claim in flight reads alone (0: every slot)

    # The planner's figures the worker reads and its careful mode sets.
    @property
    def batch_min(self) -> int:
        return self.planner.batch_min

    @batch_min.setter
    def batch_min(self, value: int) -> None:
        self.planner.batch_min = value

    @property
    def batch_max(self) -> int:
        return self.planner.batch_max

    @batch_max.setter
    def batch_max(self, value: int) -> None:
        self.planner.batch_max = value

    @property
    def size(self) -> int:
        return self.planner.size

    @property
    def recheck(self) -> float:
        return self.planner.recheck

    def due(self) -> float:
        if self._handed:
            return 0.0
        if self._tx:  # between two handlers too: the next may start just before the deadline
            return self._deadline
        return self._job_began + HAND_BACK_AFTER if self._job_began else 0.0

    def prepare(self, plan_ahead: bool = False) -> None:
        for name, text in self._statements.values():
            self._prepare(name, text)
        if plan_ahead:
            self._simple(sql.plan_ahead([(name.decode(), text) for name, text in self._statements.values()]))
        guard.watch(self)

    def _writing(self, failures: Sequence[Outcome]) -> None:
        """Note in the card the failed jobs' outcomes the statement about to be sent carries."""
        if self._running is not None and not self._write_failed:
            self._running[RUNNING_WRITING] = len(failures)
            if failures:
                self._running[RUNNING_SUSPECT] = failures[0]["id"]

    def _written(self) -> None:
        if self._running is not None and not self._write_failed:
            self._running[RUNNING_WRITING] = 0

    def _send(self, index: int = 0, limit: int = 0, mark: tuple[int, int, int] | None = None) -> None:
        """Send the outcomes gathered so far and a claim: the planner's next (none by default)."""
        done = ("{" + ",".join(map(str, self._done)) + "}").encode()
        keyed = not self.planner.keyless(index)  # a claim that must take keyed jobs goes by "finish"
        variant = "finish" if self._failures or keyed else "complete" if self._done else "claim"
        variant = "kept" if self.planner.keeping and variant != "claim" else variant
        self._writing(self._failures)
        failures = outcomes.encode(self._failures)
        self.completed += len(self._done)
        if self._failures:
            completed, failed, retried, discarded = outcomes.tally(self._failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
        self._sent_outcomes = (self._done, self._failures)
        self._done = []
        self._failures = []
        params = [done, failures, self._queues[index], str(limit).encode(), self._worker_id]
        after, self._sent_slot = 0, 0
        if mark is not None:
            params += [str(mark[0]).encode(), str(mark[1]).encode()]
            after = 1
            if mark[2] and (variant, sql.IN_SLOT) in self._finish_names:  # the claim and complete ones
                after, self._sent_slot = sql.IN_SLOT, mark[2]
                params.append(str(mark[2]).encode())
        self._send_prepared(self._finish_names[variant, after], params)
        self._in_flight = True
        self._limit = limit

    def _write(self, done: list[int], failures: list[Outcome]) -> str | None:
        """Write outcomes alone, claiming nothing; the error if one of them is rejected."""
        ids = ("{" + ",".join(map(str, done)) + "}").encode()
        params = [ids, outcomes.encode(failures), self._queues[0], b"0", self._worker_id]
        self._send_prepared(self._finish_names["kept", 0], params)  # a hand-back's, or isolation's: rare
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
            outcomes.isolate(self._write, done, failures, error)
            res = None
        self._sent_outcomes = ([], [])
        self._written()
        n = self._claimed(res) if res is not None else 0
        rows = self._rows_of(res, n)
        self.claimed += n
        if self._limit > 0:
            self._plan(res, rows)
        return rows

    def _claim(self) -> list[Row]:
        """Claim synchronously, trying each queue once (the planner's tries) before giving up."""
        for _ in range(self.planner.tries(bool(self._failures))):
            if self.planner.lane():
                rows = self._lock()
                if not rows and self.planner.again():
                    self._send(*self.planner.next())
                    rows = self._receive()
            else:
                self._send(*self.planner.next())
                rows = self._receive()
            if rows:
                return rows
        return []

    def step(self) -> int:
        """Run one batch; 0 when there was nothing to claim (outcomes are flushed then)."""
        planner = self.planner
        planner.recheck = float("inf")
        rows = self._rows or self._claim()
        self._rows = []
        if not rows:
            return 0
        index = planner.index
        queue = self._queues[index]
        self._executor.queue = queue  # the rows' queue, for the records of failures
        # Its sync jobs run on the executor's threads when it was given concurrency (checked per batch).
        self._pooled = bool(self._executor.threads) and self._executor.pooled(queue)
        self._batch_base = index * self._stride
        self._batch, self._handed = rows, False
        if self._tx:
            return self._fast(rows, index)
        if planner.ahead(self.overlap, self.stopping):
            self._send(*planner.next())
        began = time.perf_counter()
        self._run(rows)
        ran = time.perf_counter() - began
        wave, self._executor.wave = self._executor.wave, 0
        planner.ran(index, len(rows), ran, wave, self._pooled, self._in_flight)
        if self._in_flight:
            self._rows = self._receive()
        return len(rows)

    def finish(self) -> None:
        """Give back the batch claimed ahead and write every outcome still held."""
        if self._tx:
            self._commit()
        if self._in_flight:
            self._rows = self._receive()
        self._failures.extend(outcomes.release(row[0], row[3]) for row in self._rows)
        self._rows = []
        if self._done or self._failures:
            self._send()
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
                failures.extend(outcomes.release(row[0], row[3]) for row in rows[index:])
                break
            if fast and time.monotonic() > self._deadline:
                # Jobs slower than the queue's pace: the rest go back and the
                # queue takes the state lane for a while.
                self.planner.demote(self._batch_base // self._stride)
                failures.extend(outcomes.release(row[0], row[3]) for row in rows[index:])
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
                        at, outcomes.unknown_kind(job_id, kind, attempt, max_attempts, specs.values())
                    )
                )
                continue
            try:
                args = orjson.loads(raw[1:])
            except orjson.JSONDecodeError as exc:
                failures.append(
                    self._tally(at, outcomes.discard(job_id, attempt, f"args do not decode: {exc}"))
                )
                continue
            if type(args) is not dict:
                reason = f"args must be a JSON object, not {type(args).__name__}"
                failures.append(self._tally(at, outcomes.discard(job_id, attempt, reason)))
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
                    self.planner.demote(self._batch_base // self._stride)
                    failures.append(outcomes.release(job_id, attempt))
                    continue
                slow.append((spec, job_id, args, attempt, max_attempts, claimed))
                if keep:
                    executor.keeping.add(job_id)
                continue
            if executor.cancelled and job_id in executor.cancelled:
                executor.cancelled.discard(job_id)
                failures.append(self._tally(at, outcomes.cancelled(job_id, attempt)))
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
                    failures.extend(outcomes.release(row[0], row[3]) for row in rows[index + 1 :])
                    failures.extend(outcomes.release(job[1], job[3]) for job in slow)
                self.stopping = True
                self.finish()
                raise
            self._returned()
            if at >= 0:
                stats.observe(counts, at + RUN_SUM, time.perf_counter_ns() - began)
            outcome = executor.returned(spec, job_id, attempt, max_attempts, result)
            if outcome is None and keep:
                outcome = outcomes.kept(spec, job_id, attempt, max_attempts, result)
            if outcome is not None:
                failures.append(self._tally(at, outcome))
            else:
                if at >= 0:
                    counts[at + COMPLETED] += 1
                if attempt == 1:
                    done.append(job_id)
                else:
                    failures.append(outcomes.completed(job_id, attempt))
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

    def _attempts_of(
        self, slow: list[outcomes.SlowJob], slow_done: list[int], failures: list[Outcome], first: int
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
                failures.append(outcomes.completed(job_id, attempts[job_id]))
