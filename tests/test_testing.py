"""The testing kit (fastjobs.testing) and its pytest plugin, used as a user would."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import importlib.metadata
import subprocess
import sys
import threading
from typing import Any

import psycopg
import pytest

import fastjobs
from _fastjobs_pytest import load_app
from fastjobs import App, Cancel, FastjobsError, Retry, Snooze, current_job
from fastjobs.testing import Drained, databases

from .helpers import by_state, jobs, query

pytest_plugins = ["pytester"]


# --- drain ---------------------------------------------------------------------


def test_drain_runs_due_jobs_and_the_jobs_they_enqueue(app: App):
    seen: list[tuple[str, int]] = []

    @app.job(kind="chain")
    def chain(n: int) -> None:
        job = current_job()
        assert job is not None
        seen.append(("chain", n))
        if n < 3:
            chain.enqueue(n=n + 1)

    chain.enqueue(n=1)
    with app.testing() as kit:
        assert kit.drain() == Drained(completed=3)
        assert kit.drain() == Drained()
    assert seen == [("chain", 1), ("chain", 2), ("chain", 3)]
    assert jobs(app.dsn) == []  # completed jobs are deleted, as a worker's default


def test_a_failed_job_waits_for_its_backoff_unless_now_moves_past_it(app: App):
    attempts: list[int] = []

    @app.job(kind="flaky", max_attempts=3)
    def flaky() -> None:
        job = current_job()
        assert job is not None
        attempts.append(job.attempt)
        raise Retry(60)

    flaky.enqueue()
    kit = app.testing()
    assert kit.drain() == Drained(retried=1)
    assert kit.drain() == Drained()  # due in a minute: not yet
    [row] = kit.enqueued(flaky, state="retryable")
    assert row.attempt == 1 and row.errors is not None and "Retry" in row.errors[0]["error"]
    assert kit.drain(now=dt.timedelta(minutes=30)) == Drained(retried=1, discarded=1)
    assert attempts == [1, 2, 3]
    kit.assert_enqueued(flaky, state="discarded", count=1)


def test_a_failure_in_a_sync_test_records_the_handlers_exception_alone(app: App):
    @app.job(kind="boom", max_attempts=1)
    def boom() -> None:
        raise KeyError("missing")

    boom.enqueue()
    kit = app.testing()
    assert kit.drain() == Drained(discarded=1)
    [row] = kit.enqueued(boom, state="discarded")
    assert row.errors is not None
    trace = row.errors[0]["traceback"]
    assert "KeyError: 'missing'" in trace
    # No exception of fastjobs' own machinery chained before the handler's.
    assert "no running event loop" not in trace and "During handling" not in trace
    assert trace.startswith("Traceback (most recent call last):")


def test_now_runs_scheduled_jobs_due_by_then_in_the_order_they_were_due(app: App):
    order: list[str] = []

    @app.job(kind="tick")
    def tick(name: str) -> None:
        order.append(name)

    tick.options(delay=300).enqueue(name="in 5 min")
    tick.options(delay=60).enqueue(name="in 1 min")
    tick.options(delay=7200).enqueue(name="in 2 h")
    tick.enqueue(name="now")
    kit = app.testing()
    assert kit.drain() == Drained(completed=1)
    assert kit.drain(now=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)) == Drained(completed=2)
    assert order == ["now", "in 1 min", "in 5 min"]
    kit.assert_enqueued(tick, args={"name": "in 2 h"}, state="scheduled")
    with pytest.raises(ValueError, match="timezone"):
        kit.drain(now=dt.datetime.now())


def test_now_moves_the_clock_one_job_at_a_time_so_a_snoozing_job_runs_as_often_as_it_would(app: App):
    """A job snoozing a minute, drained ten and a half minutes ahead, runs ten times: each
    snooze counts from the time it ran, not from the real now (which made it run until the
    drain's limit of 10,000 jobs)."""
    runs: list[int] = []

    @app.job(kind="poll")
    def poll() -> None:
        runs.append(1)
        raise Snooze(60)

    @app.job(kind="mail")
    def mail(n: int) -> None:
        runs.append(n)

    poll.enqueue()
    kit = app.testing()
    assert kit.drain() == Drained(snoozed=1)
    mail.options(delay=150).enqueue(n=150)  # between the third and the fourth poll
    assert kit.drain(now=dt.timedelta(minutes=10, seconds=30)) == Drained(completed=1, snoozed=10)
    assert runs == [1, 1, 1, 150, 1, 1, 1, 1, 1, 1, 1, 1]
    [left] = kit.enqueued(poll)
    assert left.state == "scheduled"
    assert dt.timedelta(seconds=50) < left.run_at - dt.datetime.now(dt.UTC) <= dt.timedelta(seconds=60)


def test_drain_keeps_snooze_cancel_and_timeouts_as_a_worker_does(app: App):
    stuck = threading.Event()

    @app.job(kind="snoozer")
    def snoozer() -> None:
        job = current_job()
        assert job is not None
        if job.attempt == 1 and not stuck.is_set():
            stuck.set()
            raise Snooze(0)

    @app.job(kind="quitter")
    def quitter() -> None:
        raise Cancel("not wanted")

    @app.job(kind="sleeper", timeout=0.05, max_attempts=1)
    def sleeper() -> None:
        threading.Event().wait(5)

    for job in (snoozer, quitter, sleeper):
        job.enqueue()
    kit = app.testing()
    assert kit.drain() == Drained(completed=1, snoozed=1, cancelled=1, discarded=1)
    [timed_out] = kit.enqueued(sleeper, state="discarded")
    assert timed_out.errors is not None and "JobTimeout" in timed_out.errors[0]["error"]
    kit.assert_enqueued(quitter, state="cancelled")


def test_drain_takes_one_queue_when_asked(app: App):
    ran: list[str] = []

    @app.job(kind="mail", queue="emails")
    def mail() -> None:
        ran.append("mail")

    @app.job(kind="report", queue="reports")
    def report() -> None:
        ran.append("report")

    mail.enqueue()
    report.enqueue()
    kit = app.testing()
    assert kit.drain(queue="emails") == Drained(completed=1)
    assert ran == ["mail"]
    kit.assert_enqueued(report, queue="reports")
    kit.refute_enqueued(mail)


def test_drain_refuses_to_run_forever(app: App):
    @app.job(kind="forever")
    def forever() -> None:
        raise Snooze(0)

    forever.enqueue()
    with pytest.raises(FastjobsError, match="drain ran 20 jobs"):
        app.testing().drain(limit=20)


def test_a_job_of_a_kind_the_app_does_not_know_fails_as_in_a_worker(app: App):
    app.enqueue("nobody.handles", {"x": 1})
    kit = app.testing()
    assert kit.drain() == Drained(retried=1)
    [row] = kit.enqueued("nobody.handles")
    assert row.errors is not None and "no handler registered" in row.errors[0]["error"]


async def test_drain_and_async_handlers_from_an_async_test(app: App):
    ran: list[int] = []

    @app.job(kind="async_job")
    async def async_job(n: int) -> None:
        await asyncio.sleep(0)
        job = current_job()
        assert job is not None and job.kind == "async_job"
        ran.append(n)

    await async_job.enqueue_async(n=1)
    kit = app.testing()
    assert kit.drain() == Drained(completed=1)
    assert ran == [1]
    assert await kit.run_job_async(async_job, n=2) is None
    assert kit.run_job(async_job, n=3) is None
    assert ran == [1, 2, 3]
    await app.aclose()


# --- assertions ----------------------------------------------------------------


def test_assertions_match_by_kind_args_subset_queue_priority_and_count(app: App):
    @app.job(kind="welcome", queue="emails")
    def welcome(user_id: int, email: str, tags: tuple[str, ...] = ()) -> None:
        pass

    welcome.enqueue(user_id=1, email="a@example.com", tags=("new",))
    welcome.options(priority=5).enqueue(user_id=2, email="b@example.com")
    kit = app.testing()
    [one] = kit.assert_enqueued(welcome, args={"user_id": 1, "tags": ("new",)}, queue="emails")
    assert one.args == {"user_id": 1, "email": "a@example.com", "tags": ["new"]}
    kit.assert_enqueued("welcome", count=2)
    kit.assert_enqueued(welcome, priority=5, args={"user_id": 2})
    kit.refute_enqueued(welcome, args={"user_id": 3})
    kit.refute_enqueued(welcome, queue="default")
    assert [job.args["user_id"] for job in kit.enqueued(welcome)] == [1, 2]
    assert kit.enqueued(welcome, state="completed") == []


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal


@dataclasses.dataclass
class Invoice:
    order_id: int
    lines: list[Line]
    due: dt.date


def test_assertions_take_typed_args_as_the_enqueue_did(app: App):
    """A dataclass, a Decimal, a date: compared in the JSON form the enqueue stored them in."""

    @app.job(kind="invoice")
    def invoice(invoice: Invoice, copies: int = 1) -> None:
        pass

    first = Invoice(1, [Line("s", decimal.Decimal("1.50"))], dt.date(2026, 1, 1))
    invoice.enqueue(invoice=first)
    kit = app.testing()
    [one] = kit.assert_enqueued(invoice, args={"invoice": first})
    assert one.args["invoice"] == {
        "order_id": 1,
        "lines": [{"sku": "s", "price": "1.50"}],
        "due": "2026-01-01",
    }
    kit.assert_enqueued("invoice", args={"invoice": first}, count=1)  # by its kind too
    other = dataclasses.replace(first, lines=[Line("s", decimal.Decimal("2.50"))])  # another price
    kit.refute_enqueued(invoice, args={"invoice": other})
    with pytest.raises(AssertionError, match=r"expected a job \(kind='invoice', args=\{'invoice': Invoice\("):
        kit.assert_enqueued(invoice, args={"invoice": other})
    # What its annotation refuses is compared as given: the stored JSON object, written out.
    kit.assert_enqueued(invoice, args={"invoice": one.args["invoice"]})


def test_a_failed_assertion_shows_the_closest_jobs_that_were_enqueued(app: App):
    app.enqueue("welcome", {"user_id": 1, "email": "a@example.com"}, queue="emails")
    app.enqueue("welcome", {"user_id": 2, "email": "b@example.com"}, queue="emails")
    app.enqueue("invoice", {"user_id": 2})
    kit = app.testing()
    with pytest.raises(AssertionError) as failed:
        kit.assert_enqueued("welcome", args={"user_id": 2, "email": "c@example.com"})
    message = str(failed.value)
    assert "expected a job (kind='welcome', args={'user_id': 2, 'email': 'c@example.com'})" in message
    assert "found 0; the closest jobs that were enqueued:" in message
    # Fewest criteria missed first (each argument is one), then the newest.
    closest = [line.split()[0] for line in message.splitlines()[1:]]
    assert closest == ["#2", "#3", "#1"]
    with pytest.raises(AssertionError, match=r"expected 3 job\(s\) \(kind='welcome'\) .* found 2:"):
        kit.assert_enqueued("welcome", count=3)
    with pytest.raises(AssertionError, match=r"expected no job \(kind='invoice'\).*\n  #3 invoice"):
        kit.refute_enqueued("invoice")
    with pytest.raises(ValueError, match="'finished' is not a valid JobState"):
        kit.enqueued(state="finished")


def test_a_kind_the_app_does_not_know_is_refused_naming_the_close_one(app: App):
    """A typo'd kind would make refute_enqueued pass whatever was enqueued."""

    @app.job(kind="shop.jobs.send_email")
    def send_email(to: str) -> None:
        pass

    send_email.enqueue(to="a@example.com")
    kit = app.testing()
    for check in (kit.assert_enqueued, kit.refute_enqueued, kit.enqueued):
        with pytest.raises(fastjobs.UnknownKind, match=r"did you mean 'shop\.jobs\.send_email'\?"):
            check("send_email")
    with pytest.raises(AssertionError, match="expected no job"):
        kit.refute_enqueued("shop.jobs.send_email")
    app.declare("billing.charge")  # a declared kind is known: asserting on it is fine
    kit.refute_enqueued("billing.charge")


def test_an_assertion_on_an_empty_table_says_so(app: App):
    with pytest.raises(AssertionError, match="no job at all was in those states"):
        app.testing().assert_enqueued("anything")


# --- run_job -------------------------------------------------------------------


def test_run_job_round_trips_the_arguments_as_a_worker_would_pass_them(app: App):
    @app.job(kind="store")
    def store(items: Any, when: str) -> dict[str, object]:  # Any: stored as the JSON it encodes to
        job = current_job()
        assert job is not None and job.kind == "store" and job.attempt == 1
        return {"items": items, "when": when}

    kit = app.testing()
    assert kit.run_job(store, items=(1, 2), when="now") == {"items": [1, 2], "when": "now"}
    # jsonb keeps numbers as numeric: a float with no fraction may come back an int, as in a worker.
    [big] = kit.run_job(store, items=[1e16], when="now")["items"]
    assert type(big) is int and big == 10**16
    with pytest.raises(TypeError) as at_test:
        kit.run_job(store, items={1, 2}, when="now")
    with pytest.raises(TypeError) as at_enqueue:
        store.enqueue(items={1, 2}, when="now")
    assert str(at_test.value) == str(at_enqueue.value)
    with pytest.raises(TypeError, match="missing argument"):
        kit.run_job(store, items=[1])
    with pytest.raises(TypeError, match="NUL"):
        kit.run_job(store, items=[], when="\x00")
    with pytest.raises(ValueError, match="no handler registered for job kind 'other'"):
        kit.run_job("other")
    assert by_state(app.dsn) == {}  # nothing was written


def test_run_job_lets_what_the_handler_raises_through(app: App):
    @app.job(kind="picky")
    def picky(n: int) -> None:
        raise Retry(5) if n else Cancel("zero")

    kit = app.testing()
    with pytest.raises(Retry):
        kit.run_job(picky, n=1)
    with pytest.raises(Cancel):
        kit.run_job(picky, n=0)


# --- inline mode ---------------------------------------------------------------


def test_inline_runs_each_enqueue_at_once_through_the_worker(app: App):
    ran: list[int] = []

    @app.job(kind="now")
    def now_job(n: int) -> None:
        ran.append(n)
        if n == 1:
            now_job.enqueue(n=2)  # runs in the same inline run, after this one

    with app.testing(mode="inline") as kit:
        now_job.enqueue(n=1)
        assert ran == [1, 2]
        assert now_job.enqueue_many([{"n": 3}, {"n": 4}]) == 2
        assert ran == [1, 2, 3, 4]
        now_job.options(delay=60).enqueue(n=5)  # a delayed job waits, as in production
        assert ran == [1, 2, 3, 4]
        kit.assert_enqueued(now_job, args={"n": 5}, state="scheduled")
    now_job.enqueue(n=6)  # out of the block: manual again
    assert ran == [1, 2, 3, 4]


def test_a_job_failing_inline_is_left_retryable_not_raised_into_the_enqueue(app: App):
    @app.job(kind="boom")
    def boom() -> None:
        raise ValueError("boom")

    with app.testing(mode="inline") as kit:
        job_id = boom.enqueue()
        [row] = kit.enqueued(boom, state="retryable")
    assert row.id == job_id and row.errors is not None and row.errors[0]["error"] == "ValueError: boom"


def test_inline_with_conn_runs_on_commit_and_never_on_rollback(app: App, dsn: str):
    ran: list[str] = []

    @app.job(kind="after_commit")
    def after_commit(name: str) -> None:
        ran.append(name)

    with app.testing(mode="inline"), psycopg.connect(dsn) as conn:
        with conn.transaction():
            after_commit.using(conn).enqueue(name="committed")
            assert ran == []
        assert ran == ["committed"]
        with pytest.raises(ZeroDivisionError), conn.transaction():
            after_commit.using(conn).enqueue(name="rolled back")
            1 / 0  # noqa: B018
        after_commit.using(conn).enqueue(name="implicit")  # opens a transaction: runs at commit()
        assert ran == ["committed"]
        conn.commit()
        assert ran == ["committed", "implicit"]
    assert [row["args"] for row in jobs(dsn)] == []
    assert "rolled back" not in ran


async def test_inline_with_an_async_conn_runs_on_commit(app: App, dsn: str):
    ran: list[str] = []

    @app.job(kind="async_after_commit")
    async def after_commit(name: str) -> None:
        ran.append(name)

    with app.testing(mode="inline"):
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            async with conn.transaction():
                await after_commit.using(conn).enqueue_async(name="a")
                assert ran == []
            assert ran == ["a"]
            with pytest.raises(ZeroDivisionError):
                async with conn.transaction():
                    await after_commit.using(conn).enqueue_async(name="b")
                    1 / 0  # noqa: B018
        await after_commit.enqueue_async(name="c")
        assert ran == ["a", "c"]
    await app.aclose()


def test_testing_points_the_app_at_a_database_and_back(app: App):
    before = app.dsn
    with databases.fresh() as other, app.testing(dsn=other) as kit:
        app.enqueue("somewhere", {})
        assert app.dsn == other
        kit.assert_enqueued("somewhere", count=1)
    assert app.dsn == before
    assert query(before, "SELECT count(*) AS n FROM fastjobs_jobs_all") == [{"n": 0}]
    with pytest.raises(ValueError, match="mode must be one of manual, inline"):
        app.testing(mode="eager")  # type: ignore[arg-type]


# --- the plugin, as a user's suite uses it -------------------------------------

# pytest-asyncio warns in a session that leaves its loop scope unset.
INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"

USER_JOBS = """
import fastjobs

app = fastjobs.App()
sent = []

@app.job(queue="emails")
def send_welcome(email: str) -> None:
    sent.append(email)
"""


def test_the_plugin_binds_the_app_named_in_the_ini_file(pytester: pytest.Pytester):
    pytester.makepyfile(myjobs=USER_JOBS)
    pytester.makeini(INI + "fastjobs_app = myjobs:app\n")
    pytester.makepyfile(
        """
        import pytest
        from myjobs import app, send_welcome, sent

        def test_manual(fastjobs_testing, fastjobs_dsn):
            assert app.dsn == fastjobs_dsn
            send_welcome.enqueue(email="a@example.com")
            fastjobs_testing.assert_enqueued(send_welcome, args={"email": "a@example.com"}, queue="emails")
            assert sent == []
            assert fastjobs_testing.drain().completed == 1
            assert sent == ["a@example.com"]

        @pytest.mark.fastjobs(mode="inline")
        def test_inline(fastjobs_testing):
            send_welcome.enqueue(email="b@example.com")
            assert sent[-1] == "b@example.com"

        def test_each_test_has_a_database_of_its_own(fastjobs_testing):
            fastjobs_testing.refute_enqueued(send_welcome)

        def test_a_failing_assertion(fastjobs_testing):
            send_welcome.enqueue(email="c@example.com")
            fastjobs_testing.assert_enqueued(send_welcome, args={"email": "d@example.com"})
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*closest jobs that were enqueued:",
            "*#1 myjobs.send_welcome args={'email': 'c@example.com'} queue='emails'*",
        ]
    )
    result.stdout.no_fnmatch_line("*fastjobs/testing.py*")  # the kit's frames are hidden


def test_a_conftest_fixture_binds_the_app_and_async_tests_work(pytester: pytest.Pytester):
    pytester.makepyfile(myjobs=USER_JOBS)
    pytester.makeconftest(
        """
        import pytest
        import myjobs

        @pytest.fixture
        def fastjobs_app():
            return myjobs.app
        """
    )
    pytester.makeini(INI + "asyncio_mode = auto\n")
    pytester.makepyfile(
        """
        from myjobs import send_welcome, sent

        async def test_async(fastjobs_testing):
            await send_welcome.enqueue_async(email="e@example.com")
            assert fastjobs_testing.drain().completed == 1
            assert sent == ["e@example.com"]
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_misnamed_app_fails_with_what_was_wrong():
    with pytest.raises(ValueError, match=r"'package\.module:attribute', not 'fastjobs\.App'"):
        load_app("fastjobs.App")
    with pytest.raises(TypeError, match=r"fastjobs:Job is a type, not a fastjobs\.App"):
        load_app("fastjobs:Job")
    with pytest.raises(AttributeError):
        load_app("fastjobs:nothing")


def test_without_an_app_the_fixture_says_how_to_name_one(pytester: pytest.Pytester):
    pytester.makeini(INI)
    pytester.makepyfile("def test_it(fastjobs_testing):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(['*set `fastjobs_app = "package.module:app"`*'])


def test_the_plugin_loads_nothing_of_fastjobs_until_a_test_asks():
    probe = (
        "import sys, _fastjobs_pytest; print(','.join(m for m in sys.modules if m.startswith('fastjobs')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    [entry] = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "fastjobs"]
    assert entry.value == "_fastjobs_pytest"


def test_fastjobs_testing_is_importable_without_pytest():
    probe = "import sys, fastjobs.testing; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert fastjobs.App().testing().mode == "manual"
