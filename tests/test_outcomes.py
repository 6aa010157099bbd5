"""Outcomes: each lands on the attempt that produced it, none can kill a worker, cancellation sticks.

The batch statement (sql.job_finish_claim_many) applies an outcome only while
the row still runs that attempt for this worker; a stale one is dropped and
logged. An outcome PostgreSQL or orjson would reject (NUL, lone surrogates,
delays beyond timestamptz, a misbehaving retry policy) is made safe before it
is written, and one that is rejected anyway is isolated: that job gets a
failure of fastjobs's own, the others keep theirs, the worker runs on.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import fastjobs
from fastjobs import App, control, handlers, stats
from fastjobs.abc import OUTCOMES
from fastjobs.errors import Cancel, Retry, Snooze

from .helpers import batch_loop, drain, jobs, notifications, query, run_one_batch

WORKER = "outcomes-test-worker"
YEAR = 365 * 24 * 3600


def _row(dsn: str, job_id: int) -> dict[str, Any]:
    rows = query(
        dsn,
        """SELECT state::text AS state, attempt, attempted_by, errors, run_at, crashes, finalized_at,
                  cancel_requested, extract(epoch FROM run_at - now())::float8 AS run_in,
                  extract(epoch FROM run_at - (errors->-1->>'at')::timestamptz)::float8 AS run_after_error
             FROM fastjobs_jobs_all WHERE id = %s""",
        (job_id,),
    )
    assert rows, f"job {job_id} is gone"
    return rows[0]


def _errors(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(row["errors"] or [])


# --- 1. an outcome applies only to the attempt that produced it --------------------------------

# How the job's row is taken from the running attempt 1 while its handler runs.
TAKEOVERS = {
    # The rescuer: back to retryable (attempt and worker unchanged: only the state tells).
    "rescued": "state = 'retryable', crashes = crashes + 1, run_at = now() + interval '1 hour'",
    # Rescued, then claimed as attempt 2 by another worker, which runs it now.
    "claimed-by-another": "attempt = attempt + 1, attempted_by = 'another-worker', attempted_at = now()",
    # Rescued, then claimed as attempt 2 by this same worker (say, in a later batch).
    "claimed-again-here": "attempt = attempt + 1, attempted_at = now()",
    # Another worker holds it at the same attempt number (written by hand).
    "held-by-another": "attempted_by = 'another-worker'",
}


# The state each late outcome asked for, as the worker's log line names it.
STALE_STATES = {
    "success": "completed",
    "failure": "retryable",
    "retry": "available",
    "snooze": "available",
    "cancel": "cancelled",
}


def _late(outcome: str) -> None:
    if outcome == "failure":
        raise ValueError("late failure")
    if outcome == "retry":
        raise Retry(0)
    if outcome == "snooze":
        raise Snooze(0)
    if outcome == "cancel":
        raise Cancel("late cancel")


@pytest.mark.parametrize("takeover", list(TAKEOVERS))
@pytest.mark.parametrize("outcome", ["success", "failure", "retry", "snooze", "cancel"])
def test_a_late_outcome_of_an_attempt_whose_row_was_taken_is_dropped(
    app: App, dsn: str, caplog: pytest.LogCaptureFixture, takeover: str, outcome: str
) -> None:
    taken: list[dict[str, Any]] = []

    @app.job(kind="slow")
    def slow(n: int) -> None:
        if taken:  # run again: the late outcome was applied (the test fails below)
            return
        query(dsn, f"UPDATE fastjobs_jobs_all SET {TAKEOVERS[takeover]} WHERE id = %s", (job_id,))
        taken.append(_row(dsn, job_id))
        _late(outcome)

    job_id = app.enqueue("slow", {"n": 1})
    worker = drain(app, worker_id=WORKER)

    [before] = taken
    assert before["state"] in ("running", "retryable")
    assert _row(dsn, job_id) == {**before, "run_in": pytest.approx(before["run_in"], abs=5)}
    assert worker.loop is not None
    assert worker.loop.stale == 1
    [record] = [r for r in caplog.records if "stale outcome" in r.getMessage()]
    stale = f"dropped the stale outcome ({STALE_STATES[outcome]}) of job {job_id} attempt 1:"
    assert stale in record.getMessage()
    fields = [getattr(record, name) for name in ("levelname", "job_id", "attempt", "worker")]
    assert fields == ["WARNING", job_id, 1, WORKER]


@pytest.mark.parametrize("keep_completed", [False, True], ids=["delete", "keep"])
@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.parametrize("takeover", ["rescued", "claimed-by-another"])
def test_a_late_success_is_dropped_at_any_attempt_whether_completed_jobs_are_kept_or_not(
    app: App, dsn: str, keep_completed: bool, attempt: int, takeover: str
) -> None:
    """Completions of a first attempt travel as bare ids, those of later ones as outcome records."""
    taken: list[dict[str, Any]] = []

    @app.job(kind="slow")
    def slow() -> None:
        if len(taken) or fastjobs.current_job().attempt < attempt:  # type: ignore[union-attr]
            raise Retry(0)
        query(dsn, f"UPDATE fastjobs_jobs_all SET {TAKEOVERS[takeover]} WHERE id = %s", (job_id,))
        taken.append(_row(dsn, job_id))

    job_id = app.enqueue("slow")
    # The state lane's guards: on the fast lane nothing can take a job while it runs (its row is
    # locked until its batch commits), and this handler's UPDATE of its own row would wait for that.
    worker = drain(app, worker_id=WORKER, keep_completed=keep_completed, fast_lane=False)
    [before] = taken
    if takeover == "rescued":
        expected = ("retryable", attempt, WORKER)
    else:
        expected = ("running", attempt + 1, "another-worker")
    assert (before["state"], before["attempt"], before["attempted_by"]) == expected
    assert _row(dsn, job_id) == {**before, "run_in": pytest.approx(before["run_in"], abs=5)}
    assert worker.loop is not None
    assert (worker.loop.stale, worker.loop.completed) == (1, 0)


def test_a_stale_release_is_dropped(app: App, dsn: str) -> None:
    """A job claimed in a batch, taken while the batch's first job runs, then given back on a stop."""
    ran: list[str] = []
    holder: list[Any] = []

    @app.job(kind="first")
    def first() -> None:
        ran.append("first")
        query(dsn, f"UPDATE fastjobs_jobs_all SET {TAKEOVERS['claimed-by-another']} WHERE id = %s", (second,))
        holder[0].stopping = True

    @app.job(kind="second")
    def second_job() -> None:
        ran.append("second")

    app.enqueue("first")
    second = app.enqueue("second")
    with batch_loop(app, 2, overlap=False) as loop:
        holder.append(loop)
        assert loop.step() == 2
        loop.finish()
    assert ran == ["first"]
    row = _row(dsn, second)
    assert (row["state"], row["attempt"], row["attempted_by"]) == ("running", 2, "another-worker")
    assert loop.stale == 1


