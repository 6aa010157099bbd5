"""Wake-ups (migrations/004_wakeups.sql): an insert notifies only while a worker sleeps.

A worker about to sleep moves the deadline of `fastjobs_sleep_until` forward
and claims once more; the trigger notifies only before that deadline. A job
whose wake-up was lost is found by the sleeping worker's poll.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fastjobs import App, sql
from fastjobs.bench import producers
from fastjobs.errors import ConfigurationError
from fastjobs.worker import Worker, WorkerConfig

from .helpers import NOTIFY_END, WorkerThread, asleep, notifications, wait_for


def _deadline(dsn: str) -> float | None:
    """The deadline (seconds since 1970) until which inserts notify; None before any worker slept."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_sequence_last_value('fastjobs_sleep_until')").fetchone()
    assert row is not None
    return None if row[0] is None else row[0] / 1000


def _server_now(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT date_part('epoch', clock_timestamp())").fetchone()
    assert row is not None
    return float(row[0])


@pytest.fixture
def listening(dsn: str) -> Any:
    """A connection listening on the fastjobs channel, with no worker asleep."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        conn.execute(f"LISTEN {NOTIFY_END}")
        yield conn


def test_an_insert_notifies_only_while_a_worker_sleeps(app: App, dsn: str, listening: Any) -> None:
    app.enqueue("k", {"n": 1}, queue="busy")
    assert app.enqueue_many("k", [{"n": i} for i in range(10)], queue="busy") == 10
    assert notifications(listening, dsn) == {}  # under load: no commit notifies

    asleep(dsn, 60.0)
    app.enqueue("k", {"n": 2}, queue="idle")
    assert app.enqueue_many("k", [{"n": i} for i in range(10)], queue="idle") == 10
    assert notifications(listening, dsn) == {"idle": 2}


def test_the_deadline_only_moves_forward_and_not_from_a_clock_gone_back(dsn: str) -> None:
    asleep(dsn, 60.0)
    far = _deadline(dsn)
    assert far is not None and 50 < far - _server_now(dsn) <= 60
    asleep(dsn, 1.0)  # a worker that sleeps less leaves the longer sleeper notified
    assert _deadline(dsn) == far
    with psycopg.connect(dsn, autocommit=True) as conn:  # as after the server's clock went back a day
        conn.execute("SELECT setval('fastjobs_sleep_until', %s)", (int((far + 86400) * 1000),))
    asleep(dsn, 1.0)
    back = _deadline(dsn)
    assert back is not None and back - _server_now(dsn) <= 3600


def _worker(app: App, poll: float) -> Worker:
    return Worker(app, config=WorkerConfig(poll_interval=poll, schedule=False))


def _sleeping(dsn: str) -> bool:
    deadline = _deadline(dsn)
    return deadline is not None and deadline > _server_now(dsn)


def test_an_idle_worker_is_woken_by_an_enqueue_before_its_poll(app: App, dsn: str) -> None:
    ran = threading.Event()
    app.job(kind="wake")(lambda: ran.set())
    with WorkerThread(_worker(app, poll=60.0)):
        assert wait_for(lambda: _sleeping(dsn), 10.0), "the worker never went to sleep"
        app.enqueue("wake")
        assert ran.wait(30.0)  # a minute's poll cannot have found it: the notification did


def test_a_wake_up_lost_to_a_transaction_open_across_the_workers_sleep_is_found_by_its_poll(
    app: App, dsn: str, listening: Any
) -> None:
    """The race the design leaves open: the INSERT ran before any worker slept (no notification
    was due), the commit comes after the worker's last claim. The poll bounds the delay."""
    ran = threading.Event()
    app.job(kind="late")(lambda: ran.set())
    with psycopg.connect(dsn) as conn:
        app.enqueue("late", conn=conn)
        with WorkerThread(_worker(app, poll=0.5)):
            assert wait_for(lambda: _sleeping(dsn), 10.0), "the worker never went to sleep"
            conn.commit()
            assert ran.wait(30.0)
    assert notifications(listening, dsn) == {}  # it was found without one


def test_a_transactional_enqueue_runs_once_committed_and_never_when_rolled_back(
    app: App, dsn: str, listening: Any
) -> None:
    seen: list[int] = []
    committed = threading.Event()

    @app.job(kind="tx")
    def tx(n: int) -> None:
        seen.append(n)
        if n == 2:
            committed.set()

    with WorkerThread(_worker(app, poll=60.0)):
        assert wait_for(lambda: _sleeping(dsn), 10.0), "the worker never went to sleep"
        with psycopg.connect(dsn) as conn:
            tx.using(conn).enqueue(n=1)
            conn.rollback()
            tx.using(conn).enqueue(n=2)
            with psycopg.connect(dsn, autocommit=True) as other:  # invisible until the commit
                row = other.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
                assert row == (0,)
            conn.commit()
        assert committed.wait(30.0)  # woken at the commit: the poll is a minute
    assert seen == [2]
    assert notifications(listening, dsn) == {"default": 1}


def test_no_job_is_lost_under_concurrent_producers(app: App, dsn: str) -> None:
    done: list[int] = []
    lock = threading.Lock()

    @app.job(kind="many")
    def many(n: int) -> None:
        with lock:
            done.append(n)

    def produce(first: int) -> None:
        for n in range(first, first + 100):
            many.enqueue(n=n)

    with WorkerThread(_worker(app, poll=1.0)):
        threads = [threading.Thread(target=produce, args=(i * 100,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert wait_for(lambda: len(done) >= 800, 60.0), len(done)
    assert sorted(done) == list(range(800))


def test_the_producers_benchmark_reports_the_three_contenders(dsn: str, tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    lines: list[str] = []
    record = producers.measure(dsn, 2, 0.3, 1, False, results, lines.append)
    threaded = producers.measure(dsn, 2, 0.3, 1, True, results, lines.append)
    for made, kind in ((record, "processes"), (threaded, "threads")):
        assert made["bench"] == "producers" and made["producer_kind"] == kind
        assert all(made[f"{name}_jobs_per_s"] > 0 for name in producers.CONTENDERS)
        assert made["fastjobs_ratio"] == pytest.approx(
            made["runs"]["fastjobs"][0] / made["runs"]["raw"][0], rel=0.01
        )
    assert [json.loads(line)["producer_kind"] for line in results.read_text().splitlines()] == [
        "processes",
        "threads",
    ]
    assert any("app.enqueue" in line for line in lines)


def test_a_role_that_may_not_move_the_sleep_deadline_stops_its_worker_at_start(dsn: str) -> None:
    """The role workers connect as needs UPDATE on the deadline's sequence: without it a worker
    fails at start with a ConfigurationError naming the grant (a boot error, which its master
    does not restart), instead of crashing at each first idle moment and restarting for ever."""
    role = f"fastjobs_nosleep_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
    app = App(make_conninfo(dsn, user=role))
    try:
        with pytest.raises(ConfigurationError, match="GRANT UPDATE ON SEQUENCE fastjobs_sleep_until"):
            Worker(app, exit_when_empty=True).run()
    finally:
        app.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
