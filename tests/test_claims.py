"""Claims that start where the last one ended (late-commit margin, claims from the front), and their size."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from fastjobs import App
from fastjobs.abc import SIZE_DECAY
from fastjobs.executor import Executor
from fastjobs.impl import core
from fastjobs.maintenance import rotate_once
from fastjobs.worker import Worker, WorkerConfig

from .helpers import OVERLAP, WorkerThread, batch_loop, by_state, handler_event, query, wait_for, warm


def test_a_job_committed_late_behind_the_mark_is_claimed_after_it(app: App, dsn) -> None:
    """A job whose run_at is 50 ms before the mark (its transaction committed late) is claimed
    by the claim after the mark; one a second before it waits for a claim from the front."""
    _, seen = handler_event(app, "late")
    app.enqueue("late", {"n": 1})
    [mark] = query(dsn, "SELECT run_at FROM fastjobs_jobs_all")
    with batch_loop(app, 10, front_claim_duty=1e-9) as loop:  # claims from the front: almost never
        assert loop.step() == 1 and seen == [1]
        assert loop.step() == 0  # the first claim from the front was cold and rationed nothing
        for n, before in ((2, 0.05), (3, 1.0)):
            query(
                dsn,
                "INSERT INTO fastjobs_jobs (kind, args, run_at)"
                " VALUES ('late', %s, %s - make_interval(secs => %s))",
                (Jsonb({"n": n}), mark["run_at"], before),
            )
        assert loop.step() == 1 and seen == [1, 2]
        assert loop.step() == 0
    assert by_state(dsn) == {"available": 1}


def test_a_claim_after_the_mark_reads_the_current_slot_alone_and_a_rotation_leaves_no_job_behind(
    app: App, dsn
) -> None:
    """Once its mark is past the moment the loop first saw the current rotating slot, a claim after
    the mark reads slot 0 and that slot alone (the _in_slot statements: Planner.slots). A rotation
    then makes another slot current: the claim sent for the old one finds nothing of the jobs
    inserted since, sees the new slot, and the loop claims again at once, in every slot; claims
    from the front, which would find them too, come almost never here."""
    _, seen = handler_event(app, "slotted")
    jobs = iter(range(1, 1000))
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as leader:
        loop = core.BatchLoop(conn, dict(app.jobs), Executor(10), "w", ["default"], batch_min=10,
                              batch_max=10, front_claim_duty=1e-9, fast_lane=False)  # fmt: skip
        loop.prepare()

        def in_slot() -> int:
            """How many times the loop's connection ran an _in_slot statement (between its steps)."""
            [(count,)] = conn.execute(
                "SELECT coalesce(sum(generic_plans + custom_plans), 0)::int FROM pg_prepared_statements"
                " WHERE name LIKE '%%\\_in\\_slot%%'"
            ).fetchall()
            return int(count)

        def one_slot() -> None:
            """Jobs one at a time until a claim reads one slot: its mark, less the margin, after the
            loop's first sight of the slot (each job 0.12 s after the last, within SLOT_FRESH)."""
            before = in_slot()
            for _ in range(20):
                n = next(jobs)
                app.enqueue("slotted", {"n": n})
                assert loop.step() == 1 and seen[-1] == n
                if in_slot() > before:
                    return
                time.sleep(0.12)
            raise AssertionError("no claim read one slot")

        loop.planner.keyed = frozenset()  # as a Worker's start finds the queue: never given a keyed job
        again = 0  # claims made again at once for a rotation they saw
        for _ in range(3):  # a stall of the machine past SLOT_FRESH makes the next claim read every slot
            one_slot()
            assert rotate_once(leader)["rotated"] == 1
            n = next(jobs)
            app.enqueue("slotted", {"n": n})  # into the new current slot
            for _ in range(2):
                if loop.step():
                    break
                assert loop.recheck == 0.0  # the claim sent for the old slot saw the new one
                again += 1
            else:
                raise AssertionError(f"job {n} was not claimed in two steps")
            assert seen[-1] == n
            if again:
                break
        assert again
        loop.finish()
        assert seen == list(range(1, n + 1))
        assert by_state(dsn) == {}