def test_outcomes_of_the_attempt_that_holds_the_row_still_apply(app: App, dsn: str) -> None:
    """The guard drops only stale outcomes: a batch of fresh ones applies whole, none reported stale."""

    runs: Counter[str] = Counter()

    @app.job(kind="mixed", retry=lambda attempt, jitter: 3600)  # the drain must not meet it again
    def mixed(what: str) -> None:
        runs[what] += 1
        if runs[what] == 1:  # Retry(0) and Snooze(0) run again at once: the second run succeeds
            _late(what)

    for what in ["success", "failure", "retry", "snooze", "cancel"]:
        mixed.enqueue(what=what)
    worker = drain(app, worker_id=WORKER, keep_completed=True)
    assert worker.loop is not None
    assert worker.loop.stale == 0
    assert [(row["args"]["what"], row["state"], row["attempt"]) for row in jobs(dsn)] == [
        ("success", "completed", 1),
        ("failure", "retryable", 1),
        ("retry", "completed", 2),
        ("snooze", "completed", 1),
        ("cancel", "cancelled", 1),
    ]


# --- 2. no outcome can kill a worker ---------------------------------------------------------------


@pytest.fixture
def ok_and_bad(app: App) -> Iterator[list[int]]:
    """An `ok` kind that records its runs; tests enqueue a bad job between two good ones."""
    runs: list[int] = []
    app.job(kind="ok")(lambda n: runs.append(n))
    yield runs


