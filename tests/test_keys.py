"""Concurrency and rate limits per key and per kind (fastjobs.keys, migrations/009_keys.sql)."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import textwrap
import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from fastjobs import App, Cancel, Snooze, maintenance, metrics, sql
from fastjobs.scoreboard import Scoreboard

from . import procs
from .helpers import batch_loop, by_state, query, warm
from .procs import cli
from .test_stats import samples

KEYED = '''
"""Keyed handlers for the property test: each execution is one row of `runs`, a short sleep, then
one row of `ends`."""

import os
import random
import time

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {}


def _record(n, table="runs"):
    if os.getpid() not in _conn:
        _conn.clear()
        _conn[os.getpid()] = psycopg.connect(os.environ["FJ_TEST_RUNS_DSN"], autocommit=True)
    _conn[os.getpid()].execute(f"INSERT INTO {table} (n, pid) VALUES (%s, %s)", (n, os.getpid()))


@app.job("tenant_job", queue="keyed", concurrency_key="tenant", concurrency_limit=3)
def tenant_job(n, tenant, sleep):
    _record(n)
    time.sleep(sleep)
    _record(n, "ends")


@app.job("team_job", queue="keyed", concurrency_key=lambda args: args["team"] % 3, concurrency_limit=2)
def team_job(n, team, sleep):
    _record(n)
    time.sleep(sleep)
    _record(n, "ends")
'''


def _most_at_once(
    db: psycopg.Connection[Any], key_of: dict[int, tuple[str, str]], victim: int, killed: Any
) -> Counter[tuple[str, str]]:
    """Per key, the most of its handlers that ran at once, from their runs' start and end rows (a
    fast-lane job in flight is not `running` in the table: the handlers' own record counts it). A
    run's start row is written after it starts and its end row before it returns, so two runs
    one after the other never look overlapping. A run of the killed worker without an end ended
    at the kill (`killed`, read just before it)."""
    rows = db.execute(
        "SELECT r.n, r.at, coalesce((SELECT min(e.at) FROM ends e WHERE e.n = r.n AND e.pid = r.pid"
        " AND e.at >= r.at), CASE WHEN r.pid = %s THEN greatest(r.at, %s) END) FROM runs r",
        (victim, killed),
    ).fetchall()
    assert all(end is not None for _, _, end in rows), rows  # every run ended, or was killed
    most: Counter[tuple[str, str]] = Counter()
    for n, start, _ in rows:
        key = key_of[n]
        at_once = sum(1 for m, s, e in rows if key_of[m] == key and s <= start <= e)
        most[key] = max(most[key], at_once)
    return most


def _running_by_key(conn: psycopg.Connection[Any]) -> list[tuple[str, str, int]]:
    return conn.execute(
        "SELECT kind, limit_key, count(*)::int FROM fastjobs_jobs_all WHERE state = 'running'"
        " AND limit_key IS NOT NULL GROUP BY kind, limit_key"
    ).fetchall()


def test_no_key_ever_runs_more_than_its_limit_across_processes_with_a_worker_killed(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Randomized: jobs of two keyed kinds (an argument's key, a callable's) over random keys, one
    key with a limit of its own (limit_key), drained by two masters of three worker processes,
    one worker SIGKILLed mid-run. Sampled from the database while they run, no key ever has more
    jobs running than its limit; from the handlers' own records (which count the fast lane's jobs
    in flight too), no key ever ran more at once; the limit binds (some key reaches it), and every
    job runs."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    (masters.cwd / "fjkeys.py").write_text(textwrap.dedent(KEYED))
    # The producer declares the kinds as the workers' module does: a job carries its key and limit.
    app.job(kind="tenant_job", queue="keyed", concurrency_key="tenant", concurrency_limit=3)(
        lambda n, tenant, sleep: None
    )
    app.job(kind="team_job", queue="keyed", concurrency_key=lambda a: a["team"] % 3, concurrency_limit=2)(
        lambda n, team, sleep: None
    )
    tenants = [f"t{i}" for i in range(rng.randint(3, 8))]
    jobs: list[tuple[str, dict[str, Any]]] = []
    for n in range(rng.randint(150, 250)):
        sleep = rng.choice([0.0, 0.01, 0.03, 0.08])
        if rng.random() < 0.6:
            jobs.append(("tenant_job", {"n": n, "tenant": rng.choice(tenants), "sleep": sleep}))
        else:
            jobs.append(("team_job", {"n": n, "team": rng.randrange(9), "sleep": sleep}))
    for kind, args in jobs:
        app.enqueue(kind, args)
    db.execute(
        "CREATE TABLE ends (n int NOT NULL, pid int NOT NULL, at timestamptz DEFAULT clock_timestamp())"
    )
    key_of = {
        n: (kind, str(args["tenant"])) if kind == "tenant_job" else (kind, str(args["team"] % 3))
        for n, (kind, args) in enumerate(jobs)
    }
    app.limit_key("tenant_job", tenants[0], concurrency=1)
    limits = {("tenant_job", t): 3 for t in tenants} | {("tenant_job", tenants[0]): 1}
    limits |= {("team_job", str(t)): 2 for t in range(3)}
    seen: Counter[tuple[str, str]] = Counter()
    over: list[tuple[str, str, int]] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            while not done.is_set():
                for kind, key, running in _running_by_key(conn):
                    seen[kind, key] = max(seen[kind, key], running)
                    if running > limits[kind, key]:
                        over.append((kind, key, running))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        options = ("--processes", "3", "--queues", "keyed", "--rescue-after", "5")
        first = masters.start(*options, module="fjkeys")
        second = masters.start(*options, module="fjkeys")
        victim = first.wait_child("fastjobs: worker 1 ")
        procs.wait_for(lambda: procs.count(db, "SELECT count(*) FROM runs") > 20 or None, "jobs to run")
        killed = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        os.kill(victim, signal.SIGKILL)
        procs.wait_for(lambda: set(procs.runs(db)) == set(range(len(jobs))) or None, "every job", timeout=90)
        procs.wait_for(lambda: not by_state(app.dsn) or None, "every job to end", timeout=30)
        assert first.stop() == 0, first.stderr()
        assert second.stop() == 0, second.stderr()
    finally:
        done.set()
        sampler.join()
    assert not over, (seed, over[:5])
    at_once = _most_at_once(db, key_of, victim, killed)
    assert all(at_once[key] <= limits[key] for key in at_once), (seed, at_once)
    assert any(seen[key] == limit or at_once[key] == limit for key, limit in limits.items() if limit > 1), (
        seed,
        seen,
        at_once,
    )
    assert set(seen) <= set(limits), seed
    assert max(procs.runs(db).values()) <= 2, seed  # at least once: the killed worker's jobs again


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_claim_takes_no_more_of_a_key_than_its_limit_leaves(app: App, dsn: str, fast_lane: bool) -> None:
    """Per key, a claim takes at most the limit less the key's jobs running, in claim order; jobs
    without a key alongside are taken as before; completed jobs free their places. On either lane:
    the fast lane's lock counts keys as the state lane's claim does."""
    app.job(kind="warm")(lambda: None)
    ran: list[tuple[str, int]] = []
    keyed = app.job(kind="k", concurrency_key="tenant", concurrency_limit=2)(
        lambda tenant, n: ran.append((tenant, n))
    )
    app.job(kind="free")(lambda n: ran.append(("free", n)))
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        keyed.enqueue_many([{"tenant": t, "n": n} for n in range(5) for t in ("a", "b")])
        app.enqueue_many("free", ({"n": n} for n in range(3)))
        query(
            dsn,
            "UPDATE fastjobs_jobs_all SET state = 'running' WHERE args->>'tenant' = 'b' AND args->>'n' = '0'",
        )
        assert loop.step() == 2 + 1 + 3  # a: 2 places; b: 2 less the one running; every free job
        assert Counter(t for t, _ in ran) == {"a": 2, "b": 1, "free": 3}
        assert [n for t, n in ran if t == "a"] == [0, 1]  # claim order within a key
        assert loop.step() == 3  # the batch completed: a has 2 places again, b 1
        assert loop.step() == 2  # a's last, and one of b's
        assert loop.step() == 1  # b's last: b never had more than 2 running
        assert loop.step() == 0
        loop.finish()
        assert (loop.fast == 2 + 1 + 3 + 3 + 2 + 1) == fast_lane
    assert by_state(dsn) == {"running": 1}  # b's job 0, set running by hand


def _three_of_a_limited_to_1_and_two_plain(dsn: str) -> None:
    """Enqueue, as a producer that declares the kind's key: 3 jobs of key a (limit 1), 2 plain."""
    producer = App(dsn)
    producer.job(kind="k", concurrency_key="tenant", concurrency_limit=1)(lambda tenant, n: None)
    producer.enqueue_many("k", ({"tenant": "a", "n": n} for n in range(3)))
    producer.declare("plain")
    producer.enqueue_many("plain", ({"n": n} for n in range(2)))
    producer.close()


