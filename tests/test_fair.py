"""Fair sharing within a queue (issue 26 §4, migrations/010_fair.sql): keyed jobs are claimed
round-robin across their keys, on both lanes and loops, by several worker processes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from typing import Any

import psycopg
import pytest

from fastjobs import App, sql

from . import procs
from .helpers import batch_loop, by_state, drain, query, warm

_AVAILABLE = "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'available'"
_BUCKET = "SELECT extract(epoch FROM refilled_at)::float8 AS at, tokens FROM fastjobs_queues"


def _db_clock(dsn: str) -> float:
    """The database's clock, in seconds: what fastjobs_room's buckets refill by."""
    return float(query(dsn, "SELECT extract(epoch FROM clock_timestamp())::float8 AS now")[0]["now"])


def _keys(dsn: str) -> dict[int, str | None]:
    """Each pending job's fairness key, by its `n`."""
    rows = query(dsn, "SELECT (args->>'n')::int AS n, fair_key FROM fastjobs_jobs_all")
    return {row["n"]: row["fair_key"] for row in rows}


def test_a_kind_s_fair_key_is_an_argument_or_a_callable_and_a_call_may_give_its_own(
    app: App, dsn: str
) -> None:
    app.job(kind="by_name", fair_key="tenant")(lambda n, tenant=None: None)
    app.job(kind="by_callable", fair_key=lambda args: args["org"]["id"])(lambda n, org: None)
    app.job(kind="plain")(lambda n: None)
    app.enqueue("by_name", {"n": 1, "tenant": "acme"})
    app.enqueue("by_name", {"n": 2, "tenant": 42})  # an int is stored as its decimal
    app.enqueue("by_name", {"n": 3})  # no such argument: no key
    app.enqueue("by_name", {"n": 4, "tenant": "acme"}, fair_key="override")
    app.enqueue("by_callable", {"n": 5, "org": {"id": 7}})
    app.enqueue("plain", {"n": 6}, fair_key="given")
    app.enqueue("plain", {"n": 7})
    app.enqueue("by_name", {"n": 8, "tenant": "later"}, delay=60)  # job_insert, into slot 0
    assert app.enqueue_many("by_name", ({"n": n, "tenant": f"t{n % 2}"} for n in range(10, 14))) == 4
    assert app.enqueue_many("plain", ({"n": n} for n in range(20, 22)), fair_key="bulk") == 2
    assert app.enqueue_many("by_callable", ({"n": 30, "org": {"id": "x"}},), delay=60) == 1
    app.job(kind="unique", fair_key="tenant", unique=True)(lambda n, tenant: None)
    assert app.enqueue_many("unique", ({"n": 40, "tenant": "u"}, {"n": 40, "tenant": "u"})) == 1

    async def enqueue_async() -> None:
        await app.enqueue_async("by_name", {"n": 50, "tenant": "async"})

    asyncio.run(enqueue_async())
    assert _keys(dsn) == {
        1: "acme",
        2: "42",
        3: None,
        4: "override",
        5: "7",
        6: "given",
        7: None,
        8: "later",
        10: "t0",
        11: "t1",
        12: "t0",
        13: "t1",
        20: "bulk",
        21: "bulk",
        30: "x",
        40: "u",
        50: "async",
    }


def test_a_bad_fair_key_is_refused_with_a_clear_error_and_nothing_is_enqueued(app: App, dsn: str) -> None:
    with pytest.raises(TypeError, match="fair_key= names 'tenant', not an argument of it"):
        app.job(kind="wrong", fair_key="tenant")(lambda n: None)
    with pytest.raises(TypeError, match="an argument's name or a callable"):
        app.job(kind="wrong3", fair_key=3)(lambda n: None)  # type: ignore[call-overload]
    app.job(kind="k", fair_key="tenant")(lambda n, tenant: None)
    with pytest.raises(TypeError, match="a fairness key must be a string or an int, not dict"):
        app.enqueue("k", {"n": 1, "tenant": {"id": 1}})
    with pytest.raises(ValueError, match="a fairness key must be 1 to 256 characters"):
        app.enqueue("k", {"n": 1, "tenant": ""})
    with pytest.raises(ValueError, match="a fairness key must be 1 to 256 characters"):
        app.enqueue("k", {"n": 1, "tenant": "x"}, fair_key="y" * 257)
    with pytest.raises(TypeError, match="not bool"):
        app.enqueue_many("k", ({"n": n, "tenant": "a" if n < 5 else True} for n in range(10)))
    assert by_state(dsn) == {}  # the bulk enqueue is all or nothing


