"""Unique jobs: a key held by a pending or running job makes a duplicate enqueue return that job.

The key is explicit (`unique_key=`) or derived from the args a kind names
(`@app.job(unique=...)`); a partial unique index backs it, so concurrent
enqueues from many connections still insert one row.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from fastjobs import App

from .helpers import drain, query


def rows(dsn: str) -> list[dict[str, Any]]:
    return query(
        dsn, "SELECT id, kind, args, state::text AS state, unique_key FROM fastjobs_jobs_all ORDER BY id"
    )


async def close_async_pool(app: App) -> None:
    """Close the connections fastjobs pooled for this event loop (App.close leaves them open)."""
    await app._async_pool.aclose()


def test_a_duplicate_key_returns_the_pending_jobs_id(app: App, dsn: str) -> None:
    first = app.enqueue("k", {"n": 1}, unique_key="report:42")
    assert app.enqueue("k", {"n": 2}, unique_key="report:42") == first
    assert app.enqueue("other_kind", unique_key="report:42") == first  # the key alone decides
    other = app.enqueue("k", {"n": 1}, unique_key="report:43")
    plain = app.enqueue("k", {"n": 1})  # no key: never deduplicated
    assert len({first, other, plain}) == 3
    assert [(r["id"], r["args"], r["unique_key"]) for r in rows(dsn)] == [
        (first, {"n": 1}, "report:42"),
        (other, {"n": 1}, "report:43"),
        (plain, {"n": 1}, None),
    ]


@pytest.mark.parametrize("state", ["scheduled", "running", "retryable"])
def test_every_pending_or_running_state_holds_the_key(app: App, dsn: str, state: str) -> None:
    first = app.enqueue("k", unique_key="key")
    query(dsn, "UPDATE fastjobs_jobs_all SET state = %s::fastjobs_state", (state,))
    assert app.enqueue("k", unique_key="key") == first
    assert len(rows(dsn)) == 1


@pytest.mark.parametrize("state", ["completed", "discarded", "cancelled"])
def test_a_finished_job_frees_the_key(app: App, dsn: str, state: str) -> None:
    first = app.enqueue("k", unique_key="key")
    query(dsn, "UPDATE fastjobs_jobs_all SET state = %s::fastjobs_state, finalized_at = now()", (state,))
    second = app.enqueue("k", unique_key="key")
    assert second != first
    assert [(r["id"], r["state"]) for r in rows(dsn)] == [(first, state), (second, "available")]
    # A duplicate now returns the pending holder, never the finished one.
    assert app.enqueue("k", unique_key="key") == second
    assert len(rows(dsn)) == 2


@pytest.mark.parametrize("keep_completed", [False, True], ids=["deleted", "kept"])
def test_after_the_job_ran_the_same_key_enqueues_a_new_job(app: App, dsn: str, keep_completed: bool) -> None:
    ran: list[int] = []

    @app.job("once_at_a_time")
    def once_at_a_time(n: int) -> None:
        ran.append(n)

    first = app.enqueue("once_at_a_time", {"n": 1}, unique_key="k")
    assert app.enqueue("once_at_a_time", {"n": 2}, unique_key="k") == first
    drain(app, keep_completed=keep_completed)
    assert ran == [1]
    second = app.enqueue("once_at_a_time", {"n": 3}, unique_key="k")
    assert second != first
    drain(app, keep_completed=keep_completed)
    assert ran == [1, 3]


def test_unique_by_argument_names_derives_the_key_from_those_args_only(app: App, dsn: str) -> None:
    @app.job("sync_user", unique=("user",))
    def sync_user(user: int, reason: str = "") -> None: ...

    first = sync_user.enqueue(user=1, reason="signup")
    assert sync_user.enqueue(user=1, reason="profile edit") == first
    assert app.enqueue("sync_user", {"user": 1}) == first
    second = sync_user.enqueue(user=2, reason="signup")
    assert second != first
    keys = [r["unique_key"] for r in rows(dsn)]
    assert len(set(keys)) == 2
    assert all(key.startswith("sync_user:") for key in keys)


def test_unique_true_derives_the_key_from_all_args(app: App, dsn: str) -> None:
    @app.job("notify", unique=True)
    def notify(user: int, channel: str = "email") -> None: ...

    first = notify.enqueue(user=1, channel="email")
    assert notify.enqueue(channel="email", user=1) == first  # argument order does not matter
    assert notify.enqueue(user=1, channel="sms") != first
    assert notify.enqueue(user=2, channel="email") != first
    assert len(rows(dsn)) == 3


def test_derived_keys_are_per_kind(app: App, dsn: str) -> None:
    @app.job("a", unique=True)
    def a(n: int) -> None: ...

    @app.job("b", unique=True)
    def b(n: int) -> None: ...

    assert a.enqueue(n=1) != b.enqueue(n=1)


def test_an_explicit_key_overrides_the_derived_one(app: App, dsn: str) -> None:
    @app.job("derived", unique=True)
    def derived(n: int) -> None: ...

    first = app.enqueue("derived", {"n": 1}, unique_key="mine")
    assert app.enqueue("derived", {"n": 2}, unique_key="mine") == first
    assert app.enqueue("derived", {"n": 1}) != first  # derived key, different from "mine"


def test_unique_names_must_be_arguments_of_the_handler() -> None:
    app = App("postgresql://unused")
    with pytest.raises(TypeError, match="not arguments"):

        @app.job("typo", unique=("usr",))
        def typo(user: int) -> None: ...


@pytest.mark.parametrize("key", ["", 42])
def test_a_bad_unique_key_is_refused(app: App, key: Any) -> None:
    with pytest.raises(ValueError, match="unique_key"):
        app.enqueue("k", unique_key=key)


def race(threads_count: int, enqueue: Callable[[], int]) -> list[int]:
    """Call `enqueue` from `threads_count` threads released together; the ids they got."""
    barrier = threading.Barrier(threads_count)
    got: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            barrier.wait(10)
            got.append(enqueue())
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one) for _ in range(threads_count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(got) == threads_count
    return got


def test_concurrent_enqueues_of_one_key_insert_one_row(app: App, dsn: str) -> None:
    for round_ in range(5):
        key = f"race:{round_}"
        got = race(8, lambda key=key: app.enqueue("k", {"key": key}, unique_key=key))  # type: ignore[misc]
        [winner] = set(got)
        assert [r["id"] for r in rows(dsn) if r["unique_key"] == key] == [winner]


def test_concurrent_enqueues_inside_transactions_insert_one_row(app: App, dsn: str) -> None:
    """Callers' transactions: the others wait on the first's uncommitted row, then get its id."""

    def enqueue() -> int:
        with psycopg.connect(dsn) as conn, conn.transaction():
            return app.enqueue("k", unique_key="tx-race", conn=conn)

    got = race(8, enqueue)
    assert len(set(got)) == 1
    assert [r["id"] for r in rows(dsn)] == got[:1]


def test_enqueue_many_skips_taken_keys_and_duplicates_within_the_call(app: App, dsn: str) -> None:
    @app.job("sync_user", unique=("user",))
    def sync_user(user: int, reason: str = "") -> None: ...

    existing = sync_user.enqueue(user=1, reason="before")
    inserted = sync_user.enqueue_many(
        [
            {"user": 1, "reason": "taken"},
            {"user": 2, "reason": "first"},
            {"user": 2, "reason": "duplicate in the call"},
            {"user": 3},
        ]
    )
    assert inserted == 2
    assert [(r["args"]["user"], r["args"].get("reason")) for r in rows(dsn)] == [
        (1, "before"),
        (2, "first"),
        (3, None),
    ]
    assert rows(dsn)[0]["id"] == existing
    assert sync_user.enqueue_many([{"user": u} for u in (1, 2, 3)]) == 0
    assert sync_user.enqueue_many([]) == 0


def test_enqueue_many_unique_in_many_chunks(app: App, dsn: str) -> None:
    @app.job("item", unique=True)
    def item(n: int) -> None: ...

    assert item.enqueue_many({"n": n % 10_000} for n in range(20_000)) == 10_000
    assert item.enqueue_many({"n": n} for n in range(5_000, 15_000)) == 5_000
    assert query(dsn, "SELECT count(*) AS n, count(DISTINCT unique_key) AS keys FROM fastjobs_jobs_all") == [
        {"n": 15_000, "keys": 15_000}
    ]


def test_unique_enqueues_in_a_rolled_back_transaction_leave_nothing(app: App, dsn: str) -> None:
    @app.job("u", unique=True)
    def u(n: int) -> None: ...

    app.declare("k")  # a kind handled elsewhere, enqueued by name beside the registered one

    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            first = app.enqueue("k", unique_key="tx", conn=conn)
            assert app.enqueue("k", unique_key="tx", conn=conn) == first  # seen inside the transaction
            assert u.enqueue_many([{"n": 1}, {"n": 1}, {"n": 2}], conn=conn) == 2
            assert u.using(conn).enqueue(n=2) == rows_in(conn)[-1]
            raise psycopg.Rollback
        assert rows(dsn) == []
        # The key is free again, and a later committed transaction takes it.
        with conn.transaction():
            again = app.enqueue("k", unique_key="tx", conn=conn)
            assert u.enqueue_many([{"n": 1}, {"n": 2}], conn=conn) == 2
    assert rows(dsn)[0]["id"] == again
    assert len(rows(dsn)) == 3


def rows_in(conn: psycopg.Connection[Any]) -> list[int]:
    return [r[0] for r in conn.execute("SELECT id FROM fastjobs_jobs_all ORDER BY id")]


def test_enqueue_many_unique_on_an_idle_caller_connection_waits_for_its_commit(app: App, dsn: str) -> None:
    @app.job("u", unique=True)
    def u(n: int) -> None: ...

    with psycopg.connect(dsn) as conn:  # not autocommit, no transaction open yet
        assert u.enqueue_many([{"n": 1}, {"n": 2}], conn=conn) == 2
        assert rows(dsn) == []  # not committed
        conn.commit()
    assert len(rows(dsn)) == 2


async def test_async_enqueue_with_a_unique_key(app: App, dsn: str) -> None:
    @app.job("au", unique=("user",))
    def au(user: int, n: int = 0) -> None: ...

    app.declare("k")  # a kind handled elsewhere, enqueued by name beside the registered one

    try:
        first = await app.enqueue_async("k", {"n": 1}, unique_key="async-key")
        assert await app.enqueue_async("k", {"n": 2}, unique_key="async-key") == first
        derived = await au.enqueue_async(user=7, n=1)
        assert await au.enqueue_async(user=7, n=2) == derived
        assert await app.enqueue_many_async("au", [{"user": 7}, {"user": 8}, {"user": 8}]) == 1
        results = await asyncio.gather(*(app.enqueue_async("k", unique_key="gathered") for _ in range(8)))
        assert len(set(results)) == 1
    finally:
        await close_async_pool(app)
    assert len(rows(dsn)) == 4


async def test_async_unique_enqueues_in_a_rolled_back_transaction_leave_nothing(app: App, dsn: str) -> None:
    @app.job("au", unique=True)
    def au(n: int) -> None: ...

    app.declare("k")  # a kind handled elsewhere, enqueued by name beside the registered one

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            first = await app.enqueue_async("k", unique_key="tx", conn=conn)
            assert await app.enqueue_async("k", unique_key="tx", conn=conn) == first
            assert await app.enqueue_many_async("au", [{"n": 1}, {"n": 1}], conn=conn) == 1
            raise psycopg.Rollback
        async with conn.transaction():
            assert await app.enqueue_many_async("au", [{"n": 1}, {"n": 2}], conn=conn) == 2
    assert len(rows(dsn)) == 2