def test_the_fast_lane_takes_no_keyed_job_from_a_worker_that_does_not_know_the_key(
    app: App, dsn: str
) -> None:
    """A worker whose app declares the kind without its key (another version of the code) may
    take the queue's fast lane: its lock (planner.takes_keys: none) skips every job that carries a
    key, and the state lane's claim, whatever it knows, enforces the limit the job was enqueued with."""
    _three_of_a_limited_to_1_and_two_plain(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = psycopg.RawCursor(conn)
        with conn.transaction():
            locked = cur.execute(sql.job_lock_many, ("default", 100)).fetchall()
        assert sorted(row[1] for row in locked) == ["plain", "plain"]
        claimed = cur.execute(sql.job_claim_many, ("default", 100, "w")).fetchall()
        assert sorted(row[1] for row in claimed) == ["k", "plain", "plain"]  # one of tenant a's
        assert cur.execute(sql.job_claim_many, ("default", 100, "w2")).fetchall() == []


def test_the_fast_lane_holds_its_keyed_jobs_places_to_its_batch_s_commit(app: App, dsn: str) -> None:
    """The lock of a worker with keyed kinds (job_lock_keyed_*) takes a keyed job in its group's
    turn, up to the limit the job was enqueued with, and holds the group to its transaction's end:
    its jobs in flight are not `running` in the table, so a state-lane claim meanwhile takes none
    of the key's jobs; once the batch commits (its jobs left available, as a fast batch stopped
    at its deadline leaves them), the next claim takes one of them."""
    _three_of_a_limited_to_1_and_two_plain(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as other:
        cur, claims = psycopg.RawCursor(conn), psycopg.RawCursor(other)
        with conn.transaction():
            locked = cur.execute(sql.job_lock_keyed_many, ("default", 100)).fetchall()
            assert sorted(row[1] for row in locked) == ["k", "plain", "plain"]  # one of tenant a's
            assert claims.execute(sql.job_claim_many, ("default", 100, "w")).fetchall() == []
        claimed = claims.execute(sql.job_claim_many, ("default", 100, "w")).fetchall()
        assert sorted(row[1] for row in claimed) == ["k", "plain", "plain"]
        with conn.transaction():  # a's place is taken, now by a running job
            assert cur.execute(sql.job_lock_keyed_many, ("default", 100)).fetchall() == []


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_rate_limit_per_kind_and_per_key_starts_at_most_a_bucket_of_one_second(
    app: App, dsn: str, fast_lane: bool
) -> None:
    """rate_limit without a key: one bucket for the kind; with a key: one per key. Each starts full
    (one second's worth) and refills at the rate, so the jobs started never run ahead of it."""
    app.job(kind="warm")(lambda: None)
    app.job(kind="paced", rate_limit="10/s")(lambda n: None)
    app.job(kind="per_key", concurrency_key="tenant", rate_limit="4/s")(lambda tenant, n: None)
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        app.enqueue_many("paced", ({"n": n} for n in range(25)))
        app.enqueue_many("per_key", ({"tenant": t, "n": n} for n in range(8) for t in ("a", "b")))
        began = time.monotonic()
        assert loop.step() == 10 + 4 + 4  # full buckets: the kind's 10, each key's 4
        ran = 18
        while ran < 25 + 16:
            ran += loop.step()
            assert ran <= 18 + 18 * (time.monotonic() - began) + 2  # never ahead of the rates
        assert time.monotonic() - began >= 1.4  # 15 more of the kind at 10 a second
        loop.finish()
        assert (loop.fast > 0) == fast_lane
    rows = query(dsn, "SELECT kind, key, rate_limit FROM fastjobs_limits ORDER BY kind, key")
    assert [(r["kind"], r["key"]) for r in rows] == [("paced", ""), ("per_key", "a"), ("per_key", "b")]


def test_claims_of_keys_in_other_groups_do_not_wait_for_a_claim_in_progress(app: App, dsn: str) -> None:
    """A claim that holds keys a and c (its transaction still open) leaves their remaining jobs to
    no one, but a second claim meanwhile takes key b's at once, without waiting for the first to
    commit, and passes over a's and c's; once the first commits, a third sees its jobs running."""
    group = "abs(hashtext('k:' || %s) %% 16)"  # migration 011's fastjobs_key_group, spelled out
    keys = ["a", "b", "c"]
    groups = [query(dsn, f"SELECT {group} AS g", (k,))[0]["g"] for k in keys]
    assert len(set(groups)) == 3  # three keys, three groups
    app.job(kind="k", concurrency_key="tenant", concurrency_limit=2)(lambda tenant, n: None)
    app.enqueue_many("k", ({"tenant": t, "n": n} for n in range(4) for t in ("a", "c")))
    app.enqueue_many("k", ({"tenant": "b", "n": n} for n in range(4)))
    with psycopg.connect(dsn) as first, psycopg.connect(dsn, autocommit=True) as second:
        claimed = psycopg.RawCursor(first).execute(sql.job_claim_many, ("default", 4, "w1")).fetchall()
        assert Counter(row[2]["tenant"] for row in claimed) == {"a": 2, "c": 2}
        second.execute("SET lock_timeout = '2s'")
        cur = psycopg.RawCursor(second)
        claimed = cur.execute(sql.job_claim_many, ("default", 100, "w2")).fetchall()
        assert Counter(row[2]["tenant"] for row in claimed) == {"b": 2}
        first.commit()
        assert cur.execute(sql.job_claim_many, ("default", 100, "w3")).fetchall() == []  # all at 2
    assert Counter(
        r["tenant"]
        for r in query(dsn, "SELECT args->>'tenant' AS tenant FROM fastjobs_jobs_all WHERE state = 'running'")
    ) == {"a": 2, "b": 2, "c": 2}


def test_keys_at_their_limits_do_not_keep_a_claim_from_a_key_behind_them(app: App, dsn: str) -> None:
    """Four keys of four groups at their limit of 1, with jobs waiting, ahead of a fifth key's one
    job: a claim takes the fifth key's job (a claim holds at most 4 groups with room; holding the
    four full ones as its 4 would pass over the fifth until their backlogs drained)."""
    group = "abs(hashtext('k:' || %s) %% 16)"  # migration 011's fastjobs_key_group, spelled out
    keys: list[str] = []
    groups: set[int] = set()
    for n in range(100):
        g = query(dsn, f"SELECT {group} AS g", (f"t{n}",))[0]["g"]
        if g not in groups:
            groups.add(g)
            keys.append(f"t{n}")
        if len(keys) == 5:
            break
    app.job(kind="k", concurrency_key="tenant", concurrency_limit=1)(lambda tenant, n: None)
    app.enqueue_many("k", ({"tenant": t, "n": n} for n in range(4) for t in keys[:4]))
    query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running' WHERE (args->>'n')::int = 0")
    app.enqueue("k", {"tenant": keys[4], "n": 9})
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = psycopg.RawCursor(conn).execute(sql.job_claim_many, ("default", 100, "w")).fetchall()
    assert [row[2]["tenant"] for row in claimed] == [keys[4]]


def test_a_limit_of_its_own_for_some_keys_from_code_and_the_command_line(app: App, dsn: str) -> None:
    app.job(kind="k", concurrency_key="tenant", concurrency_limit=3)(lambda tenant, n: None)
    app.enqueue_many("k", ({"tenant": t, "n": n} for n in range(4) for t in ("vip", "std")))
    app.limit_key("k", "vip", concurrency=1)
    with batch_loop(app, 100, overlap=False) as loop:
        query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running' WHERE args->>'n' = '0'")
        assert loop.step() == 0 + 2  # vip: 1 less the one running; std: 3 less 1
    done = cli(dsn, "queues", "key", "k", "vip", "--concurrency", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"kind": "k", "key": "vip", "concurrency": 2}
    listed = cli(dsn, "queues", "keys", "--json")
    assert json.loads(listed.stdout) == [
        {"kind": "k", "key": "vip", "concurrency": 2, "rate_limit": None, "running": 1}
    ]
    app.limit_key("k", "vip", concurrency=None)  # back to the declared 3
    assert json.loads(cli(dsn, "queues", "keys", "--json").stdout) == []
    bad = cli(dsn, "queues", "key", "k", "vip", "--concurrency", "0")
    assert bad.returncode == 2 and "expected a positive integer or none, not '0'" in bad.stderr


def test_bad_keys_and_limits_are_refused_with_a_clear_error_and_enqueue_nothing(app: App, dsn: str) -> None:
    with pytest.raises(TypeError, match="concurrency_key= names 'tenant', not an argument of it"):
        app.job(kind="a", concurrency_key="tenant", concurrency_limit=1)(lambda n: None)
    with pytest.raises(TypeError, match="concurrency_key must be an argument's name or a callable"):
        app.job(kind="b", concurrency_key=5, concurrency_limit=1)(lambda n: None)  # type: ignore[call-overload]
    bads: list[Any] = [0, -1, True, 1.5, 2**31]
    for bad in bads:
        with pytest.raises(ValueError, match="concurrency_limit must be a positive integer"):
            app.job(kind="c", concurrency_key="n", concurrency_limit=bad)(lambda n: None)
    with pytest.raises(ValueError, match="rate_limit must read N/PERIOD"):
        app.job(kind="d", rate_limit="fast")(lambda n: None)
    job = app.job(kind="e", concurrency_key="tenant", concurrency_limit=1)(lambda tenant=None, **kw: None)
    with pytest.raises(
        ValueError, match="its concurrency_key is the argument 'tenant', which this job lacks"
    ):
        job.enqueue(other=1)
    with pytest.raises(
        ValueError, match="its concurrency_key is the argument 'tenant', which this job lacks"
    ):
        job.enqueue_many([{"tenant": "a"}, {"other": 1}])
    with pytest.raises(ValueError, match="limit keys are at most 512 characters"):
        job.enqueue(tenant="x" * 513)
    assert by_state(dsn) == {}
    with pytest.raises(ValueError, match="give concurrency=, rate_limit= or both"):
        app.limit_key("e", "a")
    with pytest.raises(ValueError, match="a limit key is a string"):
        app.limit_key("e", 5, concurrency=1)  # type: ignore[arg-type]


def test_keys_are_json_for_values_that_are_not_strings_and_bulk_enqueues_carry_them(
    app: App, dsn: str
) -> None:
    job = app.job(kind="k", concurrency_key=lambda args: args["user"]["org"], concurrency_limit=2)(
        lambda user: None
    )
    job.enqueue(user={"org": 7})
    job.enqueue_many([{"user": {"org": "acme"}}, {"user": {"org": None}}])
    app.job(kind="kind_wide", rate_limit="5/min")(lambda: None)
    app.enqueue("kind_wide")
    rows = query(
        dsn, "SELECT kind, limit_key, limit_concurrency, limit_rate, slot FROM fastjobs_jobs_all ORDER BY id"
    )
    assert [(r["limit_key"], r["limit_concurrency"], r["slot"]) for r in rows] == [
        ("7", 2, 0),
        ("acme", 2, 0),
        ("null", 2, 0),
        ("", None, 0),
    ]
    assert rows[-1]["limit_rate"] == pytest.approx(5 / 60)


def test_a_queue_with_a_keyed_or_rated_kind_may_take_the_fast_lane(app: App) -> None:
    from fastjobs.planner import fast_queues, takes_keys

    app.job(kind="plain", queue="a")(lambda: None)
    app.job(kind="keyed", queue="b", concurrency_key="n", concurrency_limit=1)(lambda n: None)
    app.job(kind="rated", queue="c", rate_limit="1/s")(lambda: None)
    assert fast_queues(app.jobs, ["a", "b", "c"], fast_lane=True, keep_completed=False) == [True] * 3
    assert takes_keys(app.jobs)  # its lock takes keyed jobs (job_lock_keyed_*)
    assert not takes_keys({"plain": app.jobs["plain"]})


@pytest.mark.parametrize("fast_lane", [True, False])
def test_failed_snoozed_and_cancelled_jobs_free_their_key_s_place(
    app: App, dsn: str, fast_lane: bool
) -> None:
    calls: list[int] = []

    def handler(tenant: str, n: int) -> None:
        calls.append(n)
        if n == 0:
            raise RuntimeError("boom")  # retried later: retryable, not running
        if n == 1:
            raise Snooze(3600)
        if n == 2:
            raise Cancel("no")

    app.job(kind="k", concurrency_key="tenant", concurrency_limit=1)(handler)
    app.enqueue_many("k", ({"tenant": "a", "n": n} for n in range(4)))
    with batch_loop(app, 10, fast_lane=fast_lane, overlap=False) as loop:
        for _ in range(4):
            assert loop.step() == 1  # the one place, freed by each outcome in turn
        assert loop.step() == 0
        loop.finish()
    assert calls == [0, 1, 2, 3]
    assert by_state(dsn) == {"retryable": 1, "scheduled": 1, "cancelled": 1}


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_kind_limited_per_key_and_shared_fairly_keeps_both(app: App, dsn: str, fast_lane: bool) -> None:
    """A kind with a fairness key and a limit per key: A's backlog, enqueued first, does not hold B's
    jobs back (the fair claim takes both keys), and no claim takes more of a key than its limit
    leaves (the limit counts them on the state lane, whatever the loop's lane)."""
    app.job(kind="warm")(lambda: None)
    ran: list[tuple[str, int]] = []
    both = app.job(kind="k", fair_key="tenant", concurrency_key="tenant", concurrency_limit=2)(
        lambda tenant, n: ran.append((tenant, n))
    )
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        both.enqueue_many([{"tenant": "A", "n": n} for n in range(300)])
        both.enqueue_many([{"tenant": "B", "n": n} for n in range(5)])
        assert loop.step() == 4  # 2 of each key: B's are not behind A's 300 (a claim's 100 candidates)
        assert Counter(t for t, _ in ran) == {"A": 2, "B": 2}
        while loop.step():
            pass
        loop.finish()
        assert loop.fast == 0
    assert [n for t, n in ran if t == "A"] == list(range(300))
    assert [n for t, n in ran if t == "B"] == list(range(5))
    assert by_state(dsn) == {}


def test_the_cleaner_removes_the_buckets_of_keys_idle_until_full_in_batches_and_keeps_set_limits(
    app: App, dsn: str
) -> None:
    """A bucket left alone a second is full if it held a token, else after an hour per token it
    lacked (the slowest rate, 1/h); a row an operator set stays; a key a claim holds is skipped."""
    now = dt.datetime(2030, 6, 3, 12, 0, tzinfo=dt.UTC)
    rows = [  # key, tokens, seconds since its last claim, concurrency set
        ("whole-token-2s", 1.0, 2, None),
        ("whole-token-0.5s", 3.0, 0.5, None),  # a rate of 10/s may still be refilling
        ("empty-30min", 0.0, 1800, None),  # a rate of 1/h is still refilling
        ("empty-61min", 0.0, 3660, None),
        ("half-31min", 0.5, 1860, None),
        ("never-took-2s", None, 2, None),
        ("set-by-an-operator", 0.0, 86400, 3),
    ]
    rows += [(f"many-{n:02}", 1.0, 60, None) for n in range(25)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key, tokens, idle, concurrency in rows:
            conn.execute(
                "INSERT INTO fastjobs_limits (kind, key, tokens, refilled_at, concurrency)"
                " VALUES ('k', %s, %s, %s, %s)",
                (key, tokens, now - dt.timedelta(seconds=idle), concurrency),
            )
        conn.execute(
            "INSERT INTO fastjobs_limits (kind, key, rate_limit, rate, tokens, refilled_at)"
            " VALUES ('k', 'rate-set', '1/h', 1 / 3600.0, 0, %s)",
            (now - dt.timedelta(days=1),),
        )
        # The full buckets in many-00's group of keys, whose turn a claim of many-00 holds.
        full = ["whole-token-2s", "empty-61min", "half-31min", "never-took-2s"]
        full += [f"many-{n:02}" for n in range(25)]
        [row] = conn.execute(
            "SELECT count(*) FROM fastjobs_limits WHERE key = ANY(%s)"
            " AND fastjobs_key_group(kind, key) = fastjobs_key_group('k', 'many-00')",
            (full,),
        ).fetchall()
        held = row[0]
        with psycopg.connect(dsn) as claim:
            claim.execute("SELECT pg_advisory_xact_lock(1718382456, fastjobs_key_group('k', 'many-00'))")
            counts = maintenance.clean_once(conn, now, maintenance.CleanerConfig(batch=4))
        assert counts["buckets"] == len(full) - held
        assert maintenance.clean_once(conn, now)["buckets"] == held  # their claim gone
        assert maintenance.clean_once(conn, now)["buckets"] == 0
    left = [r["key"] for r in query(dsn, "SELECT key FROM fastjobs_limits ORDER BY key")]
    assert left == ["empty-30min", "rate-set", "set-by-an-operator", "whole-token-0.5s"]


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_key_s_bucket_removed_by_the_cleaner_comes_back_full_at_its_next_claim(
    app: App, dsn: str, fast_lane: bool
) -> None:
    app.job(kind="warm")(lambda: None)
    app.job(kind="per_key", concurrency_key="tenant", rate_limit="3/s")(lambda tenant, n: None)
    with batch_loop(app, 100, fast_lane=fast_lane, overlap=False) as loop:
        warm(app, loop)
        app.enqueue_many("per_key", ({"tenant": "a", "n": n} for n in range(3)))
        assert loop.step() == 3  # the bucket is now empty
        query(dsn, "UPDATE fastjobs_limits SET refilled_at = refilled_at - interval '2 hours'")
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert maintenance.clean_once(conn)["buckets"] == 1
        app.enqueue_many("per_key", ({"tenant": "a", "n": n} for n in range(5)))
        assert loop.step() == 3  # a full bucket again, no more
        loop.finish()
        assert (loop.fast == 6) == fast_lane
    assert query(dsn, "SELECT key FROM fastjobs_limits") == [{"key": "a"}]


def test_stats_and_the_metrics_show_keys_running_at_their_limit_and_the_longest_waiting(
    app: App, dsn: str
) -> None:
    """Tenant a runs 2 of its limit of 2 and has 3 due, the oldest an hour; b runs 1 of 2; c runs 1
    of the 1 an operator set; d has 1 due, not a minute."""
    app.job(kind="k", concurrency_key="tenant", concurrency_limit=2)(lambda tenant, n: None)
    app.job(kind="free")(lambda n: None)
    jobs = [("a", n) for n in range(5)] + [("b", 5), ("c", 6), ("d", 7)]
    app.enqueue_many("k", ({"tenant": t, "n": n} for t, n in jobs))
    app.enqueue_many("free", ({"n": n} for n in range(3)))
    app.limit_key("k", "c", concurrency=1)
    running = "UPDATE fastjobs_jobs_all SET state = 'running' WHERE kind = 'k' AND args->>'n' = ANY(%s)"
    query(dsn, running, (["0", "1", "5", "6"],))
    query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 hour' WHERE args @> '{\"n\": 2}'")
    query(dsn, "UPDATE fastjobs_jobs_all SET run_at = now() - interval '1 minute' WHERE args @> '{\"n\": 3}'")
    done = cli(dsn, "stats", "--json")
    assert done.returncode == 0, done.stderr
    [found] = json.loads(done.stdout)["keys"]
    waited = found.pop("longest_waiting_seconds")
    assert found == {
        "kind": "k",
        "keys_running": 3,
        "running": 4,
        "keys_at_limit": 2,
        "longest_waiting_key": "a",
    }
    assert 3600 <= waited < 3700
    text = cli(dsn, "stats").stdout
    assert (
        "keys: kind 'k' runs 4 jobs of 3 keys, 2 at their concurrency limit; longest waiting: key 'a', due 3,"
        in text
    )
    board = Scoreboard.create(1)
    reader = metrics.DatabaseReader(dsn)
    try:
        scraped = samples(metrics.scrape(board, reader).decode())
    finally:
        board.close(unlink=True)
        if reader.conn is not None:
            reader.conn.close()
    assert scraped['fastjobs_key_keys_running{kind="k"}'] == 3
    assert scraped['fastjobs_key_jobs_running{kind="k"}'] == 4
    assert scraped['fastjobs_key_keys_at_limit{kind="k"}'] == 2
    assert 3600 <= scraped['fastjobs_key_longest_wait_seconds{kind="k"}'] < 3700
    assert not [name for name in scraped if name.startswith("fastjobs_key_") and 'kind="free"' in name]
