"""Running handlers off the hot path, and turning what they raise into outcome records.

The hot loop calls plain `def` handlers inline. Everything slower goes
through here: async handlers (run concurrently on the worker's event loop),
handlers with a timeout, and every exception, which becomes the record the
batch statement (sql.job_finish_claim_many) writes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import inspect
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from .errors import Cancel, JobTimeout, Retry, Snooze
from .retry import default_backoff
from .types import JobSpec

Outcome = dict[str, Any]

# One job handed to the slow path: (spec, id, args, attempt, max_attempts).
SlowJob = tuple[JobSpec, int, dict[str, Any], int, int]


# The most characters of an error message, and of a traceback, one attempt
# records (Sidekiq keeps 10,000 of a message). Every attempt appends its record
# to the row's errors: a message of tens of megabytes, stored twice, outgrows
# jsonb's 256 MB within a few attempts, and then the batch statement fails and
# the worker dies with its batch's outcomes.
ERROR_CHARS = 10_000


def _bounded(text: str, keep_end: bool = False) -> str:
    """`text`, or ERROR_CHARS characters of it and a marker saying how many were cut.

    A message keeps its start; a traceback (`keep_end`) its start and end,
    where the innermost frames and the exception's line are.
    """
    if len(text) <= ERROR_CHARS:
        return text
    marker = f" [... {len(text) - ERROR_CHARS:,} characters cut"
    if not keep_end:
        return f"{text[:ERROR_CHARS]}{marker}]"
    half = ERROR_CHARS // 2
    return f"{text[:half]}{marker} ...] {text[-half:]}"


def _message(exc: BaseException) -> str:
    """`Type: message`, even for an exception whose __str__ raises (which would kill the worker)."""
    try:
        message = str(exc)
    except Exception as failed:
        message = f"<exception str() failed: {type(failed).__name__}>"
    return f"{type(exc).__name__}: {message}"


def _error(attempt: int, exc: BaseException | str, with_traceback: bool = True) -> dict[str, Any]:
    if isinstance(exc, str):
        text, trace = exc, None
    else:
        text = _message(exc)
        trace = _bounded("".join(traceback.format_exception(exc)), keep_end=True) if with_traceback else None
    return {
        "at": dt.datetime.now(dt.UTC).isoformat(),
        "attempt": attempt,
        "error": _bounded(text),
        "traceback": trace,
    }


def _outcome(
    job_id: int,
    state: str,
    *,
    delay: float | None = None,
    uncount: int = 0,
    error: dict[str, Any] | None = None,
) -> Outcome:
    """One row of the batch statement's outcomes ($2 of sql.job_finish_claim_many)."""
    return {"id": job_id, "state": state, "delay": delay, "uncount": uncount, "error": error}


def failure(
    spec: JobSpec | None, job_id: int, attempt: int, max_attempts: int, exc: BaseException | str
) -> Outcome:
    """The outcome of an attempt that raised `exc` (or failed for the reason `exc`)."""
    if isinstance(exc, Snooze):
        return _outcome(job_id, "scheduled" if exc.delay > 0 else "available", delay=exc.delay, uncount=1)
    if isinstance(exc, Cancel):
        return _outcome(job_id, "cancelled", error=_error(attempt, f"Cancel: {exc.reason}"))
    error = _error(attempt, exc, with_traceback=not isinstance(exc, Retry))
    if attempt >= max_attempts:
        return _outcome(job_id, "discarded", error=error)
    if isinstance(exc, Retry):
        delay = max(exc.delay, 0.0)
    else:
        policy = spec.retry if spec is not None and spec.retry is not None else default_backoff
        delay = max(float(policy(attempt, random.random())), 0.0)
    return _outcome(job_id, "retryable" if delay > 0 else "available", delay=delay, error=error)


def discard(job_id: int, attempt: int, reason: str) -> Outcome:
    """A job that can never succeed (its args do not decode): discarded at once."""
    return _outcome(job_id, "discarded", error=_error(attempt, reason))


def unknown_kind(job_id: int, kind: str, attempt: int, max_attempts: int) -> Outcome:
    """A kind this worker has no handler for: retried, since another deploy may have it."""
    return failure(None, job_id, attempt, max_attempts, f"no handler registered for job kind {kind!r}")


