"""Failed attempts: backoff, max_attempts, Retry/Snooze/Cancel, per-kind policies, and the scheduler."""

from __future__ import annotations

import datetime as dt
import itertools
import random
import time
from typing import Any

import psycopg
import pytest

from fastjobs import App, maintenance
from fastjobs.errors import Cancel, Retry, Snooze
from fastjobs.retry import JITTER, default_backoff

from .helpers import OVERLAP, drain, jobs, query, run_one_batch

# --- the default policy: a pure function of the attempt and a random number ---


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.5, 0.999999])
def test_first_retry_is_about_a_second(rand):
    assert 0.9 <= default_backoff(1, rand) <= 1.1


@pytest.mark.parametrize("rand", [0.0, 0.5, 0.999999])
def test_third_retry_is_about_81_seconds(rand):
    assert 81 * 0.9 <= default_backoff(3, rand) <= 81 * 1.1


def test_jitter_is_ten_percent_either_way_and_centred():
    assert default_backoff(2, 0.0) == pytest.approx(16 * (1 - JITTER))
    assert default_backoff(2, 0.5) == pytest.approx(16.0)
    assert default_backoff(2, 1.0) == pytest.approx(16 * (1 + JITTER))


@pytest.mark.parametrize("rand", [0.0, 0.3, 0.999999])
def test_backoff_grows_with_the_attempt(rand):
    delays = [default_backoff(attempt, rand) for attempt in range(1, 26)]
    assert all(a < b for a, b in itertools.pairwise(delays))
    assert delays[-1] < 6 * 24 * 3600  # the 25th retry comes within days, not months


def test_backoff_is_pure():
    """attempt**4 scaled by the jitter `rand` picks, and nothing else (no clock, no global random)."""
    first = default_backoff(7, 0.42)
    random.seed(1)
    random.random()
    assert first == default_backoff(7, 0.42) == pytest.approx(2401 * 0.984)
    assert default_backoff(0, 0.5) == default_backoff(1, 0.5) == 1.0  # attempt is clamped to >= 1


# --- exceptions ---


