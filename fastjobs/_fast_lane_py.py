"""The Python loop's fast lane: a batch claimed by row locks in a transaction it holds while its
handlers run, its outcomes written and committed in it (docs/internals.md, "Lanes")."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import guard, outcomes, sql
from .errors import LoopError

if TYPE_CHECKING:
    from ._core_py import BatchLoop, Row

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


def _lock(self: BatchLoop) -> list[Row]:
    """The fast lane's claim: BEGIN, lock the planner's next; the transaction stays open if any came."""
    if self._done or self._failures:
        # Outcomes of the state lane still held go first, by its own statement.
        self._send()
        self._receive()
    index, limit, mark = self.planner.next()
    params = [self._queues[index], str(limit).encode()]
    if mark is not None:
        params += [str(mark[0]).encode(), str(mark[1]).encode()]
    with _quiet():
        self._simple(sql.fast_begin)
        self._send_prepared(self._lock_names[mark is not None], params)
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
    rows = self._rows_of(res, n)
    self._plan(res, rows)
    self.claimed += n
    return rows


def _commit(self: BatchLoop, wake: bool = False) -> None:
    """Write the fast batch's outcomes in its transaction and commit it (releases are left as they were).

    A statement PostgreSQL rejects rolls the batch back (its jobs run
    again: at least once) and moves the queue to the state lane, whose
    statement isolates a bad outcome. Jobs it leaves unstarted (released,
    or behind a handed-over job: `wake`) wake the queue's sleeping workers.
    The lists are emptied in place: the batch running holds them.
    """
    with _quiet():
        self._end(wake)


def _end(self: BatchLoop, wake: bool) -> None:
    done, failures = self._done[:], outcomes.started(self._failures)
    wake = wake or len(failures) < len(self._failures)
    del self._done[:], self._failures[:]
    self._tx = False
    self._writing(failures)
    ids = ("{" + ",".join(map(str, done)) + "}").encode()
    name = b"job_finish_locked_many_results" if self.planner.keeping else b"job_finish_locked_many"
    self._send_prepared(name, [ids, outcomes.encode(failures), self._worker_id])
    _, error, _ = self._results()
    if error is None and wake:
        self._send_prepared(b"queue_wake", [self._queues[self._batch_base // self._stride]])
        _, error, _ = self._results()
    if error is not None:
        self._simple(sql.fast_rollback)
        self.planner.demote(self._batch_base // self._stride)
        outcomes.say_rolled_back(len(done) + len(failures), error)
    else:
        self._simple(sql.fast_commit)
        self.completed += len(done)
        if failures:
            completed, failed, retried, discarded = outcomes.tally(failures)
            self.completed += completed
            self.failed += failed
            self.retried += retried
            self.discarded += discarded
        self.fast += len(done) + len(failures)
    self._written()


def _fast(self: BatchLoop, rows: list[Row], index: int) -> int:
    """Run a fast-lane batch in its transaction, then write its outcomes and commit.

    No claim is sent ahead: it would share the transaction, and the commit
    would unlock its rows. The batch stops starting jobs at the planner's
    deadline (the rest stay available, untouched).
    """
    began = time.perf_counter()
    self._deadline = self.planner.deadline()
    guard.alert(self._deadline)
    try:
        self._run(rows)
    finally:
        if self._tx:
            self._commit()
    self.planner.ran_fast(index, len(rows), time.perf_counter() - began)
    return len(rows)
