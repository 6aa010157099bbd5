"""Pausing and resuming queues (fastjobs.queues, migrations/007_queues.sql), on both lanes and loops."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import psycopg
import pytest

from fastjobs import App, QueueFull, QueueInfo, queues
from fastjobs.worker import Worker, WorkerConfig

from . import procs
from .helpers import WorkerThread, batch_loop, by_state, drain, query, wait_for, warm
from .procs import cli
from .test_metrics import metrics_port, scrape
from .test_stats import samples


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
    assert header.split() == [
        "queue",
        "state",
        "waiting",
        "running",
        "concurrency",
        "rate_limit",
        "max_backlog",
        "held",
        "back",
        "fair",
    ]
    assert row.split()[:3] == ["emails", "paused", "since"] and row.split()[-3:] == ["3", "0", "0"]
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


def test_a_master_s_workers_leave_a_paused_queue_and_its_metrics_say_so(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    app.pause("default")
    app.enqueue_many("record", ({"n": n} for n in range(5)))
    master = masters.start("--processes", "2", "--metrics-port", "0")
    port = metrics_port(master)

    def paused_gauge() -> dict[str, float] | None:
        found = samples(scrape(port))
        return found if 'fastjobs_queue_paused{queue="default"}' in found else None

    found = procs.wait_for(paused_gauge, "a scrape that read the database", timeout=15)
    assert found['fastjobs_queue_paused{queue="default"}'] == 1
    assert found['fastjobs_queue_jobs{queue="default",state="available"}'] == 5
    assert procs.runs(db) == {}
    assert cli(app.dsn, "queues", "resume", "default").returncode == 0
    procs.wait_for(lambda: len(procs.runs(db)) == 5 or None, "the resumed queue's jobs to run", timeout=15)
    # Read 0 while the queue holds jobs; a queue without jobs or a pause has no series.
    procs.wait_for(
        lambda: samples(scrape(port)).get('fastjobs_queue_paused{queue="default"}', 0) == 0 or None,
        "the gauge to read 0",
        timeout=15,
    )
    assert master.stop() == 0, master.stderr()


def _count(dsn: str) -> None:
    """What the leader does every second: count the limited queues' backlogs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        queues.count_backlogs(conn)


def test_a_full_queue_holds_producers_back_with_queue_full_and_counts_them(app: App, dsn: str) -> None:
    app.limit_queue("small", max_backlog=3)
    app.enqueue_many("k", ({} for _ in range(3)), queue="small")
    _count(dsn)
    producer = App(dsn)  # reads the full queues afresh
    try:
        with pytest.raises(QueueFull, match="queue 'small' is full: 3 jobs waiting, its max_backlog is 3"):
            producer.enqueue("k", queue="small")
        with pytest.raises(QueueFull):
            producer.enqueue_many("k", ({} for _ in range(2)), queue="small")
        with pytest.raises(QueueFull):
            asyncio.run(producer.enqueue_async("k", queue="small"))
        with psycopg.connect(dsn) as conn, pytest.raises(QueueFull):
            producer.enqueue("k", queue="small", conn=conn)
        producer.enqueue("k", queue="other")  # other queues take jobs
        began = time.monotonic()
        with pytest.raises(QueueFull, match=r"after waiting 0\.5s for room"):
            producer.enqueue("k", queue="small", wait_for_room=0.5)  # its reads report the count
        assert time.monotonic() - began >= 0.5
    finally:
        producer.close()
    assert by_state(dsn) == {"available": 4}
    with psycopg.connect(dsn, autocommit=True) as conn:
        (small,) = [q for q in queues.states(conn) if q.name == "small"]
    assert small.held_back >= 4 and small.backlog == 3 and small.max_backlog == 3
    # A count the leader made long ago (no leader now) holds nobody back.
    query(dsn, "UPDATE fastjobs_queues SET backlog_at = now() - interval '1 hour'")
    fresh = App(dsn)
    try:
        fresh.enqueue("k", queue="small")
    finally:
        fresh.close()
    app.limit_queue("small", max_backlog=None)
    _count(dsn)
    assert [q.max_backlog for q in app.queues() if q.name == "small"] == [None]


