"""The slow path of a worker: async handlers, timeouts, threads, cancellation, and their outcomes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from .context import JobContext, _async_job, bind
from .errors import Cancel, JobTimeout
from .outcomes import SlowJob, cancelled, failure, kept, release, returned_coroutine
from .types import JobSpec, Outcome

__all__ = ["Executor"]

logger = logging.getLogger("fastjobs.handlers")  # as fastjobs.outcomes: one name for what handlers did

if TYPE_CHECKING:
    from .pool import Pool


class Executor:
    """The slow path of one worker: async handlers, timeouts, their outcomes, and cancellation.

    `cancel` is called from the worker's heartbeat thread: it marks the job
    (the hot loop checks `cancelled` before starting a job and after it ran)
    and cancels an async job's task on the event loop.

    Async jobs run `concurrency` at once, and the sync jobs of a queue in
    `threads` that many at once on a pool of threads; a wave of them takes
    the time of its slowest, not the sum, so `wave` tells the hot loop to
    size its next batch by waves (the loop reads and clears it once per batch).
    """

    def __init__(self, concurrency: int = 100, threads: Mapping[str, int] | None = None) -> None:
        self.concurrency = concurrency
        # Per queue (as the hot loop names it, bytes): how many of a batch's
        # sync jobs run at once on the pool (pool.Pool). A queue not here (the
        # default) runs them one at a time on the hot loop's thread.
        self.threads = {queue.encode(): n for queue, n in (threads or {}).items() if n > 1}
        self.stopping = False  # set by Worker.stop: jobs not yet started go back
        self.wave = 0  # how many jobs the last batch ran at once, when more than one (async, pool)
        self.context = JobContext()
        # The contexts of the jobs running on the pool, for `cancel`.
        self.contexts: dict[int, JobContext] = {}
        self._pool: Pool | None = None  # started by the first batch that needs it
        # For the records of its jobs' failures: the worker's id, and the queue
        # of the batch running now (the hot loop sets it once per batch).
        self.worker: str | None = None
        self.queue: bytes | str | None = None
        self.cancelled: set[int] = set()
        # The slow jobs of the batch running that keep their result (keep_result):
        # their outcome carries the value (`kept`). Filled by the hot loop.
        self.keeping: set[int] = set()
        # The worker's card (stats.SlowJobs): the jobs whose handlers run now,
        # which alone count a crash if the worker dies.
        self.running: Any = None
        # Set by the thread pool when a job's thread outlived its timeout inside a C call: the
        # worker's heartbeat thread then stops beating its card, so the master replaces it.
        self.hung = False
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # The batch running (its jobs, those started), the ids of its jobs the
        # guard handed back before they started, and the lock that orders a
        # start against a hand-back (fastjobs.guard, BatchLoop.hand_back).
        self._batch: tuple[list[SlowJob], set[int]] | None = None
        self.handed_back: set[int] = set()  # read without the lock only to skip early
        self._start_lock = threading.Lock()

    def hand_back(self) -> list[SlowJob]:
        """From the guard's thread: the jobs of the batch running not started yet; none of them will start."""
        with self._start_lock:
            if self._batch is None:
                return []
            jobs, started = self._batch
            handed = [job for job in jobs if job[1] not in started and job[1] not in self.handed_back]
            self.handed_back.update(job[1] for job in handed)
        return handed

    def begin(self, job_id: int, started: set[int]) -> bool:
        """Register job `job_id` started, unless the guard handed it back (its release is written)."""
        with self._start_lock:
            if job_id in self.handed_back:
                return False
            started.add(job_id)
            return True

    def bind(self) -> None:
        """Make this executor's context the calling thread's `current_job()`."""
        bind(self, self.context)

    def pooled(self, queue: bytes) -> bool:
        """Whether the sync jobs of a batch from `queue` run on the pool (asked once per batch)."""
        return queue in self.threads

    def cancel(self, job_id: int) -> None:
        self.cancelled.add(job_id)
        if self.context.id == job_id:
            self.context.cancelled = True
        context = self.contexts.get(job_id)
        if context is not None:
            context.cancelled = True
        task = self._tasks.get(job_id)
        if task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    # The one place a sync handler's call becomes an outcome, for both hot
    # loops and the slow path below. The C loop's only shortcut: a call that
    # returned no coroutine and was not cancelled is completed inline (what
    # `returned` would say), so a successful job costs no call here.

    def raised(
        self, spec: JobSpec, job_id: int, attempt: int, max_attempts: int, exc: BaseException
    ) -> Outcome:
        """The outcome of a sync handler's call that raised `exc`.

        Cancelled if its cancellation arrived while it ran (an Exception
        only: SystemExit or KeyboardInterrupt, which stop the worker, fail it),
        with the handler's reason when it answered the request with Cancel.
        """
        return self.raised_in(self.context, spec, job_id, attempt, max_attempts, exc)

    def raised_in(
        self,
        context: JobContext,
        spec: JobSpec,
        job_id: int,
        attempt: int,
        max_attempts: int,
        exc: BaseException,
    ) -> Outcome:
        """`raised`, for the job of `context` (a pool thread's)."""
        context.id = 0
        if context.cancelled:
            self.cancelled.discard(job_id)
            if isinstance(exc, Exception) and not isinstance(exc, Cancel):
                return cancelled(job_id, attempt)
        return failure(spec, job_id, attempt, max_attempts, exc)

    def returned(
        self, spec: JobSpec, job_id: int, attempt: int, max_attempts: int, result: Any
    ) -> Outcome | None:
        """The outcome of a sync handler's call that returned `result`; None for a success.

        A coroutine (a plain def that should be `async def`) fails the
        attempt; a cancellation that arrived while it ran cancels the job,
        whatever it returned. The caller records a success.
        """
        return self.returned_in(self.context, spec, job_id, attempt, max_attempts, result)

    def returned_in(
        self, context: JobContext, spec: JobSpec, job_id: int, attempt: int, max_attempts: int, result: Any
    ) -> Outcome | None:
        """`returned`, for the job of `context` (a pool thread's)."""
        context.id = 0
        if context.cancelled:
            self.cancelled.discard(job_id)
        if result is not None and inspect.iscoroutine(result):
            result.close()
            return failure(spec, job_id, attempt, max_attempts, returned_coroutine(spec))
        if context.cancelled:
            return cancelled(job_id, attempt)
        if self.keeping and job_id in self.keeping:
            return kept(spec, job_id, attempt, max_attempts, result)
        return None

    def run(self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome]) -> None:
        """Run the slow jobs of a batch: sync ones in order (or on the pool, for a queue in
        `threads`), then async ones concurrently.

        SystemExit or KeyboardInterrupt (a second stop signal) leaves nothing
        unrecorded: jobs that had started fail with it, the others are given
        back; then it propagates so the loop writes everything and stops.
        """
        started: set[int] = set()
        with self._start_lock:
            self._batch = (jobs, started)
            self.handed_back = set()
        try:
            self._run(jobs, completed, failures, started)
        except BaseException as exc:
            self._abandon()
            recorded = set(completed) | {outcome["id"] for outcome in failures} | self.handed_back
            for spec, job_id, _, attempt, max_attempts, _ in jobs:
                if job_id in recorded:
                    continue
                if job_id in started:
                    failures.append(failure(spec, job_id, attempt, max_attempts, exc))
                else:
                    failures.append(release(job_id))
            raise
        finally:
            with self._start_lock:
                self._batch = None

    def _run(
        self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome], started: set[int]
    ) -> None:
        pending_async = []
        context = self.context
        width = self.threads.get(self.queue, 1) if self.threads and isinstance(self.queue, bytes) else 1
        if width > 1:
            pooled = [job for job in jobs if not job[0].is_async]
            if pooled:
                if self._pool is None:
                    from .pool import Pool

                    self._pool = Pool(self)
                self.wave = width
                self._pool.run(pooled, width, completed, failures, started)
                jobs = [job for job in jobs if job[0].is_async]
        for job in jobs:
            spec, job_id, args, attempt, max_attempts, claimed = job
            if spec.is_async:
                pending_async.append(job)
                continue
            if job_id in self.handed_back:
                continue
            if job_id in self.cancelled:
                self.cancelled.discard(job_id)
                failures.append(cancelled(job_id, attempt))
                continue
            if self.stopping:
                failures.append(release(job_id))
                continue
            context.id, context.kind, context.attempt, context.cancelled = job_id, spec.kind, attempt, False
            if claimed is not None:
                context.fill(self._queue(), args, max_attempts, claimed)
            if not self.begin(job_id, started):
                context.id = 0
                continue
            if self.running is not None:
                self.running.add(job_id)
            outcome: Outcome | None
            try:
                result = _call_with_timeout(spec.target, args, spec.timeout)
            except Exception as exc:
                outcome = self.raised(spec, job_id, attempt, max_attempts, exc)
            except BaseException as exc:
                failures.append(self.raised(spec, job_id, attempt, max_attempts, exc))
                raise
            else:
                outcome = self.returned(spec, job_id, attempt, max_attempts, result)
            finally:
                if self.running is not None:
                    self.running.discard(job_id)
            if outcome is None:
                completed.append(job_id)
            else:
                failures.append(outcome)
        if pending_async:
            self.wave = max(self.wave, self.concurrency)
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._gather(pending_async, completed, failures, started))

    async def _gather(
        self, jobs: list[SlowJob], completed: list[int], failures: list[Outcome], started: set[int]
    ) -> None:
        limit = asyncio.Semaphore(self.concurrency)
        queue = self._queue()

        async def one(job: SlowJob) -> None:
            spec, job_id, args, attempt, max_attempts, claimed = job
            async with limit:
                if job_id in self.handed_back:
                    return
                if job_id in self.cancelled:
                    self.cancelled.discard(job_id)
                    failures.append(cancelled(job_id, attempt))
                    return
                if self.stopping:
                    # A graceful stop: the running jobs finish, those still
                    # waiting their turn go back (uncounted) instead of starting,
                    # so a large batch cannot outlast the grace period.
                    failures.append(release(job_id))
                    return
                context = JobContext(job_id, spec.kind, attempt)
                if claimed is not None:
                    context.fill(queue, args, max_attempts, claimed)
                _async_job.set(context)
                if not self.begin(job_id, started):
                    return
                if self.running is not None:
                    self.running.add(job_id)
                task = asyncio.current_task()
                assert task is not None
                self._tasks[job_id] = task
                try:
                    async with asyncio.timeout(spec.timeout):
                        value = await spec.target(**args)
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
                    if job_id in self.keeping:
                        failures.append(kept(spec, job_id, attempt, max_attempts, value))
                    else:
                        completed.append(job_id)
                finally:
                    if self.running is not None:
                        self.running.discard(job_id)
                    self._tasks.pop(job_id, None)
                    self.cancelled.discard(job_id)

        # Each job runs in a task of its own, so each gets its own context.
        await asyncio.gather(*(one(job) for job in jobs))

    def _queue(self) -> str | None:
        """The queue of the batch running, as text."""
        queue = self.queue
        return queue.decode() if isinstance(queue, bytes) else queue

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
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None


_warned_thread_timeout = False


def _warn_thread_timeout() -> None:
    global _warned_thread_timeout
    _warned_thread_timeout = True
    logger.warning(
        "this worker runs off the main thread, so sync handlers' timeouts cannot interrupt"
        " them (SIGALRM); async handlers' timeouts still apply"
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