def release(job_id: int) -> Outcome:
    """A claimed job that never started (shutdown, or the batch was aborted): available again, uncounted."""
    return _outcome(job_id, "available", uncount=1)


def cancelled(job_id: int, attempt: int) -> Outcome:
    """A job whose cancellation was requested while it was claimed or running."""
    return _outcome(
        job_id, "cancelled", error=_error(attempt, "Cancel: cancellation requested while it was running")
    )


def tally(outcomes: list[Outcome]) -> tuple[int, int, int]:
    """(failed, retried, discarded) among outcomes: failed attempts are those with an error."""
    failed = retried = discarded = 0
    for outcome in outcomes:
        if outcome["error"] is None:
            continue
        failed += 1
        if outcome["state"] == "discarded":
            discarded += 1
        elif outcome["state"] in ("retryable", "available"):
            retried += 1
    return failed, retried, discarded


def returned_coroutine(spec: JobSpec) -> str:
    return f"handler {spec.kind!r} is a plain def that returned a coroutine: declare it `async def`"


class JobContext:
    """What a running handler can know about its job: `fastjobs.current_job()`.

    A sync handler that may run long should check `cancelled` now and then
    and return (or raise Cancel) when it turns true.
    """

    __slots__ = ("attempt", "cancelled", "id", "kind")

    def __init__(self, job_id: int = 0, kind: str = "", attempt: int = 0) -> None:
        self.id = job_id
        self.kind = kind
        self.attempt = attempt
        self.cancelled = False

    def __repr__(self) -> str:
        return (
            f"<JobContext id={self.id} kind={self.kind!r} attempt={self.attempt} cancelled={self.cancelled}>"
        )


# Each worker thread's executor context (the hot loop updates it in place per
# sync job) and, for async handlers, each task's own.
_thread = threading.local()
_async_job: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("fastjobs_job", default=None)


def current_job() -> JobContext | None:
    """The job the calling handler is running, or None outside a handler."""
    job = _async_job.get()
    if job is not None:
        return job
    job = getattr(_thread, "job", None)
    return job if job is not None and job.id else None