def _around(app: App, bad: str, args: dict[str, Any] | None = None) -> tuple[int, list[int]]:
    before = app.enqueue("ok", {"n": 1})
    bad_id = app.enqueue(bad, args or {})
    after = app.enqueue("ok", {"n": 2})
    return bad_id, [before, after]


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("a\x00b", "a\\x00b"),
        (os.fsdecode(b"/tmp/caf\xe9"), "/tmp/caf\\udce9"),
    ],
    ids=["nul", "lone-surrogate"],
)
def test_error_text_jsonb_cannot_store_is_escaped(
    app: App, dsn: str, ok_and_bad: list[int], text: str, stored: str
) -> None:
    @app.job(kind="bad")
    def bad() -> None:
        raise FileNotFoundError(text)

    bad_id, good = _around(app, "bad")
    assert run_one_batch(app, 3) == 3  # one run each: a drain would meet the bad job again after ~1 s
    assert sorted(ok_and_bad) == [1, 2]
    row = _row(dsn, bad_id)
    assert (row["state"], row["attempt"]) == ("retryable", 1)
    [error] = _errors(row)
    assert error["error"] == f"FileNotFoundError: {stored}"
    assert stored in error["traceback"]
    assert not query(dsn, "SELECT id FROM fastjobs_jobs_all WHERE id = ANY(%s)", (good,))


DELAYS = [
    # (what the handler raises, state, attempt after, run_in bounds, words of the note)
    (Retry(1e14), "retryable", 1, (YEAR - 60, YEAR), "clamped"),
    (Retry(math.inf), "retryable", 1, (0, 1.2), "not a finite delay"),
    (Retry(math.nan), "retryable", 1, (0, 1.2), "not a finite delay"),
    (Retry(-5), "completed", 2, None, "negative"),
    (Snooze(1e14), "scheduled", 0, (YEAR - 60, YEAR), "clamped"),
    (Snooze(math.inf), "retryable", 1, (0, 1.2), "not a finite delay"),
    (Snooze(math.nan), "retryable", 1, (0, 1.2), "not a finite delay"),
    (Snooze(-1e300), "completed", 1, None, "negative"),
]


@pytest.mark.parametrize(("exc", "state", "attempt", "run_in", "note"), DELAYS, ids=lambda v: repr(v))
def test_delays_are_clamped_or_rejected_and_noted(
    app: App,
    dsn: str,
    ok_and_bad: list[int],
    exc: Exception,
    state: str,
    attempt: int,
    run_in: Any,
    note: str,
) -> None:
    runs: list[int] = []

    @app.job(kind="bad", max_attempts=5)
    def bad() -> None:
        runs.append(1)
        if len(runs) == 1:  # a delay clamped to 0 runs it again at once: then it succeeds
            raise exc

    bad_id, _ = _around(app, "bad")
    began = time.monotonic()
    if run_in == (0, 1.2):
        # One run each: the default backoff (~1 s) is due before a loaded drain ends, which then
        # met the job again.
        assert run_one_batch(app, 3, keep_completed=True) == 3
    else:
        drain(app, keep_completed=True)
    assert sorted(ok_and_bad) == [1, 2]
    row = _row(dsn, bad_id)
    assert (row["state"], row["attempt"]) == (state, attempt)
    if run_in is not None:  # read after the drain: the delay ran on meanwhile
        assert run_in[0] - (time.monotonic() - began) <= row["run_in"] <= run_in[1]
    errors = _errors(row)
    assert errors and note in errors[0]["error"], errors
    assert "[fastjobs: " in errors[0]["error"]


def test_snooze_forever_is_a_counted_failure_and_ends_discarded(app: App, dsn: str) -> None:
    @app.job(kind="nap", max_attempts=1)
    def nap() -> None:
        raise Snooze(math.inf)

    job_id = app.enqueue("nap")
    drain(app)
    row = _row(dsn, job_id)
    assert (row["state"], row["attempt"]) == ("discarded", 1)


def test_a_snooze_with_a_note_on_the_last_attempt_is_not_a_failure(app: App, dsn: str) -> None:
    runs: list[int] = []

    @app.job(kind="nap", max_attempts=1)
    def nap() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise Snooze(-1)  # due at once, noted; the attempt is given back

    job_id = app.enqueue("nap")
    drain(app, keep_completed=True)
    row = _row(dsn, job_id)
    assert (row["state"], row["attempt"], len(runs)) == ("completed", 1, 2)
    assert "negative" in _errors(row)[0]["error"]


def _policy_raises(attempt: int, rand: float) -> float:
    raise ZeroDivisionError("policy bug")