@OVERLAP
def test_a_higher_priority_job_waits_about_one_batch_behind_slow_jobs(app: App, overlap) -> None:
    """Slow jobs (50 ms, so batches of 2) drain at priority 0; a job of a higher priority than any
    before, enqueued mid-drain, sorts before the mark, so only a claim from the front finds it: that
    claim must come within about a batch. Rationed by the batch's time (the claim sent ahead is in
    flight while the handlers run), it came ~9 batches (~0.9 s) later."""
    ran: dict[int, float] = {}
    urgent_ran = threading.Event()

    @app.job(kind="slow")
    def slow(n: int) -> None:
        ran[n] = time.monotonic()
        if n >= 1000:
            urgent_ran.set()
        else:
            time.sleep(0.05)

    slow.enqueue_many({"n": n} for n in range(150))
    before = []  # slow jobs started between each urgent job's commit and its start
    with WorkerThread(Worker(app, config=WorkerConfig(poll_interval=60.0, overlap=overlap))):
        assert wait_for(lambda: len(ran) >= 10)
        for k in range(5):
            urgent_ran.clear()
            # Each a priority above the last: the mark moves to an urgent job's priority, where a
            # claim after it would find the next urgent job of the same priority at once.
            app.enqueue("slow", {"n": 1000 + k}, priority=5 + k)
            began = time.monotonic()
            assert urgent_ran.wait(3.0)
            before.append(sum(1 for n, at in list(ran.items()) if n < 1000 and began <= at < ran[1000 + k]))
    # Counted in jobs, not seconds (a loaded machine stretches seconds): the batch running and the
    # one claimed ahead come first, 2 jobs each, and a batch's size may grow to 4 on the way. The
    # median: a claim's round trip stretched by a loaded machine (14 ms against 1.5) rations the
    # next claim from the front 49 times as long.
    assert sorted(before)[2] <= 8, before


def test_an_empty_claim_does_not_shrink_the_next_claim_to_one_job(app: App) -> None:
    """A burst committed between claims that found nothing (the soak's producer: hundreds of jobs
    every 10 ms) is claimed whole: the size after an empty claim is half the last one's, not
    batch_min, which made each burst a doubling of round trips (1, 2, 4, ...). Idle, it still
    shrinks to batch_min."""

    @app.job(kind="burst")
    def burst(n: int) -> None:
        pass

    with psycopg.connect(app.dsn, autocommit=True) as conn:
        loop = core.BatchLoop(conn, dict(app.jobs), Executor(), "w", ["default"], batch_min=64, overlap=False)
        loop.prepare()
        loop.batch_min = 1
        burst.enqueue_many({"n": n} for n in range(64))
        assert loop.step() == 64 and loop.size == 128
        assert loop.step() == 0  # found none: the size halves
        assert loop.size == 128 // SIZE_DECAY
        burst.enqueue_many({"n": n} for n in range(64))
        assert loop.step() == 64
        for _ in range(10):
            assert loop.step() == 0
        assert loop.size == 1


def test_an_empty_queue_does_not_shrink_a_busy_ones_claims(app: App) -> None:
    """A worker of two queues, one empty: the claims of the busy one double as they find full
    batches. One size for all queues made each empty claim halve the busy queue's, which was then
    claimed 1-2 jobs at a time, a round trip or two per job."""

    @app.job(kind="busy", queue="busy")
    def busy() -> None:
        pass

    busy.enqueue_many({} for _ in range(200))
    sizes = []
    with psycopg.connect(app.dsn, autocommit=True) as conn:
        loop = core.BatchLoop(
            conn, dict(app.jobs), Executor(), "w", ["idle", "busy"], batch_max=64, overlap=False
        )
        loop.prepare()
        while ran := loop.step():
            sizes.append(ran)
    assert sum(sizes) == 200
    assert sizes[:7] == [1, 2, 4, 8, 16, 32, 64], sizes


# (n, priority, seconds before now its run_at is): enqueued in n's order, so id order is n's.
_MIXED = [(0, 0, 10), (1, 5, 1), (2, 5, 3), (3, -2, 30), (4, 5, 3), (5, 10, 0), (6, 0, 20), (7, 5, 2)]
# Claim order: the highest priority first, then the earliest run_at, then the lowest id.
_IN_CLAIM_ORDER = [n for n, *_ in sorted(_MIXED, key=lambda job: (-job[1], -job[2], job[0]))]


@OVERLAP
@pytest.mark.parametrize("lane", ["fast", "state"])
def test_a_batch_runs_in_claim_order_whatever_the_ids(app: App, dsn, overlap, lane) -> None:
    """Jobs of mixed priorities and run_at, claimed in one batch, run highest priority first, then
    earliest run_at, then id, on both lanes. The state lane's UPDATE returned them by id."""
    app.job(kind="warm")(lambda: None)
    _, seen = handler_event(app, "mixed")
    with batch_loop(app, 100, overlap=overlap, fast_lane=lane == "fast") as loop:
        warm(app, loop)
        for n, priority, _ in _MIXED:
            app.enqueue("mixed", {"n": n}, priority=priority)
        query(
            dsn,
            "UPDATE fastjobs_jobs_all j SET run_at = now() - make_interval(secs => m.ago)"
            "  FROM unnest(%s::int[], %s::float8[]) AS m(n, ago) WHERE (j.args->>'n')::int = m.n",
            ([n for n, *_ in _MIXED], [float(ago) for *_, ago in _MIXED]),
        )
        assert loop.step() == len(_MIXED)
        assert loop.fast == (len(_MIXED) if lane == "fast" else 0)
        loop.stopping = True
        loop.finish()
    assert _IN_CLAIM_ORDER == [5, 2, 4, 7, 1, 6, 0, 3]
    assert seen == _IN_CLAIM_ORDER


