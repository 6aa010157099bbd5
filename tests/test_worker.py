"""The worker loop against PostgreSQL: batches, order, queues, bad rows, timeouts, stopping, waking."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import ClassVar

import psycopg
import pytest
from psycopg.types.json import Jsonb

import fastjobs.worker
from fastjobs import App, ConfigurationError
from fastjobs.cli.command import _parser
from fastjobs.listener import Listener
from fastjobs.scoreboard import Scoreboard
from fastjobs.stats import WORKER
from fastjobs.worker import Worker, WorkerConfig

from .helpers import (
    OVERLAP,
    WorkerThread,
    asleep,
    batch_loop,
    by_state,
    drain,
    handler_event,
    insert_raw,
    jobs,
    query,
    run_one_batch,
    wait_for,
)

# --- batches ---


@OVERLAP
def test_each_job_runs_once_and_completed_jobs_are_deleted(app: App, dsn, overlap):
    seen = []

    @app.job(kind="add")
    def add(n: int, extra: str = "") -> None:
        seen.append((n, extra))

    add.enqueue_many({"n": n, "extra": f"x{n}"} for n in range(300))
    worker = drain(app, overlap=overlap)

    assert sorted(seen) == [(n, f"x{n}") for n in range(300)]
    assert jobs(dsn) == []
    assert worker.loop is not None
    assert worker.loop.completed == 300
    assert not query(dsn, "SELECT * FROM fastjobs_workers")


@OVERLAP
def test_keep_completed_keeps_rows_as_completed(app: App, dsn, overlap):
    seen = []

    @app.job(kind="add")
    def add(n: int) -> None:
        seen.append(n)

    add.enqueue_many({"n": n} for n in range(50))
    drain(app, overlap=overlap, keep_completed=True)

    rows = jobs(dsn)
    assert sorted(seen) == list(range(50))
    assert [r["args"] for r in rows] == [{"n": n} for n in range(50)]
    assert {(r["state"], r["attempt"], r["errors"]) for r in rows} == {("completed", 1, None)}
    assert all(r["finalized_at"] is not None and r["attempted_by"] for r in rows)


@OVERLAP
def test_kinds_sync_and_async_share_one_batch(app: App, dsn, overlap):
    seen = []

    @app.job(kind="a")
    def a(n: int) -> None:
        seen.append(("a", n))

    @app.job(kind="b")
    def b(n: int) -> None:
        seen.append(("b", n))

    @app.job(kind="c")
    async def c(n: int) -> None:
        await asyncio.sleep(0)
        seen.append(("c", n))

    for n in range(4):
        for kind in "abc":
            app.enqueue(kind, {"n": n})
    assert run_one_batch(app, 12, overlap=overlap) == 12

    assert sorted(seen) == sorted((kind, n) for kind in "abc" for n in range(4))
    assert jobs(dsn) == []


@OVERLAP
def test_higher_priority_first_then_first_in_first_out(app: App, overlap):
    order = []

    @app.job(kind="p")
    def p(n: int) -> None:
        order.append(n)

    for n, priority in enumerate([0, 5, 0, 10, 5, -3, 10, 0]):
        app.enqueue("p", {"n": n}, priority=priority)
    drain(app, overlap=overlap, batch_max=1)

    assert order == [3, 6, 1, 4, 0, 2, 7, 5]


@OVERLAP
def test_worker_serves_only_its_queues(app: App, dsn, overlap):
    seen = []

    @app.job(kind="q", queue="a")
    def q(n: int) -> None:
        seen.append(n)

    for n in range(5):
        app.enqueue("q", {"n": n}, queue="a")
        app.enqueue("q", {"n": 100 + n}, queue="b")

    drain(app, ["a"], overlap=overlap)
    assert sorted(seen) == list(range(5))
    assert [(r["queue"], r["state"], r["attempt"]) for r in jobs(dsn)] == [("b", "available", 0)] * 5

    drain(app, ["a", "b"], overlap=overlap)
    assert sorted(seen) == [*range(5), *range(100, 105)]
    assert jobs(dsn) == []


def test_default_queues_are_the_registered_ones(app: App):
    app.job(kind="x", queue="mail")(lambda: None)
    app.job(kind="y", queue="billing")(lambda: None)
    assert Worker(app).queues == ["billing", "mail"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_max": 0}, "batch_max must be an integer of at least 1"),
        ({"batch_max": 2.5}, "batch_max must be an integer of at least 1"),
        ({"batch_max": True}, "batch_max must be an integer of at least 1"),
        ({"concurrency": 0}, "concurrency must be an integer of at least 1"),
        ({"poll_interval": 0.0}, "poll_interval must be a finite number of seconds above 0"),
        ({"poll_interval": -1.0}, "poll_interval must be a finite number of seconds above 0"),
        ({"poll_interval": math.inf}, "poll_interval must be a finite number of seconds above 0"),
        ({"poll_interval": math.nan}, "poll_interval must be a finite number of seconds above 0"),
        ({"grace": -0.5}, "grace period must be at least 0 seconds"),
        ({"grace": math.nan}, "grace period must be at least 0 seconds"),
        ({"threads": {"emails": 0}}, "threads must map queue names to integers of at least 1"),
        ({"threads": {"emails": 2.5}}, "threads must map queue names to integers of at least 1"),
        ({"threads": {"emails": True}}, "threads must map queue names to integers of at least 1"),
        ({"threads": {b"emails": 4}}, "threads must map queue names to integers of at least 1"),
        ({"threads": [("emails", 4)]}, "threads must map queue names to integers of at least 1"),
    ],
)
def test_worker_config_rejects_bad_settings_when_built(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        WorkerConfig(**settings)


def test_worker_config_takes_edge_values_and_is_frozen():
    config = WorkerConfig(batch_max=1, concurrency=1, poll_interval=0.001, grace=0.0)
    assert WorkerConfig(grace=math.inf).grace == math.inf  # wait for in-flight jobs however long
    with pytest.raises(AttributeError):
        config.batch_max = 2  # type: ignore[misc]


def test_the_cli_defaults_are_the_worker_configs():
    """One default per setting: `fastjobs run` and `fastjobs bench` take WorkerConfig's."""
    defaults = WorkerConfig()
    run = _parser().parse_args(["run", "somemodule"])
    assert (run.batch_max, run.grace, run.keep_completed) == (
        defaults.batch_max,
        defaults.grace,
        defaults.keep_completed,
    )
    assert _parser().parse_args(["bench"]).batch == defaults.batch_max