POLICIES = [
    (_policy_raises, (0.85, 1.15), "the retry policy raised ZeroDivisionError: policy bug"),
    (lambda attempt, rand: None, (0.85, 1.15), "the retry policy gave None"),
    (lambda attempt, rand: "5", (0.85, 1.15), "the retry policy gave '5'"),
    (lambda attempt, rand: math.inf, (0.85, 1.15), "not a finite delay"),
    (lambda attempt, rand: 1e14, (YEAR - 60, YEAR), "clamped"),
]


@pytest.mark.parametrize(("policy", "run_in", "note"), POLICIES, ids=["raises", "none", "str", "inf", "huge"])
def test_a_misbehaving_retry_policy_falls_back_to_the_default_backoff(
    app: App, dsn: str, ok_and_bad: list[int], policy: Any, run_in: tuple[float, float], note: str
) -> None:
    @app.job(kind="bad", retry=policy)
    def bad() -> None:
        raise ValueError("boom")

    bad_id, _ = _around(app, "bad")
    assert run_one_batch(app, 3) == 3  # one run each: a drain would meet the bad job again after ~1 s
    assert sorted(ok_and_bad) == [1, 2]
    row = _row(dsn, bad_id)
    assert (row["state"], row["attempt"]) == ("retryable", 1)
    assert run_in[0] - 0.01 <= row["run_after_error"] <= run_in[1] + 0.1  # counted from the failure
    [error] = _errors(row)
    assert error["error"].startswith("ValueError: boom [fastjobs: ")
    assert note in error["error"]


def test_the_default_backoff_of_a_very_late_attempt_stays_within_timestamptz(app: App, dsn: str) -> None:
    """attempt**4 passes timestamptz's end near attempt 1,740: clamped like any other delay."""

    @app.job(kind="bad", max_attempts=30000)
    def bad() -> None:
        raise ValueError("again")

    job_id = app.enqueue("bad")
    query(dsn, "UPDATE fastjobs_jobs_all SET attempt = 5000 WHERE id = %s", (job_id,))
    drain(app)
    row = _row(dsn, job_id)
    assert (row["state"], row["attempt"]) == ("retryable", 5001)
    assert YEAR - 60 <= row["run_in"] <= YEAR


# Defence in depth: outcomes the sanitising missed, or rows PostgreSQL refuses to change.