def _errors(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(row["errors"] or [])


@OVERLAP
def test_exception_makes_the_job_retryable_with_backoff_and_its_error(app: App, dsn, overlap):
    @app.job(kind="fail")
    def fail(n: int) -> None:
        raise ValueError(f"bad n {n}")

    fail.enqueue(n=7)
    assert run_one_batch(app, 1, overlap=overlap) == 1  # a drain would meet it again after ~1 s

    [row] = jobs(dsn)
    assert row["state"] == "retryable"
    assert row["attempt"] == 1
    assert row["finalized_at"] is None
    [error] = _errors(row)
    assert error["attempt"] == 1
    assert error["error"] == "ValueError: bad n 7"
    assert "Traceback" in error["traceback"]
    assert "raise ValueError" in error["traceback"]
    assert error["at"]
    # default_backoff(1): 1 s +-10%, counted from the end of the attempt.
    assert 0.9 <= row["delay_after_claim"] <= 1.1 + 0.5
    assert row["run_in"] <= 1.1


@OVERLAP
def test_last_attempt_discards_the_job(app: App, dsn, overlap):
    @app.job(kind="fail", max_attempts=1)
    def fail() -> None:
        raise RuntimeError("always")

    fail.enqueue()
    drain(app, overlap=overlap)

    [row] = jobs(dsn)
    assert row["state"] == "discarded"
    assert row["attempt"] == 1
    assert row["finalized_at"] is not None
    assert [e["error"] for e in _errors(row)] == ["RuntimeError: always"]


@OVERLAP
def test_per_kind_policy_sets_the_delay(app: App, dsn, overlap):
    calls = []

    def policy(attempt: int, rand: float) -> float:
        calls.append((attempt, rand))
        return 1000.0

    @app.job(kind="fail", retry=policy)
    def fail() -> None:
        raise ValueError("x")

    assert app.jobs["fail"].retry is policy
    fail.enqueue()
    began = time.monotonic()
    drain(app, overlap=overlap)

    [row] = jobs(dsn)
    assert row["state"] == "retryable"
    assert 1000 - (time.monotonic() - began) - 0.5 <= row["run_in"] <= 1000  # read after the drain
    [(attempt, rand)] = calls
    assert attempt == 1
    assert 0.0 <= rand < 1.0


@OVERLAP
def test_zero_delay_makes_the_job_available_again(app: App, dsn, overlap):
    @app.job(kind="fail", retry=lambda attempt, rand: 0.0)
    def fail() -> None:
        raise ValueError("x")

    fail.enqueue()
    assert run_one_batch(app, 1, overlap=overlap) == 1

    [row] = jobs(dsn)
    assert row["state"] == "available"
    assert row["attempt"] == 1
    assert len(_errors(row)) == 1


@OVERLAP
def test_every_attempt_is_recorded_until_discarded(app: App, dsn, overlap):
    runs = []

    @app.job(kind="fail", max_attempts=3, retry=lambda attempt, rand: 0.0)
    def fail() -> None:
        runs.append(1)
        raise ValueError(f"attempt {len(runs)}")

    fail.enqueue()
    for _ in range(3):  # one drain per attempt
        drain(app, overlap=overlap)

    [row] = jobs(dsn)
    assert len(runs) == 3
    assert row["state"] == "discarded"
    assert row["attempt"] == 3
    assert [(e["attempt"], e["error"]) for e in _errors(row)] == [
        (1, "ValueError: attempt 1"),
        (2, "ValueError: attempt 2"),
        (3, "ValueError: attempt 3"),
    ]


@OVERLAP
def test_drain_runs_jobs_its_own_outcomes_made_available(app: App, dsn, overlap):
    runs = []

    @app.job(kind="again")
    def again() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise Retry(0)

    again.enqueue()
    drain(app, overlap=overlap, keep_completed=True)

    assert len(runs) == 2
    assert [(r["state"], r["attempt"]) for r in jobs(dsn)] == [("completed", 2)]


# --- Retry, Snooze, Cancel ---


@OVERLAP
def test_retry_runs_again_after_its_delay_and_records_the_error(app: App, dsn, overlap):
    @app.job(kind="later")
    def later() -> None:
        raise Retry(300)

    later.enqueue()
    began = time.monotonic()
    drain(app, overlap=overlap)

    [row] = jobs(dsn)
    assert row["state"] == "retryable"
    assert row["attempt"] == 1
    # Due 300 s after it raised: run_in is read later, by as long as the drain and this query took.
    assert 300 - (time.monotonic() - began) - 0.5 <= row["run_in"] <= 300
    [error] = _errors(row)
    assert error["error"].startswith("Retry: ")
    assert "300" in error["error"]


def test_retry_on_the_last_attempt_discards(app: App, dsn):
    @app.job(kind="later", max_attempts=1)
    def later() -> None:
        raise Retry(300)

    later.enqueue()
    drain(app)

    [row] = jobs(dsn)
    assert row["state"] == "discarded"
    assert row["finalized_at"] is not None


def test_retry_without_delay_is_available_at_once(app: App, dsn):
    @app.job(kind="later")
    def later() -> None:
        raise Retry(0)

    later.enqueue()
    assert run_one_batch(app, 1) == 1

    [row] = jobs(dsn)
    assert row["state"] == "available"
    assert row["attempt"] == 1
    assert len(_errors(row)) == 1


@OVERLAP
def test_snooze_schedules_the_job_and_gives_the_attempt_back(app: App, dsn, overlap):
    @app.job(kind="nap", max_attempts=1)
    def nap() -> None:
        raise Snooze(120)

    nap.enqueue()
    began = time.monotonic()
    drain(app, overlap=overlap)
    spent = time.monotonic() - began

    [row] = jobs(dsn)
    assert row["state"] == "scheduled"  # not discarded, although max_attempts is 1
    assert row["attempt"] == 0
    assert row["errors"] is None
    assert row["finalized_at"] is None
    assert 120 <= row["delay_after_claim"] <= 120 + spent  # from when it snoozed, however busy the machine


def test_snooze_without_delay_is_available_at_once(app: App, dsn):
    @app.job(kind="nap")
    def nap() -> None:
        raise Snooze(0)

    nap.enqueue()
    assert run_one_batch(app, 1) == 1

    [row] = jobs(dsn)
    assert (row["state"], row["attempt"], row["errors"]) == ("available", 0, None)


@OVERLAP
def test_cancel_finalizes_the_job_with_its_reason(app: App, dsn, overlap):
    @app.job(kind="stop")
    def stop() -> None:
        raise Cancel("customer deleted")

    stop.enqueue()
    drain(app, overlap=overlap)

    [row] = jobs(dsn)
    assert row["state"] == "cancelled"
    assert row["attempt"] == 1
    assert row["finalized_at"] is not None
    [error] = _errors(row)
    assert "customer deleted" in error["error"]


def test_outcomes_of_one_batch_are_each_recorded(app: App, dsn):
    """Success, exception, Retry, Snooze and Cancel side by side in a single batch."""

    @app.job(kind="mixed")
    def mixed(what: str) -> None:
        if what == "error":
            raise KeyError("k")
        if what == "retry":
            raise Retry(60)
        if what == "snooze":
            raise Snooze(60)
        if what == "cancel":
            raise Cancel("no")

    for what in ["ok", "error", "retry", "snooze", "cancel", "ok"]:
        mixed.enqueue(what=what)
    assert run_one_batch(app, 6, keep_completed=True) == 6

    assert [(row["args"]["what"], row["state"], row["attempt"]) for row in jobs(dsn)] == [
        ("ok", "completed", 1),
        ("error", "retryable", 1),
        ("retry", "retryable", 1),
        ("snooze", "scheduled", 0),
        ("cancel", "cancelled", 1),
        ("ok", "completed", 1),
    ]


# --- the scheduler: maintenance.schedule_once with a frozen clock ---


def _at(dsn: str, queue: str, state: str, run_at: dt.datetime) -> None:
    query(
        dsn,
        "INSERT INTO fastjobs_jobs (queue, kind, state, run_at) VALUES (%s, 'k', %s, %s)",
        (queue, state, run_at),
    )


def test_schedule_once_promotes_due_jobs_and_counts_them_per_queue(dsn):
    now = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
    second = dt.timedelta(seconds=1)
    _at(dsn, "a", "scheduled", now - second)
    _at(dsn, "a", "retryable", now)
    _at(dsn, "b", "scheduled", now - 3600 * second)
    _at(dsn, "a", "scheduled", now + second)  # not yet due
    _at(dsn, "b", "retryable", now + second)  # not yet due
    _at(dsn, "c", "discarded", now - second)  # finished: never promoted
    _at(dsn, "c", "running", now - second)

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert maintenance.schedule_once(conn, now) == {"a": 2, "b": 1}
        assert maintenance.schedule_once(conn, now) == {}
        assert maintenance.schedule_once(conn, now + second) == {"a": 1, "b": 1}

    states = [(r["queue"], r["state"]) for r in jobs(dsn)]
    assert states == [
        ("a", "available"),
        ("a", "available"),
        ("b", "available"),
        ("a", "available"),
        ("b", "available"),
        ("c", "discarded"),
        ("c", "running"),
    ]


def test_schedule_once_works_in_batches_until_one_comes_back_short(dsn):
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    query(
        dsn,
        """INSERT INTO fastjobs_jobs (queue, kind, state, run_at)
           SELECT 'q' || (i %% 2), 'k', 'scheduled', %s FROM generate_series(1, 25) i""",
        (now,),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = maintenance.schedule_once(conn, now, maintenance.SchedulerConfig(batch=10))
    assert counts == {"q0": 12, "q1": 13}
    assert not query(dsn, "SELECT id FROM fastjobs_jobs_all WHERE state <> 'available'")


def test_a_retried_job_runs_again_once_promoted(app: App, dsn):
    runs = []

    @app.job(kind="flaky")
    def flaky() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("first time")

    flaky.enqueue()
    drain(app)
    [row] = jobs(dsn)
    assert row["state"] == "retryable"

    query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 second'")  # its time has come
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert maintenance.schedule_once(conn) == {"default": 1}
    drain(app, keep_completed=True)

    [row] = jobs(dsn)
    assert len(runs) == 2
    assert (row["state"], row["attempt"]) == ("completed", 2)
    assert len(row["errors"]) == 1
