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
import logging
import math
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

import orjson

from .errors import Cancel, InvalidArguments, JobTimeout, Retry, Snooze
from .logs import duration, job_fields
from .retry import default_backoff
from .types import JobSpec, Outcome, OutcomeKind

if TYPE_CHECKING:
    from .pool import Pool

logger = logging.getLogger(__name__)


# One job handed to the slow path: (spec, id, args, attempt, max_attempts, claimed),
# `claimed` being what a loop claiming with context (the app has middleware)
# read for its JobContext: (meta, enqueued, scheduled); None otherwise.
SlowJob = tuple[JobSpec, int, dict[str, Any], int, int, "tuple[dict[str, Any], int, int] | None"]


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


# The longest delay an outcome may set (Retry, Snooze, a retry= policy, the
# default backoff past attempt ~1,700): a year. Far beyond any sane backoff
# (the default's 25th attempt waits 4.5 days), so a longer one is almost
# surely a unit slip (milliseconds for seconds) or a runaway policy; a job
# meant for a date that far off is better enqueued with run_at. It also keeps
# run_at inside timestamptz (which ends in 294276 AD: a delay of 1e14 s would
# fail the whole batch statement). A clamped delay is noted in the job's error.
MAX_DELAY = 365 * 24 * 3600.0


def _message(exc: BaseException) -> str:
    """`Type: message`, even for an exception whose __str__ raises (which would kill the worker)."""
    try:
        message = str(exc)
    except Exception as failed:
        message = f"<exception str() failed: {type(failed).__name__}>"
    return f"{type(exc).__name__}: {message}"


def clean(text: str) -> str:
    """`text` as jsonb can store it: NUL written as `\\x00`, lone surrogates (a file name
    from os.fsdecode) as `\\udcXX`. Either would fail the batch statement or its encoding."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode()
    return text


def _traceback(exc: BaseException) -> str:
    try:
        return _bounded(clean("".join(traceback.format_exception(exc))), keep_end=True)
    except Exception as failed:  # a broken exception object must not kill the worker
        return f"<traceback could not be formatted: {type(failed).__name__}>"


def _error(
    attempt: int, exc: BaseException | str, with_traceback: bool = True, note: str | None = None
) -> dict[str, Any]:
    """One attempt's error record; `note` (what fastjobs changed: a clamped delay) follows the message.
    An exception's record names its class (`module.qualname`) too."""
    if isinstance(exc, str):
        text, trace = exc, None
    else:
        text = _message(exc)
        trace = _traceback(exc) if with_traceback else None
    text = _bounded(clean(text))
    if note is not None:
        text = f"{text} [fastjobs: {clean(note)}]"
    at = dt.datetime.now(dt.UTC).isoformat()
    record = {"at": at, "attempt": attempt, "error": text, "traceback": trace}
    if not isinstance(exc, str):
        record["class"] = clean(f"{type(exc).__module__}.{type(exc).__qualname__}")
    return record


def _outcome(
    outcome: OutcomeKind,
    job_id: int,
    attempt: int,
    state: str,
    *,
    delay: float | None = None,
    uncount: int = 0,
    error: dict[str, Any] | None = None,
) -> Outcome:
    """One record of the batch statement's outcomes (see Outcome)."""
    return {
        "outcome": outcome,
        "id": job_id,
        "attempt": attempt,
        "state": state,
        "delay": delay,
        "uncount": uncount,
        "error": error,
    }


def _delay(value: Any, what: str) -> tuple[float | None, str | None]:
    """(seconds, note): a delay within [0, MAX_DELAY], or None when `value` is no delay at all.

    The note says what was changed or rejected, for the job's error.
    """
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if value is None or isinstance(value, str | bytes):
        return None, f"{what} gave {value!r}, not a number of seconds"
    try:
        seconds = float(value)
    except Exception:
        return None, f"{what} gave {_repr(value)}, not a number of seconds"
    if not math.isfinite(seconds):
        return None, f"{what} gave {seconds!r} seconds, not a finite delay"
    if seconds < 0:
        return 0.0, f"{what} gave a negative delay ({seconds:g} s): due at once"
    if seconds > MAX_DELAY:
        return (
            MAX_DELAY,
            f"{what} gave {seconds:g} s, more than the maximum delay: clamped to {MAX_DELAY:g} s",
        )
    return seconds, None


def _repr(value: Any) -> str:
    try:
        return _bounded(repr(value))
    except Exception:
        return f"<{type(value).__name__}>"