def test_a_worker_takes_its_settings_from_its_config(app: App):
    worker = Worker(app, config=WorkerConfig(concurrency=7, batch_max=3))
    assert worker.config.batch_max == 3 and worker.executor.concurrency == 7
    threads = {"emails": 8, "default": 1}
    worker = Worker(app, config=WorkerConfig(threads=threads))
    threads["emails"] = 2  # the config keeps its own copy
    # A queue of one thread runs its sync jobs on the loop's own thread, as a queue not named.
    assert worker.executor.threads == {b"emails": 8}
    assert worker.executor.pooled(b"emails") and not worker.executor.pooled(b"default")
    assert Worker(app).config == WorkerConfig()


# --- rows no handler can run ---


@OVERLAP
def test_bad_rows_fail_alone_and_the_batch_completes(app: App, dsn, overlap):
    seen = []

    @app.job(kind="ok")
    def ok(n: int = 0) -> None:
        seen.append(n)

    first = insert_raw(dsn, "ok", '{"n": 1}')
    unknown = insert_raw(dsn, "nobody.handles.this", "{}")
    array = insert_raw(dsn, "ok", "[1, 2]")
    scalar = insert_raw(dsn, "ok", "3")
    last = insert_raw(dsn, "ok", '{"n": 2}')
    assert run_one_batch(app, 5, overlap=overlap, keep_completed=True) == 5

    assert sorted(seen) == [1, 2]
    rows = {r["id"]: r for r in jobs(dsn)}
    assert rows[first]["state"] == rows[last]["state"] == "completed"

    assert rows[unknown]["state"] == "retryable"  # another deploy may know the kind
    assert rows[unknown]["attempt"] == 1
    [error] = rows[unknown]["errors"]
    assert "'nobody.handles.this'" in error["error"]
    assert "handler" in error["error"]

    for job_id, shape in ((array, "list"), (scalar, "int")):
        row = rows[job_id]
        assert row["state"] == "discarded"
        assert row["finalized_at"] is not None
        [error] = row["errors"]
        assert error["error"] == f"args must be a JSON object, not {shape}"