def test_a_statement_postgresql_rejects_is_written_outcome_by_outcome(
    app: App, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the sanitiser disabled, a NUL reaches PostgreSQL and fails the whole statement:
    the bad job gets fastjobs's own failure record, every other outcome and claim survives."""
    monkeypatch.setattr(handlers, "clean", lambda text: text)
    runs: Counter[int] = Counter()

    @app.job(kind="job")
    def job(n: int) -> None:
        runs[n] += 1
        if n == 5:
            raise ValueError("nul \x00 here")
        if n == 7:
            raise RuntimeError("an ordinary failure")

    ids = {n: app.enqueue("job", {"n": n}) for n in range(20)}
    # The state lane's isolation (on the fast lane the batch rolls back first: test_fast_lane),
    # in one batch: a drain would meet jobs 5 and 7 again once their ~1 s backoff ends.
    assert run_one_batch(app, 20) == 20
    assert runs == Counter(range(20)), "a job was lost or ran twice"
    rows = {row["id"]: row for row in jobs(dsn)}
    assert set(rows) == {ids[5], ids[7]}
    bad = rows[ids[5]]
    assert (bad["state"], bad["attempt"]) == ("retryable", 1)
    [error] = _errors(bad)
    assert error["error"].startswith("fastjobs could not record this attempt's outcome (retryable): ")
    assert "\x00" not in error["error"]
    assert _errors(rows[ids[7]])[0]["error"] == "RuntimeError: an ordinary failure"
    assert f"the outcome of job {ids[5]} attempt 1 could not be recorded" in caplog.text


def test_outcomes_orjson_cannot_encode_are_replaced(
    app: App, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handlers, "clean", lambda text: text)
    runs: list[int] = []

    @app.job(kind="job")
    def job(n: int) -> None:
        runs.append(n)
        if n == 1:
            raise ValueError(os.fsdecode(b"\xff"))

    ids = [app.enqueue("job", {"n": n}) for n in range(3)]
    # One batch: the record fastjobs writes in place of the outcome it could not is retried after
    # the default backoff (~1 s, not the kind's policy), and a drain on a loaded machine met it again.
    assert run_one_batch(app, 3) == 3
    assert sorted(runs) == [0, 1, 2]
    [row] = jobs(dsn)
    assert (row["id"], row["state"], row["attempt"]) == (ids[1], "retryable", 1)
    assert _errors(row)[0]["error"].startswith(
        "fastjobs could not record this attempt's outcome (retryable, "
    )


def _reject(dsn: str, condition: str, event: str = "UPDATE") -> None:
    """A trigger that makes PostgreSQL refuse a change of the jobs table (a row it cannot take)."""
    query(
        dsn,
        """CREATE FUNCTION reject() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'this row refuses the change'; END $$""",
    )
    query(
        dsn,
        f"CREATE TRIGGER reject BEFORE {event} ON fastjobs_jobs_all FOR EACH ROW WHEN ({condition})"
        " EXECUTE FUNCTION reject()",
    )


def test_a_completion_postgresql_rejects_becomes_a_failure(app: App, dsn: str) -> None:
    runs: Counter[int] = Counter()
    app.job(kind="job")(lambda n: runs.update([n]))
    ids = {n: app.enqueue("job", {"n": n}) for n in range(6)}
    _reject(dsn, f"OLD.id = {ids[3]}", "DELETE")
    # The state lane's isolation (see test_fast_lane for the fast one's); one batch, as a drain
    # would meet the failed job again after its 1-s backoff on a loaded machine.
    assert run_one_batch(app, 6, fast_lane=False) == 6
    assert runs == Counter(range(6))
    [row] = jobs(dsn)
    assert (row["id"], row["state"], row["attempt"]) == (ids[3], "retryable", 1)
    assert _errors(row)[0]["error"].startswith(
        "fastjobs could not record this attempt's outcome (completed): "
    )


def test_a_job_that_cannot_even_take_an_error_is_discarded(app: App, dsn: str) -> None:
    @app.job(kind="job")
    def job(n: int) -> None:
        if n == 1:
            raise ValueError("x")

    ids = [app.enqueue("job", {"n": n}) for n in range(3)]
    _reject(dsn, f"OLD.id = {ids[1]} AND NEW.errors IS DISTINCT FROM OLD.errors")
    drain(app)
    [row] = jobs(dsn)
    assert (row["id"], row["state"], row["errors"]) == (ids[1], "discarded", None)
    assert row["finalized_at"] is not None


def test_a_row_that_refuses_every_change_is_left_to_the_rescuer(
    app: App, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    @app.job(kind="job")
    def job(n: int) -> None:
        raise ValueError("x")

    ids = [app.enqueue("job", {"n": n}, max_attempts=1) for n in range(3)]
    _reject(dsn, f"OLD.id = {ids[1]} AND NEW.state <> 'running'")
    drain(app)
    states = {row["id"]: row["state"] for row in jobs(dsn)}
    assert states == {ids[0]: "discarded", ids[1]: "running", ids[2]: "discarded"}
    assert f"no record of job {ids[1]} attempt 1 could be written" in caplog.text


# --- 3. cancellation sticks -----------------------------------------------------------------------


def test_a_job_cancelled_while_claimed_is_cancelled_when_the_stopping_worker_gives_it_back(
    app: App, dsn: str
) -> None:
    ran: list[str] = []
    holder: list[Any] = []

    @app.job(kind="first")
    def first() -> None:
        ran.append("first")
        assert app.cancel(second) == "cancelling"
        holder[0].stopping = True  # the worker stops before the executor hears of the cancel

    @app.job(kind="second")
    def second_job() -> None:
        ran.append("second")

    app.enqueue("first")
    second = app.enqueue("second")
    with batch_loop(app, 2, overlap=False) as loop:
        holder.append(loop)
        assert loop.step() == 2
        loop.finish()
    assert ran == ["first"]
    row = _row(dsn, second)
    assert (row["state"], row["attempt"]) == ("cancelled", 0)
    assert row["finalized_at"] is not None
    assert "cancellation requested" in _errors(row)[0]["error"]
    drain(app)
    assert ran == ["first"]


@pytest.mark.parametrize("outcome", ["failure", "retry", "snooze"])
def test_a_job_that_fails_after_a_cancel_request_ends_cancelled(app: App, dsn: str, outcome: str) -> None:
    ran: list[int] = []

    @app.job(kind="job")
    def job() -> None:
        ran.append(1)
        assert app.cancel(job_id) == "cancelling"
        _late(outcome)

    job_id = app.enqueue("job")
    # The loop alone, without the control thread: the worker never hears of the cancel.
    with batch_loop(app, 1, overlap=False) as loop:
        assert loop.step() == 1
        loop.finish()
    row = _row(dsn, job_id)
    assert row["state"] == "cancelled"
    assert row["finalized_at"] is not None
    drain(app)
    assert ran == [1]


# --- 4. outcomes that make a job available wake the workers -----------------------------------------


def test_retry_and_snooze_without_delay_notify_their_queue_once_per_statement(
    app: App, dsn: str, listener: psycopg.Connection[Any]
) -> None:
    @app.job(kind="again", queue="alpha")
    def again(what: str) -> None:
        raise Retry(0) if what == "retry" else Snooze(0)

    @app.job(kind="later", queue="beta")
    def later() -> None:
        raise Retry(60)

    for what in ("retry", "snooze", "retry"):
        again.enqueue(what=what)
    later.enqueue()
    assert notifications(listener, dsn) == {"alpha": 3, "beta": 1}  # the enqueues
    with batch_loop(app, 3, overlap=False, queues=["alpha"]) as loop:
        assert loop.step() == 3
        loop.stopping = True
        loop.finish()
    with batch_loop(app, 1, overlap=False, queues=["beta"]) as loop:
        assert loop.step() == 1
        loop.stopping = True
        loop.finish()
    assert notifications(listener, dsn) == {"alpha": 1}


def test_jobs_given_back_by_a_stopping_worker_notify_their_queue(
    app: App, dsn: str, listener: psycopg.Connection[Any]
) -> None:
    holder: list[Any] = []

    @app.job(kind="job", queue="gamma")
    def job(n: int) -> None:
        holder[0].stopping = True

    for n in range(3):
        app.enqueue("job", {"n": n}, queue="gamma")
    assert notifications(listener, dsn) == {"gamma": 3}
    with batch_loop(app, 3, overlap=False, queues=["gamma"]) as loop:
        holder.append(loop)
        assert loop.step() == 3
        loop.finish()
    assert notifications(listener, dsn) == {"gamma": 1}
    assert Counter(row["state"] for row in jobs(dsn)) == {"available": 2}


def test_jobs_retry_notifies_the_queue(app: App, dsn: str, listener: psycopg.Connection[Any]) -> None:
    app.job(kind="job", queue="delta")(lambda: None)
    job_id = app.enqueue("job", queue="delta")
    drain(app, keep_completed=True)
    assert notifications(listener, dsn) == {"delta": 1}  # the enqueue
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert control.retry(conn, job_id).state == "available"
    assert notifications(listener, dsn) == {"delta": 1}


def test_every_outcome_record_says_what_it_is() -> None:
    """A record's `outcome` names what happened, and the counters and the fast lane read that, not
    its shape: a release and a Snooze(0) both give their attempt back with no error, but only the
    release is left out of a fast batch's writes and counted nowhere."""
    records = {
        "completed": handlers.completed(1, 2),
        "retried": handlers.failure(None, 2, 1, 5, ValueError("boom")),
        "discarded": handlers.failure(None, 3, 5, 5, ValueError("boom")),
        "cancelled": handlers.failure(None, 4, 1, 5, Cancel("no")),
        "snoozed": handlers.failure(None, 5, 1, 5, Snooze(0)),
        "released": handlers.release(6, 1),
    }
    assert {name: record["outcome"] for name, record in records.items()} == {name: name for name in records}
    snoozed, released = records["snoozed"], records["released"]
    assert (snoozed["state"], snoozed["delay"], snoozed["uncount"], snoozed["error"]) == (
        "available",
        0,
        1,
        None,
    )
    assert (released["state"], released["delay"], released["uncount"], released["error"]) == (
        "available",
        None,
        1,
        None,
    )
    assert handlers.started(list(records.values())) == [r for r in records.values() if r is not released]
    columns = {name: stats.outcome_column(record) for name, record in records.items()}
    assert columns == {**{name: OUTCOMES.index(name) for name in OUTCOMES}, "released": -1}
    assert handlers.unrecorded(7, 1, "x", "y")["outcome"] == "retried"
    assert handlers.unrecorded(7, 1, "x", "y", last=True)["outcome"] == "discarded"