def _backoff(spec: JobSpec | None, attempt: int) -> tuple[float, str | None]:
    """The retry policy's delay after failed attempt `attempt`, falling back to the default with a note."""
    policy = spec.retry if spec is not None and spec.retry is not None else default_backoff
    try:
        delay, note = _delay(policy(attempt, random.random()), "the retry policy")
    except Exception as exc:
        delay, note = None, f"the retry policy raised {_message(exc)}"
    if delay is None:
        fallback, clamped = _delay(default_backoff(attempt, random.random()), "the default backoff")
        assert fallback is not None
        return fallback, f"{note}; the default backoff applied" + (f" ({clamped})" if clamped else "")
    return delay, note


def failure(
    spec: JobSpec | None, job_id: int, attempt: int, max_attempts: int, exc: BaseException | str
) -> Outcome:
    """The outcome of an attempt that raised `exc` (or failed for the reason `exc`), logged."""
    outcome = _failure(spec, job_id, attempt, max_attempts, exc)
    _say_outcome(outcome, spec.kind if spec is not None else None, exc)
    return outcome


def _say_outcome(outcome: Outcome, kind: str | None, exc: BaseException | str | None = None) -> None:
    """Log a failed, snoozed or cancelled attempt, with the job's fields (on the failure path only).

    A failure is a WARNING while the job will be retried and an ERROR once it
    is discarded, with the exception attached (`exc_info`) and the job's
    fields as the record's attributes: what error trackers' logging
    integrations (Sentry's among them) turn into an event with its context.
    Retry and Snooze, asked for by the handler, carry no exception, nor does
    the SystemExit or KeyboardInterrupt that stops a worker.
    """
    what, error = outcome["outcome"], outcome["error"]
    if what == "snoozed":
        level, text = logging.DEBUG, f"snoozed for {duration(outcome['delay'] or 0.0)}"
    elif what == "cancelled":
        level, text = logging.INFO, "cancelled"
    elif what == "discarded":
        level, text = logging.ERROR, "failed; discarded"
    else:
        level, text = logging.WARNING, f"failed; retrying in {duration(outcome['delay'] or 0.0)}"
    if not logger.isEnabledFor(level):
        return
    fields = _job_fields(outcome["id"], outcome["attempt"], kind, of_batch=True)
    why = f": {error['error']}" if error is not None else ""
    # Retry, Snooze, Cancel: asked for by the handler; SystemExit, KeyboardInterrupt: the
    # worker stopping. Neither is an error to report with its traceback.
    asked = isinstance(exc, Retry | Snooze | Cancel)
    attached = exc if isinstance(exc, Exception) and not asked else None
    logger.log(
        level,
        "job %d (%s) attempt %d %s%s",
        outcome["id"],
        kind,
        outcome["attempt"],
        text,
        why,
        exc_info=attached,
        extra=fields,
    )


def _job_fields(job_id: int, attempt: int, kind: str | None = None, of_batch: bool = False) -> dict[str, Any]:
    """The record fields of a job of this thread's worker; `of_batch`: of the batch running, its queue."""
    executor = getattr(_thread, "executor", None)
    queue = getattr(executor, "queue", None) if of_batch else None
    if isinstance(queue, bytes):
        queue = queue.decode()
    return job_fields(job_id, kind, queue, attempt, getattr(executor, "worker", None))


def _failure(
    spec: JobSpec | None, job_id: int, attempt: int, max_attempts: int, exc: BaseException | str
) -> Outcome:
    """The outcome of an attempt that raised `exc` (or failed for the reason `exc`).

    No value a handler or policy returns can make this fail or produce an
    outcome the batch statement rejects: delays are clamped into
    [0, MAX_DELAY], one that is no number at all (None, NaN, infinity) fails
    the attempt with the default backoff, and either is noted in the error.
    """
    note = None
    if isinstance(exc, Snooze):
        delay, note = _delay(exc.delay, "Snooze")
        if delay is not None:
            state = "scheduled" if delay > 0 else "available"
            error = None if note is None else _error(attempt, exc, with_traceback=False, note=note)
            return _outcome("snoozed", job_id, attempt, state, delay=delay, uncount=1, error=error)
        # Snooze(inf) or NaN is no delay: it fails the attempt (counted), so it cannot rerun forever.
    if isinstance(exc, Cancel):
        return _outcome(
            "cancelled", job_id, attempt, "cancelled", error=_error(attempt, f"Cancel: {exc.reason}")
        )
    quiet = isinstance(exc, Retry | Snooze | InvalidArguments)  # asked for, or no fault of code: no traceback
    if attempt >= max_attempts or isinstance(exc, InvalidArguments):  # args that never convert
        return _outcome(
            "discarded", job_id, attempt, "discarded", error=_error(attempt, exc, not quiet, note)
        )
    delay = None
    if isinstance(exc, Retry):
        delay, note = _delay(exc.delay, "Retry")
    if delay is None:
        if note is None:  # a plain failure: the job's policy
            delay, note = _backoff(spec, attempt)
        else:  # Retry or Snooze that gave no delay
            delay, clamped = _backoff(None, attempt)
            note = f"{note}; the default backoff applied" + (f" ({clamped})" if clamped else "")
    error = _error(attempt, exc, not quiet, note)
    state = "retryable" if delay > 0 else "available"
    return _outcome("retried", job_id, attempt, state, delay=delay, error=error)