def test_bad_rows_do_not_stop_the_worker(app: App, dsn):
    seen = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        seen.append(n)

    insert_raw(dsn, "nobody.handles.this", "{}")
    insert_raw(dsn, "ok", '["n"]')
    ok.enqueue_many({"n": n} for n in range(20))
    insert_raw(dsn, "ok", "null")
    drain(app)

    assert sorted(seen) == list(range(20))
    assert by_state(dsn) == {"retryable": 1, "discarded": 2}


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["inline", "with-timeout"])
def test_plain_def_returning_a_coroutine_fails(app: App, dsn, timeout):
    async def work() -> None:
        raise AssertionError("never awaited")

    @app.job(kind="sneaky", timeout=timeout)
    def sneaky():
        return work()

    sneaky.enqueue()
    assert run_one_batch(app, 1) == 1  # one run: a drain would meet it again after its ~1 s backoff

    [row] = jobs(dsn)
    assert row["state"] == "retryable"
    [error] = row["errors"]
    assert "'sneaky'" in error["error"]
    assert "coroutine" in error["error"]
    assert "async def" in error["error"]


# --- SystemExit and KeyboardInterrupt from a handler ---


def _fatal_kind(
    app: App, exc_type: type[BaseException], timeout: float | None = None, is_async: bool = False
) -> list[int]:
    """Register kind "step": job 3 raises `exc_type`; returns the list of the jobs that ran."""
    ran: list[int] = []

    def step(n: int) -> None:
        ran.append(n)
        if n == 3:
            raise exc_type(f"handler {n} quits")

    async def step_async(n: int) -> None:
        step(n)

    app.job(kind="step", timeout=timeout)(step_async if is_async else step)
    return ran


def _assert_fatal_recorded(
    dsn: str, ran: list[int], exc_name: str, *, completed: list[int], released: Iterable[int]
) -> None:
    rows = {r["args"]["n"]: r for r in jobs(dsn)}
    assert not [n for n, r in rows.items() if r["state"] == "running"], "jobs left running"
    assert ran == [*completed, 3]
    assert all(rows[n]["state"] == "completed" for n in completed)
    failed = rows[3]
    assert failed["state"] == "retryable"
    assert failed["attempt"] == 1
    [error] = failed["errors"]
    assert error["error"].startswith(f"{exc_name}: ")
    for n in released:
        assert (rows[n]["state"], rows[n]["attempt"], rows[n]["errors"]) == ("available", 0, None)


@OVERLAP
@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_fatal_exception_records_its_job_and_gives_the_batch_back(app: App, dsn, overlap, exc_type):
    ran = _fatal_kind(app, exc_type)
    app.enqueue_many("step", ({"n": n} for n in range(8)))

    # Batches of 5: jobs 5-7 are claimed ahead (overlap) or still queued.
    with batch_loop(app, 5, overlap=overlap, keep_completed=True) as loop, pytest.raises(exc_type):
        loop.step()

    _assert_fatal_recorded(dsn, ran, exc_type.__name__, completed=[0, 1, 2], released=[4, 5, 6, 7])


@OVERLAP
@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_fatal_exception_propagates_out_of_the_worker(app: App, dsn, overlap, exc_type):
    ran = _fatal_kind(app, exc_type)
    app.enqueue_many("step", ({"n": n} for n in range(10)))

    with pytest.raises(exc_type):
        drain(app, overlap=overlap, keep_completed=True)

    _assert_fatal_recorded(dsn, ran, exc_type.__name__, completed=[0, 1, 2], released=range(4, 10))


@OVERLAP
def test_fatal_exception_in_a_handler_with_a_timeout_is_recorded(app: App, dsn, overlap):
    ran = _fatal_kind(app, SystemExit, timeout=10.0)  # a timeout sends it through the Executor
    app.enqueue_many("step", ({"n": n} for n in range(10)))

    with pytest.raises(SystemExit):
        drain(app, overlap=overlap, keep_completed=True)

    _assert_fatal_recorded(dsn, ran, "SystemExit", completed=[0, 1, 2], released=range(4, 10))


@OVERLAP
# The interrupt abandons the batch's unstarted tasks; their "never awaited" warnings are not the subject.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fatal_exception_in_an_async_handler_is_recorded(app: App, dsn, overlap):
    ran = _fatal_kind(app, KeyboardInterrupt, is_async=True)
    app.enqueue_many("step", ({"n": n} for n in range(10)))

    with pytest.raises(KeyboardInterrupt):
        drain(app, overlap=overlap, keep_completed=True)
    gc.collect()  # while this test's warning filter holds

    _assert_fatal_recorded(dsn, ran, "KeyboardInterrupt", completed=[0, 1, 2], released=range(4, 10))