def test_an_enqueue_on_the_caller_s_connection_does_not_need_the_app_s_own(
    app: App, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The enqueue's read of the full queues (and its mark of a fair queue) goes through the App's
    own connections; when those cannot be had (the server at max_connections, a restart, another
    DSN), it goes through the caller's connection instead, in a savepoint: the enqueue fails only
    as that connection does. Before, it raised DatabaseUnavailable for a connection the caller
    never asked for (the chaos suite's producer, across a PostgreSQL restart)."""
    app.limit_queue("small", max_backlog=2)
    app.enqueue_many("k", ({} for _ in range(2)), queue="small")
    _count(dsn)
    unreachable = App("postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2")
    try:
        with psycopg.connect(dsn) as conn:
            job = unreachable.enqueue("k", queue="other", conn=conn)
            assert unreachable.enqueue_many("k", ({} for _ in range(2)), queue="other", conn=conn) == 2
            unreachable.enqueue("k", queue="fair", fair_key="a", conn=conn)  # marks the queue fair
            with pytest.raises(QueueFull, match="queue 'small' is full"):
                unreachable.enqueue("k", queue="small", conn=conn)
            conn.commit()  # the failed enqueue's savepoint left the transaction usable
            # A mark made through the caller's connection is made again until the App's own is back:
            # the transaction it went in may roll back (inside one, it is a savepoint of it).
            conn.execute("SELECT 1")
            unreachable.enqueue("k", queue="fair2", fair_key="a", conn=conn)
            conn.rollback()
            unreachable.enqueue("k", queue="fair2", fair_key="a", conn=conn)
            conn.commit()

        async def on_async() -> None:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                await unreachable.enqueue_async("k", queue="other", conn=conn)
                await unreachable.enqueue_async("k", queue="fair", fair_key="b", conn=conn)
                with pytest.raises(QueueFull):
                    await unreachable.enqueue_async("k", queue="small", conn=conn)
                await conn.commit()

        unreachable._backpressure._fair.clear()  # the async path marks again, through its caller
        unreachable._backpressure._read_at = -1.0  # and reads again
        unreachable._backpressure._own_down_until = 0.0  # trying its own connection first again
        asyncio.run(on_async())
    finally:
        unreachable.close()
    # Said once per failure, then the caller's connection first for OWN_RETRY seconds: no connect
    # attempt at every read (a host that does not answer would cost each its timeout).
    said = [r.getMessage() for r in caplog.records if "own connection failed" in r.getMessage()]
    assert len(said) == 2 and "127.0.0.1:1/nowhere" in said[0] and "next 10s" in said[0], said
    assert query(dsn, "SELECT count(*) AS n FROM fastjobs_jobs_all WHERE queue = 'other'") == [{"n": 4}]
    assert query(dsn, "SELECT name, fair FROM fastjobs_queues WHERE name LIKE 'fair%' ORDER BY name") == [
        {"name": "fair", "fair": True},
        {"name": "fair2", "fair": True},
    ]
    assert by_state(dsn)["available"] == 2 + 4 + 2 + 1 and job > 0


def test_a_producer_waiting_for_room_enqueues_once_the_backlog_drops(app: App, dsn: str) -> None:
    app.job(kind="k", queue="small")(lambda: None)
    app.limit_queue("small", max_backlog=2)
    app.enqueue_many("k", ({} for _ in range(2)))
    _count(dsn)
    producer = App(dsn)
    done: list[int] = []
    waiting = threading.Thread(
        target=lambda: done.append(producer.enqueue("k", queue="small", wait_for_room=30))
    )
    try:
        waiting.start()
        assert not wait_for(lambda: bool(done), 0.5)  # held back
        drain(app, ["small"])
        _count(dsn)
        waiting.join(10)
        assert done, "the producer never got room"
    finally:
        producer.close()
    assert by_state(dsn) == {"available": 1}


def test_bad_limits_and_waits_are_refused_with_a_clear_error(app: App, dsn: str) -> None:
    bads: list[Any] = [0, -1, True, 1.5, "3", 2**31]
    for bad in bads:
        with pytest.raises(ValueError, match="max_backlog must be a positive integer or None"):
            app.limit_queue("q", max_backlog=bad)
        with pytest.raises(ValueError, match="concurrency must be a positive integer or None"):
            app.limit_queue("q", concurrency=bad)
    with pytest.raises(ValueError, match="give concurrency=, rate_limit=, max_backlog= or several"):
        app.limit_queue("q")
    for wait in (-1, float("inf"), "1", True):
        with pytest.raises(ValueError, match="wait_for_room must be seconds"):
            app.enqueue("k", wait_for_room=wait)  # type: ignore[arg-type]
    assert by_state(dsn) == {} and app.queues() == []
    done = cli(dsn, "queues", "limit", "q", "--max-backlog", "0")
    assert done.returncode == 2 and "expected a positive integer or none, not '0'" in done.stderr


def test_the_leader_counts_a_limited_backlog_and_stats_and_metrics_show_it(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Jobs of a queue no worker serves pile up; the leader's count fills the queue for producers."""
    assert cli(app.dsn, "queues", "limit", "held", "--max-backlog", "3").returncode == 0
    app.enqueue_many("record", ({"n": n} for n in range(5)), queue="held")
    master = masters.start("--processes", "1", "--queues", "default", "--metrics-port", "0")
    port = metrics_port(master)

    def refused() -> bool:
        producer = App(app.dsn)
        try:
            producer.enqueue("record", {"n": 9}, queue="held")
            return False
        except QueueFull:
            return True
        finally:
            producer.close()

    procs.wait_for(refused, "the leader's count to fill the queue", timeout=15)

    def held_back() -> dict[str, float] | None:
        found = samples(scrape(port))
        return found if found.get('fastjobs_queue_held_back_total{queue="held"}') else None

    found = procs.wait_for(held_back, "the held-back count in the metrics", timeout=15)
    assert found['fastjobs_queue_max_backlog{queue="held"}'] == 3
    report = cli(app.dsn, "stats").stdout
    assert "max_backlog: queue 'held' 3 (at least 3 waiting: FULL, enqueues held back;" in report
    listed = cli(app.dsn, "queues", "list").stdout.splitlines()
    assert listed[0].split()[4:] == ["concurrency", "rate_limit", "max_backlog", "held", "back", "fair"]
    assert master.stop() == 0, master.stderr()


def test_a_limited_queue_never_runs_more_than_its_concurrency_across_processes(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Four worker processes, a limit of 3: sampled from the database while the jobs run, never
    more than 3 of the queue's jobs are running, and 3 are at times (the limit binds, it is not
    a queue that happens to be slow)."""
    app.limit_queue("limited", concurrency=3)
    app.enqueue_many("record", ({"n": n, "sleep": 0.05} for n in range(60)), queue="limited")
    app.enqueue_many("record", ({"n": 1000 + n} for n in range(20)), queue="free")
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute(
                    "SELECT count(*) FROM fastjobs_jobs_all WHERE queue = 'limited' AND state = 'running'"
                ).fetchone()
                assert row is not None
                seen.append(row[0])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        master = masters.start("--processes", "4", "--queues", "limited,free")
        procs.wait_for(lambda: len(procs.runs(db)) == 80 or None, "every job to run", timeout=60)
        assert master.stop() == 0, master.stderr()
    finally:
        done.set()
        sampler.join()
    assert max(seen) == 3, sorted(set(seen))
    assert len(seen) > 50
    assert procs.runs(db) == {n: 1 for n in [*range(60), *range(1000, 1020)]}


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_limited_queue_s_claims_take_the_room_left_on_the_state_lane(
    app: App, dsn: str, fast_lane: bool
) -> None:
    app.job(kind="warm")(lambda: None)
    app.job(kind="k")(lambda n: None)
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)  # the queue takes the fast lane from here, when it may
        app.enqueue_many("k", ({"n": n} for n in range(10)))
        app.limit_queue("default", concurrency=4)
        query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running' WHERE (args->>'n')::int = 9")
        assert loop.step() == 3  # 4 less the one running
        assert loop.step() == 3  # the first 3 completed
        assert loop.step() == 3
        assert loop.step() == 0  # job 9 is running, not available
        app.limit_queue("default", concurrency=None)
        query(dsn, "UPDATE fastjobs_jobs_all SET state = 'available' WHERE (args->>'n')::int = 9")
        assert loop.step() == 1
        loop.finish()
        assert loop.fast == 0
    assert by_state(dsn) == {}
    assert [q.concurrency for q in app.queues()] == [None]


def test_a_rate_limited_queue_starts_at_most_its_rate_from_a_bucket_of_one_second(app: App, dsn: str) -> None:
    app.job(kind="k")(lambda n: None)
    app.enqueue_many("k", ({"n": n} for n in range(40)))
    app.limit_queue("default", rate_limit="10/s")
    with batch_loop(app, 100, fast_lane=True, overlap=False) as loop:
        began = time.monotonic()
        assert loop.step() == 10  # a full bucket: one second's worth
        ran = 10
        while ran < 40:
            ran += loop.step()
            assert ran <= 10 + 10 * (time.monotonic() - began) + 1  # never ahead of the rate
        assert time.monotonic() - began >= 2.9  # 30 more at 10 a second
        loop.finish()
        assert loop.fast == 0
    assert [q.rate_limit for q in app.queues()] == ["10/s"]
    for bad in ("10", "10/day", "0/s", "x/s", "-1/min"):
        with pytest.raises(ValueError, match="rate_limit must read N/PERIOD"):
            app.limit_queue("default", rate_limit=bad)
    done = cli(dsn, "queues", "limit", "default", "--rate-limit", "5/fortnight")
    assert done.returncode == 2 and "rate_limit must read N/PERIOD" in done.stderr
    done = cli(dsn, "queues", "limit", "default", "--rate-limit", "none", "--json")
    assert json.loads(done.stdout) == {"rate_limit": None, "queue": "default"}


def test_a_rate_limit_holds_across_worker_processes(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Four processes, 20 jobs a second: the jobs' start times never run ahead of the bucket."""
    app.limit_queue("paced", rate_limit="20/s")
    app.enqueue_many("record", ({"n": n} for n in range(80)), queue="paced")
    master = masters.start("--processes", "4", "--queues", "paced")
    procs.wait_for(lambda: len(procs.runs(db)) == 80 or None, "every job to run", timeout=60)
    assert master.stop() == 0, master.stderr()
    times = [row[0] for row in db.execute("SELECT extract(epoch FROM at) FROM runs ORDER BY at")]
    first = float(times[0])
    for i, at in enumerate(times):
        # The bucket held 20 at the start and refills 20 a second from its first claim, up to 0.25 s
        # before the first job started (a claim's jobs start late, never early).
        assert i + 1 <= 20 + 20 * (float(at) - first + 0.25) + 1, (i, float(at) - first)
    assert float(times[-1]) - first >= 2.5  # 60 beyond the first second's 20, at 20 a second