def discard(job_id: int, attempt: int, reason: str) -> Outcome:
    """A job that can never succeed (its args do not decode): discarded at once."""
    outcome = _outcome("discarded", job_id, attempt, "discarded", error=_error(attempt, reason))
    _say_outcome(outcome, None)
    return outcome


def unknown_kind(
    job_id: int, kind: str, attempt: int, max_attempts: int, specs: Iterable[JobSpec] = ()
) -> Outcome:
    """A kind this worker has no handler for: retried, since another deploy may have it.

    `specs` are the worker's handlers: the error names their modules, the
    ones its application imported, which is where the missing one was expected.
    """
    modules = sorted({getattr(spec.func, "__module__", None) or "?" for spec in specs})
    where = f"the modules {', '.join(modules)}" if modules else "no module (it has no handlers)"
    then = (
        "It had no attempts left: discarded (give the kind max_attempts > 1 to ride out a rolling deploy)"
        if attempt >= max_attempts
        else "Retried meanwhile: a rolling deploy may bring the handler"
    )
    reason = (
        f"no handler registered for job kind {kind!r}: this worker's handlers come from {where};"
        " register one with @app.job in a module the worker imports (the one `fastjobs run` names,"
        f" or one that module imports). {then}"
    )
    outcome = _failure(None, job_id, attempt, max_attempts, reason)
    _say_outcome(outcome, kind)
    return outcome


def completed(job_id: int, attempt: int) -> Outcome:
    """A job completed at an attempt other than its first (the first's travel as bare ids)."""
    return _outcome("completed", job_id, attempt, "completed")


def kept(spec: JobSpec, job_id: int, attempt: int, max_attempts: int, value: Any) -> Outcome:
    """A job enqueued with keep_result completed, returning `value`: its record carries the value as
    JSON (the finish statement keeps it in fastjobs_results). A value orjson cannot encode fails the
    attempt instead, retried as any failure, with a message naming the job, its kind and the type."""
    try:
        data = orjson.dumps(value)
    except Exception as exc:
        reason = (
            f"job {job_id} ({spec.kind}) returned a {type(value).__module__}.{type(value).__qualname__}"
            f" that keep_result cannot store as JSON: {_message(exc)}"
        )
        return failure(spec, job_id, attempt, max_attempts, reason)
    outcome = _outcome("completed", job_id, attempt, "completed")
    outcome["result"] = orjson.Fragment(data)
    return outcome


def release(job_id: int, attempt: int = 0) -> Outcome:
    """A claimed job that never started (shutdown, or the batch was aborted): available again, uncounted.

    Attempt 0 means the caller did not know it: the hot loop fills it in
    from the batch before the outcome is written.
    """
    return _outcome("released", job_id, attempt, "available", uncount=1)


