"""The Python loop's hand-back: from the guard's thread, what the batch of a handler that outran its
bound holds goes back or is written, on either lane (fastjobs.guard)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import outcomes, sql
from .errors import LoopError
from .types import Outcome

if TYPE_CHECKING:
    from ._core_py import BatchLoop


def _returned(self: BatchLoop) -> None:
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


def hand_back(self: BatchLoop) -> bool:
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
        if not self._job_began or self._handed:
            return False
        # Its bound (BatchLoop.due); the fast lane's transaction is always worth handing over.
        if time.monotonic() <= self.due() or not (self._tx or self._holding()):
            return False
        self._handed = True
        self.planner.handed_back(self._batch_base // self._stride)
        try:
            if self._tx:
                self._hand_over()
            else:
                self._hand_back_state()
        except LoopError as exc:
            self._guard_error = exc
        return True


def _holding(self: BatchLoop) -> bool:
    """Whether the state-lane batch running holds anything a hand-back would give or write."""
    if self._in_flight or self._at < 0:  # the executor's phase: it knows which jobs have not started
        return True
    return bool(self._at + 1 < len(self._batch) or self._slow or self._done or self._failures)


def _hand_over(self: BatchLoop) -> None:
    """The fast lane's hand-back: the job running leaves the transaction, which commits."""
    job_id, attempt = self._batch[self._at][0], self._batch[self._at][3]
    params = [str(job_id).encode(), self._worker_id, str(attempt).encode()]
    self._send_prepared(b"job_hand_over", params)
    _, error, _ = self._results()
    self.planner.demote(self._batch_base // self._stride)
    if error is not None:
        # The transaction is aborted: the whole batch runs again (at least once).
        lost = len(self._done) + len(self._failures)
        del self._done[:], self._failures[:]
        self._tx = False
        self._simple(sql.fast_rollback)
        outcomes.say_rolled_back(lost, error)
        return
    self._commit(wake=True)


def _hand_back_state(self: BatchLoop) -> None:
    """The state lane's hand-back: release what waits behind the job running, write what ran."""
    releases: list[Outcome] = []
    done: list[int] = []
    failures: list[Outcome] = []
    if self._in_flight:
        ahead = self._receive()
        releases += [outcomes.release(row[0], row[3]) for row in ahead]
        self.planner.unmark(self.planner.index)
    if self._at >= 0:
        releases += [outcomes.release(row[0], row[3]) for row in self._batch[self._at + 1 :]]
        releases += [outcomes.release(job[1], job[3]) for job in self._slow]
        del self._slow[:]
        done, failures = self._done[:], self._failures[:]
        del self._done[:], self._failures[:]
        self.completed += len(done)
        completed, failed, retried, discarded = outcomes.tally(failures)
        self.completed += completed
        self.failed += failed
        self.retried += retried
        self.discarded += discarded
        # The jobs released lie behind the mark this batch's claim set.
        self.planner.unmark(self._batch_base // self._stride)
    else:
        # The executor's phase: it keeps the outcomes; the jobs it has not started come back.
        releases += [outcomes.release(job[1], job[3]) for job in self._executor.hand_back()]
    failures += releases
    if not (done or failures):
        return
    self._writing(failures)
    error = self._write(done, failures)
    if error is not None:
        outcomes.isolate(self._write, done, failures, error)
    self._written()