def _tenants(ran: list[tuple[str, int]]) -> str:
    return "".join(tenant for tenant, _ in ran)


@pytest.mark.parametrize("fast_lane", [True, False])
def test_keyed_jobs_are_claimed_round_robin_across_keys_on_either_lane(
    app: App, dsn: str, fast_lane: bool
) -> None:
    """A's 200 jobs enqueued first, then B's 20: B's all run within the first batches, A's and
    B's interleaved, where without keys they would wait for every one of A's."""
    ran: list[tuple[str, int]] = []
    app.job(kind="warm")(lambda: None)
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append((tenant, n)))
    with batch_loop(app, 20, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        app.enqueue_many("k", ({"tenant": "A", "n": n} for n in range(200)))
        app.enqueue_many("k", ({"tenant": "B", "n": n} for n in range(20)))
        batches = [loop.step() for _ in range(2)]
        assert batches == [20, 20]
        assert _tenants(ran).count("B") == 20, _tenants(ran)
        while loop.step():
            pass
        loop.finish()
        assert (loop.fast > 0) is fast_lane
    # Each key's jobs in their order; every job once.
    assert [n for tenant, n in ran if tenant == "A"] == list(range(200))
    assert [n for tenant, n in ran if tenant == "B"] == list(range(20))
    assert by_state(dsn) == {}


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_higher_priority_job_is_not_delayed_by_fairness(app: App, dsn: str, fast_lane: bool) -> None:
    ran: list[tuple[str, int]] = []
    app.job(kind="warm")(lambda: None)
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append((tenant, n)))
    with batch_loop(app, 10, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        app.enqueue_many("k", ({"tenant": "A", "n": n} for n in range(50)))
        app.enqueue_many("k", ({"tenant": "B", "n": n} for n in range(50)))
        app.enqueue("k", {"tenant": "C", "n": 0}, priority=5)
        app.enqueue("k", {"tenant": None, "n": 1}, priority=5)  # no key, and urgent
        assert loop.step() == 2  # the claim takes the highest priority due, alone
        assert set(ran) == {("C", 0), (None, 1)}
        assert loop.step() == 10
        assert _tenants(ran[2:]) == "A" * 5 + "B" * 5
        while loop.step():
            pass
        loop.finish()
    assert len(ran) == 102


def test_jobs_without_a_key_take_one_turn_among_the_keys_and_a_queue_without_keys_claims_in_order(
    app: App, dsn: str
) -> None:
    ran: list[tuple[str | None, int]] = []
    app.job(kind="k", fair_key="tenant")(lambda n, tenant=None: ran.append((tenant, n)))
    app.enqueue_many("k", ({"n": n} for n in range(30)))
    app.enqueue_many("k", ({"tenant": "A", "n": n} for n in range(30, 60)))
    with batch_loop(app, 12, overlap=False) as loop:
        assert loop.step() == 12  # the keyless and A, 6 each, the keyless first in turn
        assert ran == [(None, n) for n in range(6)] + [("A", n) for n in range(30, 36)]
        while loop.step():
            pass
        loop.finish()
    assert sorted(n for _, n in ran) == list(range(60))
    ran.clear()
    app.enqueue_many("k", ({"n": n} for n in range(100, 140)))  # no key at all: queue order
    with batch_loop(app, 15, overlap=False) as loop:
        assert loop.step() == 15
        assert ran == [(None, n) for n in range(100, 115)]
        while loop.step():
            pass
        loop.finish()


def test_a_claim_visits_at_most_256_keys_and_the_next_goes_on_from_where_it_stopped(
    app: App, dsn: str
) -> None:
    """A claim's cost is bounded by the keys it visits (256 at most, whatever it asks for), and the
    claims take turns from where the last stopped: with 500 keys of 3 jobs each, the first 490
    jobs run are of 489 or 490 different keys (claims from the first key each time would take the first
    hundred keys' jobs over and over)."""
    ran: list[str] = []
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append(tenant))
    app.enqueue_many("k", ({"tenant": f"t{n % 1000:04d}", "n": n} for n in range(1000)))
    with batch_loop(app, 1000, overlap=False, fast_lane=False) as loop:
        assert loop.step() == 255  # one job of 255 keys, the keyless' turn the 256th (none)
        assert len(set(ran)) == 255
        while loop.step():
            pass
        loop.finish()
    assert sorted(ran) == sorted(f"t{n:04d}" for n in range(1000))
    ran.clear()
    app.enqueue_many("k", ({"tenant": f"t{n % 500:04d}", "n": n} for n in range(1500)))
    with batch_loop(app, 100, overlap=False) as loop:
        while len(ran) < 490:
            assert loop.step()
        # The first claim's turn of the keyless (none here) leaves one of its 100 to the keys it
        # visited: its first key runs a second job early; claims starting from the first key each
        # time would run about 100 keys' jobs in the first 490.
        assert len(set(ran[:490])) >= 489
        while loop.step():
            pass
        loop.finish()
    assert len(ran) == 1500