# --- timeouts and async handlers ---


def test_sync_handler_past_its_timeout_fails_with_job_timeout(app: App, dsn):
    @app.job(kind="spin", timeout=0.2)
    def spin() -> None:
        give_up = time.monotonic() + 5.0
        while time.monotonic() < give_up:  # pure Python: the alarm interrupts it
            pass

    spin.enqueue()
    began = time.monotonic()
    drain(app)

    assert time.monotonic() - began < 4.0
    [row] = jobs(dsn)
    assert row["state"] == "retryable"
    # One attempt, or two when a loaded drain outlived the backoff (~1 s): each timed out.
    assert 1 <= len(row["errors"]) <= 2
    for error in row["errors"]:
        assert error["error"].startswith("JobTimeout: ")
        assert "0.2s" in error["error"]
        assert "spin" in error["traceback"]


def test_async_handler_past_its_timeout_fails_with_job_timeout(app: App, dsn):
    @app.job(kind="hang", timeout=0.2)
    async def hang() -> None:
        await asyncio.Event().wait()

    @app.job(kind="quick", timeout=0.2)
    async def quick() -> None:
        await asyncio.sleep(0)

    hang.enqueue()
    quick.enqueue()
    assert run_one_batch(app, 2, keep_completed=True) == 2

    rows = {r["kind"]: r for r in jobs(dsn)}
    assert rows["quick"]["state"] == "completed"
    assert rows["hang"]["state"] == "retryable"
    [error] = rows["hang"]["errors"]
    assert error["error"].startswith("JobTimeout: ")


def test_handler_within_its_timeout_completes(app: App, dsn):
    @app.job(kind="fine", timeout=5.0)
    def fine(n: int) -> None:
        pass

    fine.enqueue_many({"n": n} for n in range(10))
    drain(app)
    assert jobs(dsn) == []


@OVERLAP
def test_async_handlers_of_a_batch_run_concurrently(app: App, dsn, overlap):
    started = []
    everyone_in = asyncio.Event()

    # Each job waits for the last one to start: only concurrent handlers get
    # past the wait (one at a time, the first would time out).
    @app.job(kind="meet", timeout=5.0)
    async def meet(n: int) -> None:
        started.append(n)
        if len(started) == 20:
            everyone_in.set()
        await everyone_in.wait()

    meet.enqueue_many({"n": n} for n in range(20))
    began = time.monotonic()
    assert run_one_batch(app, 20, overlap=overlap) == 20

    assert time.monotonic() - began < 4.0
    assert sorted(started) == list(range(20))
    assert jobs(dsn) == []


@pytest.mark.parametrize("concurrency", [3, 100])
def test_worker_bounds_async_concurrency(app: App, dsn, concurrency):
    active = [0]
    peak = [0]

    @app.job(kind="count")
    async def count(n: int) -> None:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        for _ in range(3):
            await asyncio.sleep(0)
        active[0] -= 1

    count.enqueue_many({"n": n} for n in range(200))
    drain(app, concurrency=concurrency)

    assert jobs(dsn) == []
    if concurrency == 3:
        assert peak[0] == 3
    else:
        assert 3 < peak[0] <= concurrency


# --- stopping ---


def _stop_after_ten(app: App, dsn: str, overlap: bool, timeout: float | None) -> None:
    ran: list[int] = []
    worker = Worker(app, config=WorkerConfig(overlap=overlap, keep_completed=True))

    @app.job(kind="n", timeout=timeout)
    def n(n: int) -> None:
        ran.append(n)
        if len(ran) == 10:
            worker.stop()

    app.enqueue_many("n", ({"n": i} for i in range(200)))
    worker.run()  # returns once stopped, every outcome written

    rows = jobs(dsn)
    assert not [r for r in rows if r["state"] == "running"]
    assert not query(dsn, "SELECT * FROM fastjobs_workers")
    completed = sorted(r["args"]["n"] for r in rows if r["state"] == "completed")
    assert completed == sorted(ran)
    available = [r for r in rows if r["state"] == "available"]
    assert len(available) == 200 - len(ran)
    assert {(r["attempt"], r["errors"]) for r in available} == {(0, None)}
    assert len(ran) == 10, "jobs claimed but not started when stop() came were run anyway"


@OVERLAP
def test_stop_from_a_handler_gives_unstarted_jobs_back(app: App, dsn, overlap):
    _stop_after_ten(app, dsn, overlap, timeout=None)