class Executor:
    """The slow path of one worker: async handlers, timeouts, their outcomes, and cancellation.

    `cancel` is called from the worker's control thread: it marks the job
    (the hot loop checks `cancelled` before starting a job and after it ran)
    and cancels an async job's task on the event loop.

    Async jobs run `concurrency` at once; a wave of them takes the time of
    its slowest, not the sum, so `ran_async` tells the hot loop to size its
    next batch by waves (the loop reads and clears it once per batch).
    """

    def __init__(self, concurrency: int = 100) -> None:
        self.concurrency = concurrency
        self.stopping = False  # set by Worker.stop: jobs not yet started go back
        self.ran_async = False
        self.context = JobContext()
        self.cancelled: set[int] = set()
        # The worker's slot (stats.SlowJobs): the jobs whose handlers run now,
        # which alone count a crash if the worker dies.
        self.running: Any = None
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Make this executor's context the calling thread's `current_job()`."""
        _thread.job = self.context

    def cancel(self, job_id: int) -> None:
        self.cancelled.add(job_id)
        if self.context.id == job_id:
            self.context.cancelled = True
        task = self._tasks.get(job_id)
        if task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    def run(self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome]) -> None:
        """Run the slow jobs of a batch: sync ones in order, then async ones concurrently.

        SystemExit or KeyboardInterrupt (a second stop signal) leaves nothing
        unrecorded: jobs that had started fail with it, the others are given
        back; then it propagates so the loop writes everything and stops.
        """
        started: set[int] = set()
        try:
            self._run(jobs, completed, failures, started)
        except BaseException as exc:
            self._abandon()
            recorded = set(completed) | {outcome["id"] for outcome in failures}
            for spec, job_id, _, attempt, max_attempts in jobs:
                if job_id in recorded:
                    continue
                if job_id in started:
                    failures.append(failure(spec, job_id, attempt, max_attempts, exc))
                else:
                    failures.append(release(job_id))
            raise

    def _run(
        self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome], started: set[int]
    ) -> None:
        pending_async = []
        context = self.context
        for job in jobs:
            spec, job_id, args, attempt, max_attempts = job
            if spec.is_async:
                pending_async.append(job)
                continue
            if job_id in self.cancelled:
                self.cancelled.discard(job_id)
                failures.append(cancelled(job_id, attempt))
                continue
            if self.stopping:
                failures.append(release(job_id))
                continue
            context.id, context.kind, context.attempt, context.cancelled = job_id, spec.kind, attempt, False
            started.add(job_id)
            if self.running is not None:
                self.running.add(job_id)
            try:
                result = _call_with_timeout(spec.func, args, spec.timeout)
                if inspect.iscoroutine(result):
                    result.close()
                    failures.append(failure(spec, job_id, attempt, max_attempts, returned_coroutine(spec)))
                    continue
            except Exception as exc:
                if context.cancelled:
                    failures.append(cancelled(job_id, attempt))
                else:
                    failures.append(failure(spec, job_id, attempt, max_attempts, exc))
            else:
                if context.cancelled:
                    failures.append(cancelled(job_id, attempt))
                else:
                    completed.append(job_id)
            finally:
                if self.running is not None:
                    self.running.discard(job_id)
                if context.cancelled:
                    self.cancelled.discard(job_id)
                context.id = 0
        if pending_async:
            self.ran_async = True
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._gather(pending_async, completed, failures, started))

    async def _gather(
        self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome], started: set[int]
    ) -> None:
        limit = asyncio.Semaphore(self.concurrency)

        async def one(job: SlowJob) -> None:
            spec, job_id, args, attempt, max_attempts = job
            async with limit:
                if job_id in self.cancelled:
                    self.cancelled.discard(job_id)
                    failures.append(cancelled(job_id, attempt))
                    return
                if self.stopping:
                    # A graceful stop: the running jobs finish, those still
                    # waiting for a slot go back (uncounted) instead of starting,
                    # so a large batch cannot outlast the grace period.
                    failures.append(release(job_id))
                    return
                context = JobContext(job_id, spec.kind, attempt)
                _async_job.set(context)
                started.add(job_id)
                if self.running is not None:
                    self.running.add(job_id)
                task = asyncio.current_task()
                assert task is not None
                self._tasks[job_id] = task
                try:
                    async with asyncio.timeout(spec.timeout):
                        await spec.func(**args)
                except asyncio.CancelledError as stray:
                    if job_id in self.cancelled:
                        failures.append(cancelled(job_id, attempt))
                    elif task.cancelling():
                        raise  # the batch is abandoned (see run)
                    else:
                        # The handler raised CancelledError itself, no one
                        # cancelled its task: a failure of that job like any other.
                        failures.append(failure(spec, job_id, attempt, max_attempts, stray))
                except TimeoutError:
                    exc = JobTimeout(f"job ran longer than its timeout of {spec.timeout:g}s")
                    failures.append(failure(spec, job_id, attempt, max_attempts, exc))
                except Exception as exc:
                    failures.append(failure(spec, job_id, attempt, max_attempts, exc))
                else:
                    completed.append(job_id)
                finally:
                    if self.running is not None:
                        self.running.discard(job_id)
                    self._tasks.pop(job_id, None)
                    self.cancelled.discard(job_id)

        # Each job runs in a task of its own, so each gets its own context.
        await asyncio.gather(*(one(job) for job in jobs))

    def _abandon(self) -> None:
        """Cancel and settle the tasks an interrupted batch leaves on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None


_warned_thread_timeout = False


def _warn_thread_timeout() -> None:
    global _warned_thread_timeout
    _warned_thread_timeout = True
    print(
        "fastjobs: this worker runs off the main thread, so sync handlers' timeouts cannot interrupt"
        " them (SIGALRM); async handlers' timeouts still apply",
        file=sys.stderr,
    )


def _call_with_timeout(func: Callable[..., Any], args: dict[str, Any], timeout: float | None) -> Any:
    """Call a sync handler; past `timeout` seconds, JobTimeout is raised inside it.

    SIGALRM interrupts Python code, not a call blocked in C: the master's
    heartbeat watchdog replaces a worker stuck there.
    """
    if timeout is None:
        return func(**args)
    if threading.current_thread() is not threading.main_thread():
        # SIGALRM reaches the main thread only: a Worker run on another thread
        # (embedded in an application) cannot interrupt a sync handler. Say so once.
        if not _warned_thread_timeout:
            _warn_thread_timeout()
        return func(**args)

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise JobTimeout(f"job ran longer than its timeout of {timeout:g}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    began = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return func(**args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # an outer timer (the application's, a test runner's) runs on
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 1e-6))