def test_a_fair_queue_keeps_its_concurrency_limit_and_its_pause(app: App, dsn: str) -> None:
    ran: list[str] = []
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append(tenant))
    app.enqueue_many("k", ({"tenant": "A", "n": n} for n in range(20)))
    app.enqueue_many("k", ({"tenant": "B", "n": n} for n in range(4)))
    app.limit_queue("default", concurrency=3)
    with batch_loop(app, 100, overlap=False) as loop:
        query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running' WHERE (args->>'n')::int = 19")
        assert loop.step() == 2  # 3 less the one running
        app.pause("default")
        assert loop.step() == 0
        app.resume("default")
        app.limit_queue("default", concurrency=None)
        assert loop.step() == 21
        loop.finish()
    assert by_state(dsn) == {"running": 1}


def test_a_claim_of_fewer_than_two_jobs_a_key_takes_as_many_as_it_asks_for(app: App, dsn: str) -> None:
    """19 asked of 10 keys with 3 jobs each: one job of each key, then 9 more in turn (migration 011;
    010's claim dropped what did not divide when the share was one job a key, and took 10)."""
    ran: list[str] = []
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append(tenant))
    app.enqueue_many("k", ({"tenant": f"t{n % 10}", "n": n} for n in range(30)))
    with batch_loop(app, 19, overlap=False, fast_lane=False) as loop:
        assert loop.step() == 19
        assert len(set(ran[:10])) == 10  # every key's first job before any key's second
        while loop.step():
            pass
        loop.finish()
    assert sorted(ran) == sorted(f"t{n % 10}" for n in range(30))


