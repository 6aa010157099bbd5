"""Pausing and resuming queues (fastjobs.queues, migrations/007_queues.sql), on both lanes and loops."""

from __future__ import annotations

import json
import threading

import psycopg
import pytest

from fastjobs import App, QueueInfo
from fastjobs.worker import Worker, WorkerConfig

from .helpers import WorkerThread, batch_loop, by_state, drain, query, wait_for, warm
from .procs import cli


def test_a_paused_queue_keeps_its_jobs_and_takes_enqueues_while_other_queues_run(app: App, dsn: str) -> None:
    ran: list[str] = []
    app.job(kind="a", queue="a")(lambda: ran.append("a"))
    app.job(kind="b", queue="b")(lambda: ran.append("b"))
    since = app.pause("a")
    assert app.pause("a") == since  # pausing again keeps the first time
    app.enqueue_many("a", ({} for _ in range(5)))
    app.enqueue_many("b", ({} for _ in range(3)))
    drain(app, ["a", "b"])
    assert ran == ["b"] * 3
    assert by_state(dsn) == {"available": 5}
    assert app.queues() == [QueueInfo("a", since, 5, 0)]
    assert app.resume("a") is True
    assert app.resume("a") is False  # not paused any more
    drain(app, ["a", "b"])
    assert ran == ["b"] * 3 + ["a"] * 5
    assert app.queues() == [QueueInfo("a", None, 0, 0)]  # a queue acted on stays listed


@pytest.mark.parametrize("fast_lane", [True, False])
def test_no_claim_of_either_lane_takes_a_paused_queue_s_jobs(app: App, dsn: str, fast_lane: bool) -> None:
    ran: list[int] = []
    app.job(kind="warm")(lambda: None)
    app.job(kind="k")(lambda n: ran.append(n))
    with batch_loop(app, 100, fast_lane=fast_lane) as loop:
        warm(app, loop)  # the queue takes the fast lane from here, when it may
        app.enqueue_many("k", ({"n": n} for n in range(250)))
        app.pause("default")
        assert loop.step() == 0
        app.resume("default")
        while loop.step():
            pass
        loop.finish()
        # The empty claim sent the queue to the state lane until a claim came back full.
        assert loop.fast == (150 if fast_lane else 0)
    assert sorted(ran) == list(range(250))


def test_a_pause_on_the_caller_s_connection_applies_at_its_commit(app: App, dsn: str) -> None:
    app.job(kind="k")(lambda: None)
    with psycopg.connect(dsn) as conn:
        app.pause("default", conn=conn)
        conn.rollback()
        app.enqueue("k")
        drain(app)
        assert by_state(dsn) == {}
        app.pause("default", conn=conn)
        app.enqueue("k")
        drain(app)
        assert by_state(dsn) == {}  # not committed yet
        conn.commit()
    app.enqueue("k")
    drain(app)
    assert by_state(dsn) == {"available": 1}


def test_workers_stop_taking_a_paused_queue_s_jobs_and_a_resume_wakes_them(app: App, dsn: str) -> None:
    """The workers sleep on a poll of a minute: only the resume's wake-up can start the jobs soon."""
    started: list[str] = []
    resumed = threading.Event()

    @app.job(kind="a", queue="a")
    def a(n: int) -> None:
        started.append("a")
        if started.count("a") == 10:
            resumed.set()

    app.job(kind="b", queue="b")(lambda n: started.append("b"))
    workers = [
        WorkerThread(Worker(app, ["a", "b"], config=WorkerConfig(poll_interval=60.0, schedule=False)))
        for _ in range(2)
    ]
    with workers[0], workers[1]:
        app.enqueue("a", {"n": 0})
        assert wait_for(lambda: started == ["a"], 10.0)
        app.pause("a")
        app.enqueue_many("a", ({"n": n} for n in range(9)))
        app.enqueue_many("b", ({"n": n} for n in range(20)))
        # Every worker claims after the pause: b's jobs run, a's stay.
        assert wait_for(lambda: started.count("b") == 20, 10.0)
        asleep_since = len(started)
        assert wait_for(lambda: len(started) > asleep_since, 1.0) is False
        assert started.count("a") == 1
        assert app.resume("a")
        assert resumed.wait(10.0), started
    assert by_state(dsn) == {}


def test_pause_and_resume_from_the_command_line_and_what_stats_says(app: App, dsn: str) -> None:
    app.job(kind="k", queue="emails")(lambda: None)
    app.enqueue_many("k", ({} for _ in range(3)))

    done = cli(dsn, "queues", "pause", "emails")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("queue 'emails': paused since ")
    listed = cli(dsn, "queues", "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["queue", "state", "waiting", "running"]
    assert row.split()[:3] == ["emails", "paused", "since"] and row.split()[-2:] == ["3", "0"]
    listed_json = json.loads(cli(dsn, "queues", "list", "--json").stdout)
    assert [(q["name"], q["waiting"], q["paused_at"] is not None) for q in listed_json] == [
        ("emails", 3, True)
    ]

    report = cli(dsn, "stats")
    assert report.returncode == 0, report.stderr
    assert "paused: queue 'emails' since " in report.stdout
    doc = json.loads(cli(dsn, "stats", "--json").stdout)
    assert list(doc["paused_queues"]) == ["emails"]

    # A name no job or worker knows is paused all the same (a queue may be paused before its first
    # job), with a warning naming the close ones.
    typo = cli(dsn, "queues", "pause", "emials", "--json")
    assert typo.returncode == 0, typo.stderr
    assert json.loads(typo.stdout)["paused"] is True
    assert "no queue 'emials'" in typo.stderr and "did you mean 'emails'?" in typo.stderr

    resumed = cli(dsn, "queues", "resume", "emails", "--json")
    assert json.loads(resumed.stdout) == {"queue": "emails", "paused": False, "was_paused": True}
    again = cli(dsn, "queues", "resume", "emails")
    assert again.stdout.strip() == "queue 'emails': was not paused"
    paused = json.loads(cli(dsn, "stats", "--json").stdout)["paused_queues"]
    assert paused == {"emials": json.loads(typo.stdout)["paused_at"]}


def test_a_bad_queue_name_is_refused_with_a_clear_error(app: App, dsn: str) -> None:
    with pytest.raises(ValueError, match="queue must be a non-empty string"):
        app.pause("")
    with pytest.raises(ValueError, match="at most 128 characters"):
        app.resume("q" * 200)
    assert query(dsn, "SELECT count(*) AS n FROM fastjobs_queues") == [{"n": 0}]
    done = cli(dsn, "queues", "pause", "")
    assert done.returncode == 1 and "queue must be a non-empty string" in done.stderr