@OVERLAP
def test_stop_gives_unstarted_jobs_back_on_the_slow_path(app: App, dsn, overlap):
    _stop_after_ten(app, dsn, overlap, timeout=30.0)


def test_stop_before_run_claims_nothing(app: App, dsn):
    app.job(kind="n")(lambda: None)
    app.enqueue("n")
    worker = Worker(app)
    worker.stop()
    worker.run()
    assert [(r["state"], r["attempt"]) for r in jobs(dsn)] == [("available", 0)]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_worker_that_ran_leaves_no_file_descriptor_open(app: App):
    app.job(kind="n")(lambda: None)
    drain(app)  # the first run opens what is cached for the process (libpq, the embedded server)
    before = _open_fds()
    for _ in range(3):
        drain(app)
    assert _open_fds() == before


# --- waking up: the Listener ---


class SpyListener(Listener):
    """The real Listener, telling the test when the worker goes to sleep on it."""

    made: ClassVar[list[SpyListener]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sleeping = threading.Event()
        self.connected = threading.Event()
        SpyListener.made.append(self)

    def connect(self) -> bool:
        ok = super().connect()
        if ok:
            self.connected.set()
        return ok

    def wait(self, timeout: float) -> bool:
        self.sleeping.set()
        return super().wait(timeout)


@pytest.fixture
def spy(monkeypatch):
    SpyListener.made = []
    monkeypatch.setattr(fastjobs.worker, "Listener", SpyListener)
    return SpyListener.made


def test_idle_worker_wakes_on_enqueue(app: App, spy):
    ran, seen = handler_event(app, "wake")
    # Polling once a minute: only the notification can wake it within the test.
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=60.0))):
        assert wait_for(lambda: bool(spy) and spy[0].sleeping.is_set())
        spy[0].sleeping.clear()  # set again once the worker is back asleep after the job
        app.enqueue("wake", {"n": 1})
        assert ran.wait(5.0)

        assert spy[0].sleeping.wait(5.0)
        app.enqueue("wake", {"n": 2})
        assert wait_for(lambda: len(seen) == 2)
    assert seen == [1, 2]


def test_idle_worker_ignores_other_queues(app: App, dsn, spy):
    ran, _ = handler_event(app, "wake", queue="mine")
    with WorkerThread(Worker(app, ["mine"], config=WorkerConfig(poll_interval=60.0))):
        assert wait_for(lambda: bool(spy) and spy[0].sleeping.is_set())
        app.enqueue("wake", {"n": 1}, queue="theirs")
        app.enqueue("wake", {"n": 2}, queue="mine")
        assert ran.wait(5.0)
    assert [(r["queue"], r["state"]) for r in jobs(dsn)] == [("theirs", "available")]


def test_worker_polls_while_its_listener_is_down_and_reconnects(app: App, dsn, spy):
    ran, seen = handler_event(app, "wake")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=0.2))):
        assert wait_for(lambda: bool(spy) and spy[0].sleeping.is_set())
        listener = spy[0]
        old_pid = listener.conn.info.backend_pid
        listener.connected.clear()
        query(dsn, "SELECT pg_terminate_backend(%s)", (old_pid,))

        app.enqueue("wake", {"n": 1})
        assert ran.wait(5.0)  # found by polling or after the reconnect
        assert listener.connected.wait(5.0)
        assert listener.conn is not None
        assert listener.conn.info.backend_pid != old_pid
        assert listener.reconnects >= 1
    assert seen == [1]


@pytest.fixture
def listener(dsn):
    made = Listener(dsn, ["default"])
    assert made.connect()
    asleep(dsn)  # as its worker does before it sleeps: inserts notify
    yield made
    made.close()


def test_listener_check_on_a_healthy_connection(app: App, listener):
    pid = listener.conn.info.backend_pid
    result = []
    # In a thread: a check that deadlocks (it once did) fails the test instead of hanging it.
    thread = threading.Thread(target=lambda: result.append(listener.check()), daemon=True)
    thread.start()
    thread.join(2.0)
    assert result == [True]
    assert listener.reconnects == 0
    assert listener.conn.info.backend_pid == pid

    # A wake-up that arrived during the check is not lost to it.
    app.enqueue("anything")
    assert listener.check() is True
    assert listener.wait(0) is True