def started(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes but releases: on the fast lane an unstarted job's row is left as it was."""
    return [o for o in outcomes if o["outcome"] != "released"]


def cancelled(job_id: int, attempt: int) -> Outcome:
    """A job whose cancellation was requested while it was claimed or running."""
    return _outcome(
        "cancelled",
        job_id,
        attempt,
        "cancelled",
        error=_error(attempt, "Cancel: cancellation requested while it was running"),
    )


def unrecorded(job_id: int, attempt: int, what: str, reason: str, last: bool = False) -> Outcome:
    """The stand-in for an outcome the batch statement rejected (or orjson could not encode).

    A failed attempt with a minimal error of fastjobs's own, retried with the
    default backoff (the statement discards it if it was the last attempt);
    with `last`, the final fallback: discarded, no error appended.
    """
    if last:
        return _outcome("discarded", job_id, attempt, "discarded")
    message = f"fastjobs could not record this attempt's outcome ({clean(what)}): {clean(reason)}"
    error = {
        "at": dt.datetime.now(dt.UTC).isoformat(),
        "attempt": attempt,
        "error": _bounded(message.encode("ascii", "backslashreplace").decode()),
        "traceback": None,
    }
    delay, _ = _delay(default_backoff(attempt, random.random()), "the default backoff")
    return _outcome("retried", job_id, attempt, "retryable", delay=delay, error=error)


def tally(outcomes: list[Outcome]) -> tuple[int, int, int, int]:
    """(completed, failed, retried, discarded) among outcomes: failed attempts are those with an error.

    Snoozes and releases give their attempt back: not failures, even with a note.
    """
    done = failed = retried = discarded = 0
    for outcome in outcomes:
        if outcome["error"] is None or outcome["uncount"]:
            done += outcome["state"] == "completed"
            continue
        failed += 1
        if outcome["state"] == "discarded":
            discarded += 1
        elif outcome["state"] in ("retryable", "available"):
            retried += 1
    return done, failed, retried, discarded


def encode(outcomes: list[Outcome]) -> bytes:
    """The outcomes as the batch statement's JSON; one orjson cannot encode is replaced by its stand-in."""
    try:
        return orjson.dumps(outcomes)
    except Exception as exc:
        reason = _message(exc)
    kept = []
    for outcome in outcomes:
        try:
            orjson.dumps(outcome)
        except Exception:
            _say_rejected(outcome["id"], outcome["attempt"], reason)
            outcome = unrecorded(
                outcome["id"], outcome["attempt"], f"{outcome['state']}, unencodable", reason
            )
        kept.append(outcome)
    return orjson.dumps(kept)


# SQLSTATE classes an outcome can cause (data exception, integrity, program
# limit such as jsonb's size, an exception raised by a trigger): a statement
# failing with one of these is retried outcome by outcome. Any other error
# (the connection, a deadlock, a cancelled query) is the loop's to raise.
OUTCOME_ERROR_CLASSES = frozenset({"22", "23", "54", "P0"})

# The most lines a worker prints about stale outcomes per statement; the rest are counted.
STALE_LINES = 10

# Writes some outcomes alone (no claim): the ids of jobs completed at their
# first attempt, and outcome records. None, or the error of an outcome
# (OUTCOME_ERROR_CLASSES); any other error it raises.
Write = Callable[[list[int], list[Outcome]], "str | None"]


def isolate(write: Write, completed: list[int], failures: list[Outcome], reason: str) -> None:
    """Write the outcomes of a batch statement PostgreSQL rejected with `reason`, isolating the bad ones.

    Halves are written alone (a bad outcome costs about 2 log2(n) small
    statements, on this error path only); a rejected single outcome is
    replaced by `unrecorded`, then by its last fallback (discarded, no error),
    and if even that is rejected it is left running for the rescuer.
    """
    items: list[int | Outcome] = [*completed, *failures]

    def written(part: list[int | Outcome]) -> str | None:
        done = [item for item in part if isinstance(item, int)]
        return write(done, [item for item in part if not isinstance(item, int)])

    def settle(part: list[int | Outcome], reason: str) -> None:
        if len(part) > 1:
            middle = len(part) // 2
            for half in (part[:middle], part[middle:]):
                error = written(half)
                if error is not None:
                    settle(half, error)
            return
        [item] = part
        job_id, attempt = (item, 1) if isinstance(item, int) else (item["id"], item["attempt"])
        what = "completed" if isinstance(item, int) else str(item["state"])
        _say_rejected(job_id, attempt, reason)
        for last in (False, True):
            error = write([], [unrecorded(job_id, attempt, what, reason, last=last)])
            if error is None:
                return
            reason = error
        logger.error(
            "no record of job %d attempt %d could be written (%s);"
            " it stays running until the rescuer takes it",
            job_id,
            attempt,
            reason,
            extra=_job_fields(job_id, attempt),
        )

    settle(items, reason)


def say_rolled_back(count: int, reason: str) -> None:
    """A fast-lane batch's outcomes were rejected: the batch rolled back, its jobs run again."""
    logger.warning(
        "the outcomes of a fast-lane batch (%d jobs) were rejected, so it rolled back and its jobs run"
        " again on the state lane: %s",
        count,
        reason.strip(),
    )


def _say_rejected(job_id: int, attempt: int, reason: str) -> None:
    logger.error(
        "the outcome of job %d attempt %d could not be recorded (%s); recording a failure of its own instead",
        job_id,
        attempt,
        reason.strip(),
        extra=_job_fields(job_id, attempt),
    )


def say_stale(stale: list[tuple[int, int, str]]) -> None:
    """Report outcomes the batch statement dropped: their job no longer runs that attempt here."""
    for job_id, attempt, state in stale[:STALE_LINES]:
        logger.warning(
            "dropped the stale outcome (%s) of job %d attempt %d: the job is no"
            " longer running that attempt on this worker (rescued, or changed by hand)",
            state,
            job_id,
            attempt,
            extra=_job_fields(job_id, attempt),
        )
    if len(stale) > STALE_LINES:
        logger.warning("... and %d more stale outcomes dropped", len(stale) - STALE_LINES)


def returned_coroutine(spec: JobSpec) -> str:
    return f"handler {spec.kind!r} is a plain def that returned a coroutine: declare it `async def`"


_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def _pg_time(micros: int | None) -> dt.datetime | None:
    return None if micros is None else _PG_EPOCH + dt.timedelta(microseconds=micros)


class JobContext:
    """What a running handler and its middleware know of the job: `fastjobs.current_job()`.

    `id`, `kind`, `attempt` and `cancelled` are always set. The rest (queue,
    args, max_attempts, meta, the times) is set only in a worker whose app has
    middleware, and None otherwise: the hot loop would need a wider claim and
    more work per job for them. A sync job's context is updated in place for
    the next job: keep what you need of it, not the object.

    A sync handler that may run long should check `cancelled` now and then
    and return (or raise Cancel) when it turns true.
    """

    __slots__ = (
        "_enqueued",
        "_scheduled",
        "_started",
        "args",
        "attempt",
        "cancelled",
        "id",
        "kind",
        "max_attempts",
        "meta",
        "queue",
    )

    def __init__(self, job_id: int = 0, kind: str = "", attempt: int = 0) -> None:
        self.id = job_id
        self.kind = kind
        self.attempt = attempt
        self.cancelled = False
        self.queue: str | None = None
        self.args: dict[str, Any] | None = None
        self.max_attempts: int | None = None
        self.meta: dict[str, Any] | None = None
        # The claim's binary timestamptz (microseconds since 2000) and time.time(),
        # made datetimes only when read.
        self._enqueued: int | None = None
        self._scheduled: int | None = None
        self._started: float | None = None

    def fill(
        self,
        queue: str | None,
        args: dict[str, Any],
        max_attempts: int,
        claimed: tuple[dict[str, Any], int, int],
    ) -> None:
        """Set the fields a loop claiming with context read (the slow path's; the C loop sets them inline)."""
        self.queue = queue
        self.args = args
        self.max_attempts = max_attempts
        self.meta, self._enqueued, self._scheduled = claimed
        self._started = time.time()

    @property
    def enqueued_at(self) -> dt.datetime | None:
        """When the job was enqueued (its created_at)."""
        return _pg_time(self._enqueued)

    @property
    def scheduled_at(self) -> dt.datetime | None:
        """When this attempt was due (its run_at: the enqueue's, or a retry's or snooze's)."""
        return _pg_time(self._scheduled)

    @property
    def started_at(self) -> dt.datetime | None:
        """When this attempt started, by the worker's clock."""
        return None if self._started is None else dt.datetime.fromtimestamp(self._started, dt.UTC)

    def __repr__(self) -> str:
        return (
            f"<JobContext id={self.id} kind={self.kind!r} attempt={self.attempt} cancelled={self.cancelled}>"
        )


# Each worker thread's executor context (the hot loop updates it in place per
# sync job) and, for async handlers, each task's own.
_thread = threading.local()
_async_job: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("fastjobs_job", default=None)


def bind(executor: Executor, context: JobContext) -> None:
    """Make `context` the calling thread's `current_job()`, and `executor` whose worker and queue
    the records of its jobs carry (_job_fields)."""
    _thread.job = context
    _thread.executor = executor


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
        # The worker's slot (stats.SlowJobs): the jobs whose handlers run now,
        # which alone count a crash if the worker dies.
        self.running: Any = None
        # Set by the thread pool when a job's thread outlived its timeout inside a C call: the
        # worker's control thread then stops beating its slot, so the master replaces it.
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
                    # waiting for a slot go back (uncounted) instead of starting,
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