def test_keyed_jobs_keep_their_key_when_the_rotation_moves_them(app: App, dsn: str) -> None:
    """The rotation copies rows whole (sql._ROW): keyed jobs it moves out of a slot keep their key."""
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: None)
    app.enqueue_many("k", ({"tenant": f"t{n % 3}", "n": n} for n in range(30)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        slot = conn.execute("SELECT DISTINCT slot FROM fastjobs_jobs_all").fetchall()
        assert len(slot) == 1 and slot[0][0] != 0
        moved = psycopg.RawCursor(conn).execute(sql.slot_evacuate, (slot[0][0], 1000)).rowcount
        assert moved == 30
    assert _keys(dsn) == {n: f"t{n % 3}" for n in range(30)}
    assert {row["slot"] for row in query(dsn, "SELECT slot FROM fastjobs_jobs_all")} == {0}
    drain(app)
    assert by_state(dsn) == {}


def test_two_worker_processes_run_a_late_tenant_s_jobs_before_the_early_tenant_s_backlog(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """`fastjobs run --processes 2`: 3,000 jobs of A enqueued first, then 30 of B. B's last job
    starts before most of A's: without fairness it would start after all 3,000."""
    app.enqueue_many("record", ({"n": n} for n in range(3000)), fair_key="A")
    app.enqueue_many("record", ({"n": 10_000 + n} for n in range(30)), fair_key="B")
    master = masters.start("--processes", "2")
    procs.wait_for(lambda: len(procs.runs(db)) == 3030 or None, "every job to run", timeout=120)
    assert master.stop() == 0, master.stderr()
    last_b = db.execute("SELECT max(at) FROM runs WHERE n >= 10000").fetchone()
    assert last_b is not None
    a_before = procs.count(db, "SELECT count(*) FROM runs WHERE n < 10000 AND at < %s", last_b[0])
    assert a_before < 1500, a_before
    assert procs.runs(db) == {n: 1 for n in [*range(3000), *range(10_000, 10_030)]}


def test_the_fair_key_column_is_written_by_every_insert_path(app: App, dsn: str) -> None:
    """A scheduled keyed job keeps its key once promoted (job_insert's $11), and is claimed fairly."""
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: None)
    at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    app.enqueue("k", {"tenant": "a", "n": 1}, run_at=at)
    assert _keys(dsn) == {1: "a"}
    drain(app)
    assert by_state(dsn) == {}


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_fair_rate_limited_queue_starts_jobs_at_its_rate_not_at_half_of_it(
    app: App, dsn: str, fast_lane: bool
) -> None:
    """20 a second, keyed jobs of two tenants: the first claim takes the full bucket (20), and the
    claims of the next second take about 20 more, shared by the tenants. A claim that took its
    tokens twice (once for the queue-order branch it does not use) would start a fraction of that."""
    ran: list[str] = []
    app.job(kind="k", fair_key="tenant")(lambda tenant, n: ran.append(tenant))
    app.enqueue_many("k", ({"tenant": "AB"[n % 2], "n": n} for n in range(200)))
    app.limit_queue("default", rate_limit="20/s")
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        before = _db_clock(dsn)
        assert loop.step() == 20  # a full bucket: one second's worth
        after = _db_clock(dsn)
        while _db_clock(dsn) - after < 1.0:
            loop.step()
            time.sleep(0.05)
        end = _db_clock(dsn)
        # Started: claimed, run or not (a step's finish statement claims the next batch).
        started = 200 - query(dsn, _AVAILABLE)[0]["count"]
        [bucket] = query(dsn, _BUCKET)
        loop.finish()
        assert loop.fast == 0
    # The bucket refilled from the first claim (between `before` and `after`) to the last (when it
    # last took tokens, as the queue's row says), by the database's clock; what it holds was not spent.
    # A fair claim starts what it took tokens for while its keys have jobs (011); 0.85 allows for
    # the claims still in flight when the window closed.
    at, left = bucket["at"], bucket["tokens"]
    assert at - after >= 0.5 and left < 20  # claims went on through the window
    assert started <= 20 + 20 * (end - before) + 1, (started, end - before)  # never ahead of the rate
    spent = 20 + 20 * (at - after) - left
    assert started >= 0.85 * spent - 1, (started, spent)  # nor behind it
    assert min(ran.count("A"), ran.count("B")) >= len(ran) // 3, ran  # both tenants ran


def test_queues_list_shows_which_queues_are_marked_fair(app: App, dsn: str) -> None:
    app.enqueue("k", {"n": 1}, queue="shared", fair_key="A")
    app.enqueue("k", {"n": 2}, queue="plain")
    assert {q.name: q.fair for q in app.queues()} == {"plain": False, "shared": True}
    listed = procs.cli(dsn, "queues", "list").stdout.splitlines()
    assert listed[0].split()[-1] == "fair"
    assert {line.split()[0]: line.split()[-1] for line in listed[1:]} == {"plain": "0", "shared": "fair"}
    found = json.loads(procs.cli(dsn, "queues", "list", "--json").stdout)
    assert {q["name"]: q["fair"] for q in found} == {"plain": False, "shared": True}