def test_the_listener_writes_each_change_of_its_state_to_the_card(app: App, dsn):
    """What `fastjobs stats` shows: written when it changes, not when the worker next sleeps."""
    cards = Scoreboard.create(1)
    card = cards[0]
    card.claim(WORKER, 0)
    made = Listener(dsn, ["default"], card=card)
    try:
        assert made.connect() and made.conn is not None
        assert (card["listening"], card["listener_reconnects"]) == (1, 0) and card["listener_ok"] > 0
        query(dsn, "SELECT pg_terminate_backend(%s)", (made.conn.info.backend_pid,))

        def polled(done: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                made.poll()
                return done()

            return check

        # A busy worker polls once a second: the loss shows without a sleep on the listener.
        assert wait_for(polled(lambda: card["listening"] == 0))
        assert card["listener_reconnects"] == 1 and made.conn is None
        assert made.wait(0) is False  # the worker's next sleep makes it again
        assert (card["listening"], card["listener_reconnects"]) == (1, 1)
        asleep(dsn)  # as the sleeping worker's deadline: enqueues notify
        app.enqueue("anything")  # a wake-up read by a poll is kept for the next sleep
        assert wait_for(polled(lambda: made._woken))
        assert made.wait(60) is True
    finally:
        made.close()
        cards.close(unlink=True)


def test_listener_check_reconnects_a_terminated_listener(app: App, dsn, listener):
    old_pid = listener.conn.info.backend_pid
    query(dsn, "SELECT pg_terminate_backend(%s)", (old_pid,))

    assert listener.check() is True
    assert listener.reconnects == 1
    assert listener.conn.info.backend_pid != old_pid

    # It listens again: a notification for its queue wakes it.
    app.enqueue("anything")
    began = time.monotonic()
    assert listener.wait(5.0) is True
    assert time.monotonic() - began < 5.0


def test_listener_wait_survives_its_connection_dying(app: App, dsn, listener):
    query(dsn, "SELECT pg_terminate_backend(%s)", (listener.conn.info.backend_pid,))
    assert listener.wait(0.2) is False  # the loss is noticed, not raised
    assert listener.conn is None
    assert listener.reconnects == 1

    app.enqueue("anything")  # the next wait reconnects first; polling finds this one meanwhile
    assert listener.wait(0.05) is False
    assert listener.conn is not None
    app.enqueue("anything")
    assert listener.wait(5.0) is True


def test_listener_ignores_other_queues_notifications(app: App, listener):
    app.enqueue("anything", queue="elsewhere")
    assert listener.wait(0.2) is False


def test_closed_listener_connection_is_noticed_by_check(dsn, listener):
    listener.conn.close()
    assert listener.check() is True
    assert listener.reconnects == 1


def _insert_behind(dsn: str, n: int) -> None:
    """An available job whose run_at is an hour old: behind any mark a recent claim left."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO fastjobs_jobs (kind, args, run_at) VALUES ('behind', %s, now() - interval '1 hour')",
            (Jsonb({"n": n}),),
        )


def test_claims_start_where_the_last_ended_and_look_from_the_front_when_idle(app: App, dsn) -> None:
    """With claims from the front rationed to almost never, a job queued behind the last
    claim's end is not claimed after it; an idle loop says when it should look again."""
    _, seen = handler_event(app, "behind")
    app.enqueue("behind", {"n": 1})
    with batch_loop(app, 10, front_claim_duty=1e-9) as loop:
        assert loop.step() == 1 and seen == [1]
        assert loop.step() == 0  # the first claim from the front was cold and rationed nothing
        assert loop.recheck == float("inf")
        _insert_behind(dsn, 2)
        app.enqueue("behind", {"n": 3})
        assert loop.step() == 1 and seen == [1, 3]  # from where the first claim ended
        assert loop.step() == 0
        assert 5.0 < loop.recheck <= 10.0  # the next claim from the front, rationed
    assert by_state(dsn) == {"available": 1}


def test_a_job_behind_the_last_claim_still_runs_at_once(app: App, dsn) -> None:
    _, seen = handler_event(app, "behind")
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=60.0))):
        app.enqueue("behind", {"n": 1})
        assert wait_for(lambda: seen == [1])
        _insert_behind(dsn, 2)
        assert wait_for(lambda: seen == [1, 2]), seen
    # A drain that stops when the queue is empty looks from the front first.
    app.enqueue("behind", {"n": 3})
    _insert_behind(dsn, 4)
    drain(app)
    assert seen == [1, 2, 4, 3]