@pytest.mark.parametrize("lane", ["fast", "state"])
def test_a_fair_batch_runs_in_claim_order_across_its_keys(app: App, dsn, lane) -> None:
    """A fair claim takes its share of each key (all of one priority); the batch runs by run_at,
    then id, across the keys, as any batch does: here B's jobs are older than A's, enqueued after."""
    app.job(kind="warm")(lambda: None)
    seen: list[int] = []
    app.job(kind="keyed", fair_key="tenant")(lambda tenant, n: seen.append(n))
    with batch_loop(app, 8, overlap=False, fast_lane=lane == "fast") as loop:
        warm(app, loop)
        app.enqueue_many("keyed", ({"tenant": "A", "n": n} for n in range(4)))
        app.enqueue_many("keyed", ({"tenant": "B", "n": n} for n in range(4, 8)))
        query(
            dsn,
            "UPDATE fastjobs_jobs_all SET run_at = now() - make_interval(secs =>"
            " CASE WHEN (args->>'n')::int < 4 THEN 8 - 2 * (args->>'n')::int"
            " ELSE 9 - 2 * ((args->>'n')::int - 4) END) WHERE kind = 'keyed'",
        )
        assert loop.step() == 8
        assert loop.fast == (8 if lane == "fast" else 0)
        loop.stopping = True
        loop.finish()
    assert seen == [4, 0, 5, 1, 6, 2, 7, 3]


@pytest.mark.parametrize("keep_completed", [False, True])
def test_a_batch_of_completions_goes_by_the_complete_statements(app: App, dsn, keep_completed) -> None:
    """A batch whose outcomes are all completions at a first attempt goes by a job_complete_claim_
    statement (no outcome records: two data-modifying CTEs fewer to start); one with a failure, a
    snooze or a later attempt's completion by the job_finish_claim_ statement that writes records,
    and each outcome lands as written. A claim with nothing to finish (a loop's first, one after
    its sleep) goes by a job_claim_only_ statement, no outcome CTE at all."""
    failing: set[int] = set()

    @app.job(kind="work")
    def work(n: int) -> None:
        if n in failing:
            raise RuntimeError(f"job {n} fails")

    conn = psycopg.connect(dsn, autocommit=True)
    loop = core.BatchLoop(conn, dict(app.jobs), Executor(10), "w", ["default"], batch_min=5, batch_max=5,
                          keep_completed=keep_completed, fast_lane=False)  # fmt: skip

    def executed() -> dict[str, int]:
        rows = conn.execute(
            "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
            " WHERE name LIKE 'job_complete_claim%%' OR name LIKE 'job_finish_claim%%'"
            " OR name LIKE 'job_claim_only%%'"
        ).fetchall()
        return {name: count for name, count in rows if count}

    def families() -> dict[str, int]:
        found: dict[str, int] = {}
        for name, count in executed().items():
            family = "_".join(name.split("_")[:3])  # job_claim_only, job_complete_claim, job_finish_claim
            found[family] = found.get(family, 0) + count
        return found

    def drain() -> None:
        while loop.step():
            pass
        loop.finish()

    try:
        loop.prepare()
        loop.planner.keyed = frozenset()  # as a Worker's start finds the queue: never given a keyed job
        work.enqueue_many({"n": n} for n in range(20))
        drain()
        # The first claim had nothing to finish, nor had the try after the last batch's empty claim
        # (Planner.tries: the claim that carried outcomes could not see a job they made available).
        assert families() == {"job_claim_only": 2, "job_complete_claim": 4}, executed()
        before = executed()
        failing.add(103)
        work.enqueue_many({"n": n} for n in range(100, 110))
        drain()
        finished = {n: c for n, c in executed().items() if n.startswith("job_finish_claim")}
        assert finished, executed()
        # The failure's record applied: the job waits for its retry with its error on the row.
        [(state, error)] = conn.execute(
            "SELECT state::text, errors -> -1 ->> 'error' FROM fastjobs_jobs_all WHERE args ->> 'n' = '103'"
        ).fetchall()
        assert state == "retryable" and "job 103 fails" in error
        completed = {"completed": 29} if keep_completed else {}
        assert by_state(dsn) == {"retryable": 1, **completed}
        assert sum(executed().values()) > sum(before.values())
    finally:
        loop.finish()
        conn.close()


