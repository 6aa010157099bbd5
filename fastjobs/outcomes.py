"""What a handler's run becomes: the outcome records a batch statement writes back, and their logs.

The hot loop calls plain `def` handlers inline and fastjobs.executor runs
the slower ones; every exception becomes a record here, which the batch
statement (sql.job_finish_claim_many) writes back.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson

from .context import _thread
from .errors import Cancel, InvalidArguments, Retry, Snooze
from .logs import duration, job_fields
from .retry import default_backoff
from .types import JobSpec, Outcome, OutcomeKind

__all__ = [
    "ERROR_CHARS",
    "MAX_DELAY",
    "OUTCOME_ERROR_CLASSES",
    "STALE_LINES",
    "SlowJob",
    "Write",
    "cancelled",
    "clean",
    "completed",
    "discard",
    "encode",
    "failure",
    "isolate",
    "kept",
    "release",
    "returned_coroutine",
    "say_rolled_back",
    "say_stale",
    "started",
    "tally",
    "unknown_kind",
    "unrecorded",
]

if TYPE_CHECKING:
    pass

logger = logging.getLogger("fastjobs.handlers")  # the name users filter on (docs/operations/monitoring.md)


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
