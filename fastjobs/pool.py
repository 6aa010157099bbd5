"""A worker's threads for sync handlers: the sync jobs of a batch from a queue given concurrency > 1.

Most sync handlers wait on I/O (HTTP, SMTP, a database driver), which
releases the GIL: N threads run N such jobs in the time of one. CPU-bound
handlers gain nothing from threads (the GIL runs one at a time); processes
are their concurrency.

The main thread hands a batch's sync jobs to the pool as one `Wave` and
waits for it, acting as the watchdog of its timeouts meanwhile: SIGALRM
reaches the main thread only, so a pool thread past its timeout gets
JobTimeout as an asynchronous exception (PyThreadState_SetAsyncExc),
which Python raises at the thread's next bytecode. A thread blocked in a C
call (`time.sleep`, a socket read without a timeout) finishes that call
before it sees the exception; one still there after as long again (at least
1 s) marks the worker hung: its heartbeat thread stops beating, and under
`fastjobs run` the master replaces it after `--worker-timeout`.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from .context import JobContext, bind
from .errors import JobTimeout
from .outcomes import SlowJob, cancelled, release
from .types import Outcome

__all__ = ["Pool", "Wave"]

if TYPE_CHECKING:
    from .executor import Executor

logger = logging.getLogger(__name__)

# PyDLL: called with the GIL held. `None` as the exception clears a pending one.
# (Two function objects: item access makes a new one, attribute access would share one's argtypes.)
_set_async_exc = ctypes.pythonapi["PyThreadState_SetAsyncExc"]
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_clear_async_exc = ctypes.pythonapi["PyThreadState_SetAsyncExc"]
_clear_async_exc.argtypes = (ctypes.c_ulong, ctypes.c_void_p)

# Stop signals are the main thread's (its handler sets the graceful stop at
# once); delivered to a pool thread, they would wait for the main thread to
# wake from its wait on the wave.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT}


class _ThreadTimeout(JobTimeout):
    """Raised in a pool thread whose job ran past its timeout (a class: SetAsyncExc raises it bare)."""


def _interrupt(ident: int, exc: type[BaseException]) -> None:
    _set_async_exc(ident, exc)


class Wave:
    """One batch's sync jobs on the pool, and what the threads running them share (under the pool's lock)."""

    __slots__ = (
        "abandoned",
        "active",
        "completed",
        "error",
        "failures",
        "fired",
        "jobs",
        "next",
        "running",
        "started",
    )

    def __init__(
        self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome], started: set[int]
    ) -> None:
        self.jobs = jobs
        self.next = 0  # the index of the next job to start
        self.active = 0  # threads still taking jobs from this wave
        self.completed = completed
        self.failures = failures
        self.started = started
        # Thread ident -> (job id, its deadline, its timeout): the jobs running now.
        self.running: dict[int, tuple[int, float, float]] = {}
        self.fired: set[int] = set()  # threads sent a timeout not yet taken back
        self.error: BaseException | None = None  # a handler's SystemExit/KeyboardInterrupt
        self.abandoned = False  # the main thread gave up on it: no thread records anything more


class Pool:
    """Threads (started as needed, kept for the worker's life) that run waves of one executor's sync jobs.

    A wave runs `width` jobs at once: its queue's concurrency in this
    worker. Each thread has its own `current_job()` context. Every job is in
    the worker's card (stats.SlowJobs) while its handler runs, so a crash
    counts an attempt for exactly the running ones.
    """

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._tickets: queue.SimpleQueue[Wave | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def run(
        self,
        jobs: list[SlowJob],
        width: int,
        completed: list[int],
        failures: list[Outcome],
        started: set[int],
    ) -> None:
        """Run `jobs`, `width` at once; return when every one has an outcome.

        A graceful stop (executor.stopping) gives back the jobs not started.
        A SystemExit or KeyboardInterrupt, raised by a handler or in the main
        thread while it waits, abandons the wave: the running handlers are
        interrupted with it, and it propagates (Executor.run records the rest).
        """
        wave = Wave(jobs, completed, failures, started)
        width = min(width, len(jobs))
        while len(self._threads) < width:
            thread = threading.Thread(
                target=self._serve, name=f"fastjobs-sync-{len(self._threads) + 1}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        wave.active = width
        for _ in range(width):
            self._tickets.put(wave)
        try:
            self._wait(wave)
        except BaseException as exc:
            self._abandon(wave, type(exc))
            raise

    def _wait(self, wave: Wave) -> None:
        """Wait for the wave's threads, sending JobTimeout into those past their job's deadline."""
        with self._lock:
            while wave.active and wave.error is None:
                now = time.monotonic()
                soonest = float("inf")
                for ident, (job_id, deadline, timeout) in wave.running.items():
                    if ident in wave.fired:
                        # Still running after JobTimeout was sent: blocked in a C call, which no
                        # exception interrupts. Past a grace as long again (at least 1 s), the
                        # worker is hung: it stops beating, and its master replaces it.
                        stuck = deadline + max(1.0, timeout)
                        if stuck <= now:
                            self._hung(job_id, timeout)
                        else:
                            soonest = min(soonest, stuck)
                        continue
                    if deadline <= now:
                        wave.fired.add(ident)
                        _interrupt(ident, _ThreadTimeout)
                        soonest = min(soonest, deadline + max(1.0, timeout))  # to see if it ended
                    else:
                        soonest = min(soonest, deadline)
                self._changed.wait(None if soonest == float("inf") else soonest - now)
            if wave.error is not None:
                raise wave.error

    def _hung(self, job_id: int, timeout: float) -> None:
        if not self._executor.hung:
            self._executor.hung = True
            logger.error(
                "job %d ran past its timeout of %gs blocked in a C call on a pool thread: this worker"
                " stops beating, so its master replaces it (the job counts a crash); give the call"
                " a timeout of its own",
                job_id,
                timeout,
            )

    def _abandon(self, wave: Wave, exc: type[BaseException]) -> None:
        with self._lock:
            wave.abandoned = True
            for ident in wave.running:
                _interrupt(ident, exc)

    def close(self) -> None:
        for _ in self._threads:
            self._tickets.put(None)
        self._threads = []

    def _serve(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        context = JobContext()
        bind(self._executor, context)
        while True:
            try:
                wave = self._tickets.get()
                if wave is None:
                    return
                self._drain(wave, context)
            except BaseException:
                # An interruption meant for a job that had just ended (the
                # wave was abandoned): nothing of it is recorded any more.
                logger.debug("pool thread interrupted between jobs", exc_info=True)

    def _take(self, wave: Wave, context: JobContext, ident: int) -> SlowJob | None:
        """The next job this thread starts, registered as running; None when the wave has no more."""
        executor = self._executor
        with self._lock:
            while True:
                if wave.abandoned or wave.error is not None or wave.next >= len(wave.jobs):
                    wave.active -= 1
                    if not wave.active:
                        self._changed.notify()
                    return None
                job = wave.jobs[wave.next]
                wave.next += 1
                spec, job_id, _, attempt, _, _ = job
                if job_id in executor.handed_back:
                    continue  # the guard handed it back: its release is written
                # Registered before the check, so a cancellation arriving in between reaches the context.
                context.id, context.kind, context.attempt = job_id, spec.kind, attempt
                context.cancelled = False
                executor.contexts[job_id] = context
                if job_id in executor.cancelled:
                    executor.cancelled.discard(job_id)
                    del executor.contexts[job_id]
                    context.id = 0
                    wave.failures.append(cancelled(job_id, attempt))
                    continue
                if executor.stopping:
                    # A graceful stop: the running jobs finish, the others go back unstarted.
                    del executor.contexts[job_id]
                    context.id = 0
                    wave.failures.append(release(job_id))
                    continue
                if not executor.begin(job_id, wave.started):
                    del executor.contexts[job_id]
                    context.id = 0
                    continue
                if executor.running is not None:
                    executor.running.add(job_id)
                timeout = spec.timeout if spec.timeout is not None else float("inf")
                wave.running[ident] = (job_id, time.monotonic() + timeout, timeout)
                if spec.timeout is not None:
                    self._changed.notify()  # a new deadline for the watchdog
                return job

    def _ended(self, wave: Wave, ident: int, job_id: int) -> None:
        """The job's handler returned or raised: no timeout may reach this thread any more (idempotent)."""
        with self._lock:
            if ident in wave.fired:
                _clear_async_exc(ident, None)
                wave.fired.discard(ident)
            if wave.running.get(ident, (0,))[0] == job_id:
                del wave.running[ident]
                self._executor.contexts.pop(job_id, None)
                if self._executor.running is not None:
                    self._executor.running.discard(job_id)

    def _drain(self, wave: Wave, context: JobContext) -> None:
        executor = self._executor
        ident = threading.get_ident()
        while (job := self._take(wave, context, ident)) is not None:
            spec, job_id, args, attempt, max_attempts, claimed = job
            if claimed is not None:  # the app has middleware: its context whole
                context.fill(executor._queue(), args, max_attempts, claimed)
            result: Any = None
            error: BaseException | None = None
            try:
                result = spec.target(**args)
            except BaseException as exc:
                error = exc
            # The handler ended: a JobTimeout the watchdog sends from here on
            # came too late and is dropped, so a job that returned as its
            # deadline passed completes. It can land in _ended, until that takes
            # the thread off the running list under the lock; this loop (no
            # call before it, where it could land first) takes it back.
            while True:
                try:
                    self._ended(wave, ident, job_id)
                    break
                except _ThreadTimeout:
                    continue
            outcome: Outcome | None
            if error is None:
                outcome = executor.returned_in(context, spec, job_id, attempt, max_attempts, result)
            elif isinstance(error, _ThreadTimeout):
                timeout = JobTimeout(f"job ran longer than its timeout of {spec.timeout:g}s")
                outcome = executor.raised_in(context, spec, job_id, attempt, max_attempts, timeout)
            else:
                outcome = executor.raised_in(context, spec, job_id, attempt, max_attempts, error)
                if not isinstance(error, Exception):
                    with self._lock:
                        if not wave.abandoned:
                            # Stop the worker, as in the main thread: Executor.run fails the other
                            # running jobs with it and gives back the rest.
                            wave.failures.append(outcome)
                            wave.error = error
                            self._changed.notify()
                    continue
            with self._lock:
                if wave.abandoned:
                    continue
                if outcome is None:
                    wave.completed.append(job_id)
                else:
                    wave.failures.append(outcome)