def test_a_queues_first_keyed_job_marks_it_and_its_claims_take_keyed_jobs_from_then_on(app: App, dsn) -> None:
    """A queue never given a keyed job claims by the statements that take keyless jobs only
    (migration 012: no key, turn or count read); its first keyed job marks it, whatever inserted it
    (a trigger on slot 0, where keyed jobs land), a running worker's heartbeat reads the mark, and
    its claims take keyed jobs from then on."""
    ran: list[tuple[str, int]] = []

    @app.job(kind="plain")
    def plain(n: int) -> None:
        ran.append(("plain", n))

    # The worker's version of the kind knows no limit (a rolling deploy adding one); the producer's
    # does, and its jobs carry it (a worker whose own app limits a kind of a queue claims that
    # queue's keyed jobs from its start: Worker.run).
    @app.job(kind="keyed")
    def keyed(tenant: str, n: int) -> None:
        ran.append(("keyed", n))

    producer = App(dsn)
    producer.job(kind="keyed", concurrency_key="tenant", concurrency_limit=1)(keyed)
    conn = psycopg.connect(dsn, autocommit=True)

    def marked() -> list[str]:
        return [r[0] for r in conn.execute("SELECT name FROM fastjobs_queues WHERE keyed ORDER BY name")]

    try:
        # The state lane's claims only (a fast-lane lock of an app limiting a kind takes keyed jobs).
        config = WorkerConfig(poll_interval=0.1, fast_lane=False)
        with WorkerThread(Worker(app, config=config)) as thread:
            app.enqueue("plain", {"n": 1})
            assert wait_for(lambda: ("plain", 1) in ran), "the plain job did not run"
            assert thread.worker.loop is not None
            planner = thread.worker.loop.planner
            assert marked() == [] and planner.keyed == frozenset() and planner.keyless(0)
            producer.enqueue("keyed", {"tenant": "a", "n": 2})
            assert marked() == ["default"]
            # Within a heartbeat (HEARTBEAT_INTERVAL, 2 s), once it told the loop.
            assert wait_for(lambda: ("keyed", 2) in ran, timeout=10), "the keyed job did not run"
            assert planner.keyed == frozenset({0})
        # A producer of any version: a keyed row inserted by hand marks its queue too.
        conn.execute(
            "INSERT INTO fastjobs_jobs (queue, kind, args, limit_key, limit_concurrency)"
            " VALUES ('other', 'keyed', '{\"tenant\": \"b\", \"n\": 3}', 'b', 1)"
        )
        assert marked() == ["default", "other"]
        # A loop told its queue has no keyed job passes the job over; told it has, it takes it.
        loop = core.BatchLoop(conn, dict(app.jobs), Executor(10), "w", ["other"], fast_lane=False)
        loop.prepare()
        loop.planner.keyed = frozenset()
        assert loop.step() == 0
        loop.planner.keyed = frozenset({0})
        assert loop.step() == 1 and ("keyed", 3) in ran
        loop.finish()
    finally:
        producer.close()
        conn.close()


@pytest.mark.parametrize("lane", ["fast", "state"])
def test_a_workers_loop_plans_its_statements_before_its_first_job_and_never_again(
    app: App, dsn, lane
) -> None:
    """A worker's loop plans each of its statements once, at prepare(plan_ahead=True), on the generic
    plan its session asks for: its first jobs' claims wait for no planning (in auto mode each statement
    planned five custom plans first, 2-7 ms each, during the first jobs: issue 22 §5)."""
    app.job(kind="warm")(lambda: None)
    _, seen = handler_event(app, "work")
    conn = psycopg.connect(dsn, autocommit=True)

    def plans() -> dict[str, tuple[int, int]]:
        rows = conn.execute("SELECT name, generic_plans, custom_plans FROM pg_prepared_statements").fetchall()
        return {name: (generic, custom) for name, generic, custom in rows}

    try:
        conn.execute(app.sql.worker_session)
        loop = core.BatchLoop(conn, dict(app.jobs), Executor(10), "w", ["default"], batch_min=20,
                              batch_max=20, overlap=False, fast_lane=lane == "fast")  # fmt: skip
        loop.prepare(plan_ahead=True)
        planned = plans()
        assert len(planned) >= (14 if lane == "fast" else 8), planned
        assert set(planned.values()) == {(1, 0)}, planned  # each planned once, generic, none run
        warm(app, loop)
        app.enqueue_many("work", ({"n": n} for n in range(20)))
        assert loop.step() == 20 and loop.fast == (20 if lane == "fast" else 0)
        loop.stopping = True
        loop.finish()
        ran = plans()
        assert all(custom == 0 for _, custom in ran.values()), ran
        assert sum(generic for generic, _ in ran.values()) > sum(generic for generic, _ in planned.values())
        assert sorted(seen) == list(range(20))
    finally:
        conn.close()
