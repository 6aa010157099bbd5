"""Enqueueing: one, bulk (COPY), transactional, async, and every bad input refused whole."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import RowFactory, class_row, dict_row, namedtuple_row

from fastjobs import App, bulk


def send_email(user_id: int, email: str, retries: int = 3) -> None:
    """A handler at module level, so its default kind is stable."""


def _jobs(dsn: str, where: str = "true") -> list[dict[str, Any]]:
    """The job rows as another session sees them (committed only)."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(f"SELECT * FROM fastjobs_jobs_all WHERE {where} ORDER BY id").fetchall()


def _count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
    assert row is not None
    return int(row[0])


def _status(conn: psycopg.Connection[Any]) -> TransactionStatus:
    return conn.info.transaction_status


def _db_now(dsn: str) -> dt.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    value: dt.datetime = row[0]
    return value


# Arguments that must come back from jsonb exactly as they went in.
ROUND_TRIP: list[dict[str, Any]] = [
    {},
    {"text": 'héllo ☃ 日本語 🎉 "quoted" \\ back\nslash'},
    {"nested": {"list": [1, [2, [3, {"deep": None}]]], "bool": True, "none": None}},
    {"big": 2**63 - 1, "small": -(2**63), "zero": 0},
    {"floats": [0.1, -2.5, 2.5e-300, 1e-7, 123456.789, 3.0]},
    {"empty": {"list": [], "dict": {}, "str": ""}},
]


# One job -----------------------------------------------------------------


def test_enqueue_returns_the_id_of_a_row_with_every_option(app: App, dsn):
    job_id = app.enqueue("mail.send", {"to": "a@example.com"}, queue="emails", priority=7, max_attempts=3)

    assert isinstance(job_id, int)
    [row] = _jobs(dsn)
    assert row["id"] == job_id
    assert row["queue"] == "emails"
    assert row["kind"] == "mail.send"
    assert row["args"] == {"to": "a@example.com"}
    assert row["priority"] == 7
    assert row["max_attempts"] == 3
    assert row["state"] == "available"
    assert row["attempt"] == 0
    assert row["run_at"] <= _db_now(dsn)


def test_enqueue_defaults(app: App, dsn):
    app.enqueue("k")
    [row] = _jobs(dsn)
    assert (row["queue"], row["args"], row["priority"], row["max_attempts"], row["state"]) == (
        "default",
        {},
        0,
        25,
        "available",
    )


def test_ids_increase(app: App):
    ids = [app.enqueue("k", {"n": n}) for n in range(3)]
    assert ids == sorted(set(ids))


def test_job_handle_enqueue_uses_the_registered_defaults(app: App, dsn):
    handle = app.job(queue="emails", priority=5, max_attempts=4)(send_email)

    assert handle.kind == "tests.test_enqueue.send_email"
    job_id = handle.enqueue(user_id=1, email="a@example.com")

    [row] = _jobs(dsn)
    assert row["id"] == job_id
    assert (row["kind"], row["queue"], row["priority"], row["max_attempts"]) == (
        "tests.test_enqueue.send_email",
        "emails",
        5,
        4,
    )
    assert row["args"] == {"user_id": 1, "email": "a@example.com"}


def test_default_kind_is_module_and_qualname(app: App):
    def inner(x: int) -> None: ...

    handle = app.job()(inner)
    assert handle.kind == f"{__name__}.test_default_kind_is_module_and_qualname.<locals>.inner"
    assert app.job(kind="explicit")(send_email).kind == "explicit"


def test_job_handle_still_calls_the_function(app: App):
    handle = app.job()(lambda a, b=2: a + b)
    assert handle(1) == 3
    assert handle(a=1, b=5) == 6


def test_job_options_delay_schedules_the_job(app: App, dsn):
    handle = app.job()(send_email)
    before = _db_now(dsn)

    handle.options(delay=3600).enqueue(user_id=1, email="a@example.com")
    handle.options(delay=dt.timedelta(minutes=5), queue="later", priority=-3).enqueue(user_id=2, email="b")

    first, second = _jobs(dsn)
    assert first["state"] == "scheduled"
    assert first["run_at"] >= before + dt.timedelta(seconds=3600)
    assert second["state"] == "scheduled"
    assert before + dt.timedelta(minutes=5) <= second["run_at"] < before + dt.timedelta(minutes=6)
    assert (second["queue"], second["priority"]) == ("later", -3)


def test_job_options_do_not_change_the_handle(app: App, dsn):
    handle = app.job(queue="emails")(send_email)
    handle.options(queue="other", delay=60)
    handle.enqueue(user_id=1, email="a")
    [row] = _jobs(dsn)
    assert (row["queue"], row["state"]) == ("emails", "available")


def test_run_at_in_the_past_is_available(app: App, dsn):
    past = dt.datetime(2020, 5, 17, 12, 30, 15, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    app.enqueue("k", run_at=past)
    [row] = _jobs(dsn)
    assert row["state"] == "available"
    assert row["run_at"] == past


def test_run_at_in_the_future_is_scheduled(app: App, dsn):
    future = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    app.enqueue("k", run_at=future)
    [row] = _jobs(dsn)
    assert row["state"] == "scheduled"
    assert row["run_at"] == future


def test_zero_delay_is_available(app: App, dsn):
    app.enqueue("k", delay=0)
    assert _jobs(dsn)[0]["state"] == "available"


@pytest.mark.parametrize("args", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_args_round_trip(app: App, dsn, args):
    job_id = app.enqueue("k", args)
    [row] = _jobs(dsn, f"id = {job_id}")
    assert row["args"] == args


def test_args_may_be_any_mapping(app: App, dsn):
    from types import MappingProxyType

    app.enqueue("k", MappingProxyType({"a": 1}))  # type: ignore[arg-type]  # typed dict, takes a Mapping
    assert _jobs(dsn)[0]["args"] == {"a": 1}


# Many jobs ---------------------------------------------------------------


def test_enqueue_many_inserts_every_row_in_order_over_several_copy_chunks(app: App, dsn):
    rows = [{"n": i, "text": f"row {i} ✓"} for i in range(20_000)]
    assert 2 * bulk.COPY_CHUNK < 20_000

    assert app.enqueue_many("bulk", rows, queue="q", priority=-1, max_attempts=2) == 20_000

    found = _jobs(dsn)
    assert [r["args"] for r in found] == rows
    assert {(r["queue"], r["kind"], r["priority"], r["max_attempts"], r["state"]) for r in found} == {
        ("q", "bulk", -1, 2, "available")
    }


@pytest.mark.parametrize("size", [bulk.COPY_CHUNK - 1, bulk.COPY_CHUNK, bulk.COPY_CHUNK + 1])
def test_enqueue_many_at_the_chunk_boundary(app: App, dsn, size):
    assert app.enqueue_many("k", ({"n": i} for i in range(size))) == size
    assert [r["args"]["n"] for r in _jobs(dsn)] == list(range(size))


def test_enqueue_many_round_trips_args(app: App, dsn):
    assert app.enqueue_many("k", ROUND_TRIP) == len(ROUND_TRIP)
    assert [r["args"] for r in _jobs(dsn)] == ROUND_TRIP


def test_enqueue_many_of_nothing_returns_zero(app: App, dsn):
    assert app.enqueue_many("k", []) == 0
    assert app.enqueue_many("k", iter(())) == 0
    assert app.enqueue_many("k", ({"n": i} for i in range(0))) == 0
    assert _count(dsn) == 0


def test_enqueue_many_takes_a_generator(app: App, dsn):
    def rows() -> Iterator[dict[str, int]]:
        yield from ({"n": i} for i in range(1000))

    assert app.enqueue_many("k", rows()) == 1000
    assert _count(dsn) == 1000


def test_job_handle_enqueue_many(app: App, dsn):
    handle = app.job(queue="emails")(send_email)
    assert handle.enqueue_many({"user_id": i, "email": f"{i}@x"} for i in range(10)) == 10
    rows = _jobs(dsn)
    assert [r["args"]["user_id"] for r in rows] == list(range(10))
    assert {(r["kind"], r["queue"]) for r in rows} == {("tests.test_enqueue.send_email", "emails")}


def test_enqueue_many_with_delay_or_run_at(app: App, dsn):
    before = _db_now(dsn)
    past = dt.datetime(2021, 1, 1, tzinfo=dt.UTC)
    app.enqueue_many("later", [{"n": 1}, {"n": 2}], delay=600)
    app.enqueue_many("past", [{"n": 3}], run_at=past)
    app.job(kind="handled")(send_email).options(delay=60).enqueue_many([{"user_id": 1, "email": "e"}])

    rows = {r["kind"]: r for r in _jobs(dsn)}
    assert rows["later"]["state"] == "scheduled"
    assert rows["later"]["run_at"] >= before + dt.timedelta(seconds=600)
    assert (rows["past"]["state"], rows["past"]["run_at"]) == ("available", past)
    assert rows["handled"]["state"] == "scheduled"


# Transactional -----------------------------------------------------------


def test_enqueue_in_a_transaction_is_invisible_until_commit(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            job_id = app.enqueue("k", {"a": 1}, conn=conn)
            assert _jobs(dsn) == []
        assert [r["id"] for r in _jobs(dsn)] == [job_id]


def test_enqueue_in_a_rolled_back_transaction_never_exists(app: App, dsn):
    with psycopg.connect(dsn) as conn, conn.transaction():
        app.enqueue("k", {"a": 1}, conn=conn)
        raise psycopg.Rollback()
    assert _jobs(dsn) == []


def test_enqueue_on_an_idle_connection_joins_its_implicit_transaction(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        app.enqueue("k", conn=conn)
        assert _status(conn) == TransactionStatus.INTRANS
        assert _jobs(dsn) == []
        conn.rollback()
    assert _jobs(dsn) == []


def test_enqueue_many_in_a_transaction_is_invisible_until_commit(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO fastjobs_workers (id, host, pid, queues) VALUES ('w', 'h', 1, '{}')")
            assert app.enqueue_many("k", [{"n": i} for i in range(20_000)], conn=conn) == 20_000
            assert _count(dsn) == 0
        assert _count(dsn) == 20_000


def test_enqueue_many_in_a_rolled_back_transaction_never_exists(app: App, dsn):
    with psycopg.connect(dsn) as conn, conn.transaction():
        app.enqueue_many("k", [{"n": i} for i in range(100)], conn=conn)
        raise psycopg.Rollback()
    assert _count(dsn) == 0


def test_enqueue_many_on_an_idle_connection_is_not_committed_behind_the_callers_back(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        assert _status(conn) == TransactionStatus.IDLE
        assert app.enqueue_many("k", [{"n": i} for i in range(100)], conn=conn) == 100
        assert _status(conn) == TransactionStatus.INTRANS
        assert _count(dsn) == 0
        conn.rollback()
    assert _count(dsn) == 0


def test_enqueue_many_on_an_idle_connection_commits_with_the_caller(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        app.enqueue_many("k", [{"n": i} for i in range(100)], conn=conn)
        assert _count(dsn) == 0
        conn.commit()
    assert _count(dsn) == 100


def test_enqueue_many_on_an_autocommit_connection_commits_at_once(app: App, dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert app.enqueue_many("k", [{"n": i} for i in range(20_000)], conn=conn) == 20_000
        assert _status(conn) == TransactionStatus.IDLE
        assert _count(dsn) == 20_000


# Async -------------------------------------------------------------------


async def _close_async_pool(app: App) -> None:
    """Close the connections fastjobs pooled for this event loop: psycopg warns
    when an open connection is garbage collected, whichever test that happens in."""
    await app.aclose()


def _backends(dsn: str, expected: int) -> int:
    """Other sessions connected to this test's database, once there are `expected` of them.

    A server process outlives its client's close() by a moment, so a count
    that is not yet `expected` is read again, up to a deadline.
    """
    deadline = time.monotonic() + 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                """SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND pid <> pg_backend_pid()"""
            ).fetchone()
            assert row is not None
            if row[0] == expected or time.monotonic() > deadline:
                return int(row[0])


async def test_enqueue_async_without_conn(app: App, dsn):
    try:
        job_id = await app.enqueue_async("k", {"a": 1}, queue="aq", priority=2)
        count = await app.enqueue_many_async("k", ({"n": i} for i in range(20_000)), queue="aq")
    finally:
        await _close_async_pool(app)
    assert count == 20_000
    rows = _jobs(dsn)
    assert rows[0]["id"] == job_id
    assert rows[0]["args"] == {"a": 1}
    assert len(rows) == 20_001
    assert {r["queue"] for r in rows} == {"aq"}


async def test_enqueue_async_in_a_transaction(app: App, dsn):
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            job_id = await app.enqueue_async("k", {"a": 1}, conn=conn)
            assert await app.enqueue_many_async("k", [{"n": i} for i in range(10_000)], conn=conn) == 10_000
            assert _count(dsn) == 0
        assert _count(dsn) == 10_001
        assert _jobs(dsn)[0]["id"] == job_id


async def test_enqueue_async_rolled_back(app: App, dsn):
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await app.enqueue_async("k", {"a": 1}, conn=conn)
        await app.enqueue_many_async("k", [{"n": i} for i in range(100)], conn=conn)
        raise psycopg.Rollback()
    assert _count(dsn) == 0


async def test_enqueue_many_async_on_an_idle_connection_waits_for_the_caller(app: App, dsn):
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await app.enqueue_many_async("k", [{"n": i} for i in range(100)], conn=conn)
        assert _count(dsn) == 0
        await conn.rollback()
    assert _count(dsn) == 0


async def test_job_handle_async(app: App, dsn):
    handle = app.job(queue="emails")(send_email)
    try:
        await handle.enqueue_async(user_id=1, email="a")
        await handle.enqueue_many_async([{"user_id": 2, "email": "b"}])
    finally:
        await _close_async_pool(app)
    assert [(r["queue"], r["args"]["user_id"]) for r in _jobs(dsn)] == [("emails", 1), ("emails", 2)]


def test_close_closes_the_pooled_connections(dsn):
    app = App(dsn)
    app.enqueue("k")
    assert _backends(dsn, 1) == 1
    app.close()
    assert _backends(dsn, 0) == 0


async def test_close_closes_the_async_pooled_connections(dsn):
    app = App(dsn)
    try:
        await app.enqueue_async("k")
        assert _backends(dsn, 1) == 1
        app.close()
        assert _backends(dsn, 0) == 0
    finally:
        await _close_async_pool(app)


# Bad input ---------------------------------------------------------------

_UNSERIALISABLE: list[tuple[str, dict[str, Any], str]] = [
    ("set", {"a": {1, 2}}, "set"),
    ("object", {"a": object()}, "object"),
    ("nested-bytes", {"a": [1, {"b": b"bytes"}]}, "bytes"),
    ("int-over-64-bits", {"a": 2**64}, "int"),
    ("non-str-key", {"a": {1: "x"}}, "int"),
]
# The error must say what was wrong, by type.
UNSERIALISABLE = [pytest.param(args, name, id=id_) for id_, args, name in _UNSERIALISABLE]


@pytest.mark.parametrize(("args", "type_name"), UNSERIALISABLE)
def test_unserialisable_args_raise_type_error_naming_kind_and_type(app: App, dsn, args, type_name):
    with pytest.raises(TypeError) as excinfo:
        app.enqueue("my.kind", args)
    message = str(excinfo.value)
    assert "my.kind" in message
    assert type_name in message.lower()
    assert _count(dsn) == 0


@pytest.mark.parametrize(("args", "type_name"), UNSERIALISABLE)
def test_unserialisable_args_in_bulk_raise_type_error_naming_kind_and_type(app: App, dsn, args, type_name):
    with pytest.raises(TypeError) as excinfo:
        app.enqueue_many("my.kind", [{"ok": 1}, args, {"ok": 2}])
    assert "my.kind" in str(excinfo.value)
    assert type_name in str(excinfo.value).lower()
    assert _count(dsn) == 0


@pytest.mark.parametrize(("args", "type_name"), UNSERIALISABLE)
def test_unserialisable_args_insert_nothing(app: App, dsn, args, type_name):
    with pytest.raises(TypeError, match=r"my\.kind"):
        app.enqueue("my.kind", args)
    with pytest.raises(TypeError, match=r"my\.kind"):
        app.enqueue_many("my.kind", [{"ok": 1}, args])
    assert _count(dsn) == 0


@pytest.mark.parametrize(("args", "type_name"), UNSERIALISABLE)
def test_unserialisable_args_with_conn_insert_nothing(app: App, dsn, args, type_name):
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError):
            app.enqueue("my.kind", args, conn=conn)
        conn.commit()
    assert _count(dsn) == 0


def _rows_with_a_bad_one(total: int = 16_000, bad: int = 15_000) -> Iterator[dict[str, Any]]:
    """A bulk whose bad row is in the last COPY chunk, after earlier chunks were sent."""
    assert bad >= bulk.COPY_CHUNK
    for i in range(total):
        yield {"n": {1, 2}} if i == bad else {"n": i}


def test_bulk_with_a_bad_row_in_the_last_chunk_inserts_nothing(app: App, dsn):
    with pytest.raises(TypeError, match="set"):
        app.enqueue_many("k", _rows_with_a_bad_one())
    assert _count(dsn) == 0
    assert app.enqueue_many("k", [{"n": 1}]) == 1  # the pool's connection is still good


def test_bulk_with_a_bad_row_in_a_callers_transaction_keeps_the_callers_work(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            earlier = app.enqueue("earlier", conn=conn)
            with pytest.raises(TypeError, match="set"):
                app.enqueue_many("k", _rows_with_a_bad_one(), conn=conn)
            later = app.enqueue("later", conn=conn)  # the transaction is still usable
        assert [(r["id"], r["kind"]) for r in _jobs(dsn)] == [(earlier, "earlier"), (later, "later")]


def test_bulk_with_a_bad_row_on_an_autocommit_connection_inserts_nothing(app: App, dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(TypeError, match="set"):
            app.enqueue_many("k", _rows_with_a_bad_one(), conn=conn)
        assert app.enqueue_many("k", [{"n": 1}], conn=conn) == 1
    assert _count(dsn) == 1


def test_bulk_with_a_bad_row_on_an_idle_connection_inserts_nothing(app: App, dsn):
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError, match="set"):
            app.enqueue_many("k", _rows_with_a_bad_one(), conn=conn)
        conn.rollback()
        assert app.enqueue_many("k", [{"n": 1}], conn=conn) == 1
        conn.commit()
    assert _count(dsn) == 1


async def test_async_bulk_with_a_bad_row_inserts_nothing(app: App, dsn):
    try:
        with pytest.raises(TypeError, match="set"):
            await app.enqueue_many_async("k", _rows_with_a_bad_one())
    finally:
        await _close_async_pool(app)
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        earlier = await app.enqueue_async("earlier", conn=conn)
        with pytest.raises(TypeError, match="set"):
            await app.enqueue_many_async("k", _rows_with_a_bad_one(), conn=conn)
    assert [r["id"] for r in _jobs(dsn)] == [earlier]


async def test_async_unserialisable_args(app: App, dsn):
    try:
        with pytest.raises(TypeError, match=r"my\.kind"):
            await app.enqueue_async("my.kind", {"a": {1}})
    finally:
        await _close_async_pool(app)
    assert _count(dsn) == 0


@pytest.mark.parametrize("args", [[("a", 1)], ["a"], "a=1", 42])
def test_args_that_are_not_a_mapping_raise_type_error(app: App, dsn, args):
    with pytest.raises(TypeError, match="mapping"):
        app.enqueue("k", args)
    with pytest.raises(TypeError, match="mapping"):
        app.enqueue_many("k", [{"a": 1}, args])
    assert _count(dsn) == 0


def test_arguments_are_checked_against_the_handler(app: App, dsn):
    handle = app.job()(send_email)
    with pytest.raises(TypeError, match=r"missing argument.*email"):
        handle.enqueue(user_id=1)  # type: ignore[call-arg]  # a type checker says it too
    with pytest.raises(TypeError, match=r"unexpected argument.*bogus"):
        handle.enqueue(user_id=1, email="a", bogus=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unexpected argument.*bogus"):
        app.enqueue(handle.kind, {"user_id": 1, "email": "a", "bogus": 2})
    with pytest.raises(TypeError, match=r"missing argument.*email"):
        handle.enqueue_many([{"user_id": 1, "email": "a"}, {"user_id": 2}])
    assert _count(dsn) == 0
    handle.enqueue(user_id=1, email="a", retries=5)  # optional parameters are fine
    assert _count(dsn) == 1


def test_a_handler_with_var_keyword_takes_any_argument(app: App, dsn):
    def anything(**kwargs: Any) -> None: ...

    app.job()(anything).enqueue(whatever=1, more="x")
    assert _jobs(dsn)[0]["args"] == {"whatever": 1, "more": "x"}


future = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)

BAD_OPTIONS = [
    pytest.param({"queue": ""}, "queue", id="empty-queue"),
    pytest.param({"queue": "q" * 129}, "128", id="long-queue"),
    pytest.param({"queue": 5}, "queue", id="queue-not-str"),
    pytest.param({"priority": 32768}, "priority", id="priority-too-high"),
    pytest.param({"priority": -32769}, "priority", id="priority-too-low"),
    pytest.param({"priority": 1.5}, "priority", id="priority-float"),
    pytest.param({"priority": "1"}, "priority", id="priority-str"),
    pytest.param({"priority": True}, "priority", id="priority-bool"),
    pytest.param({"max_attempts": 0}, "max_attempts", id="max-attempts-zero"),
    pytest.param({"max_attempts": 40_000}, "max_attempts", id="max-attempts-too-high"),
    pytest.param({"delay": -1}, "delay", id="negative-delay"),
    pytest.param({"delay": dt.timedelta(seconds=-1)}, "delay", id="negative-timedelta"),
    pytest.param({"delay": math.nan}, "delay", id="nan-delay"),
    pytest.param({"delay": math.inf}, "delay", id="infinite-delay"),
    pytest.param({"delay": "60"}, "delay", id="delay-str"),
    pytest.param({"run_at": dt.datetime(2030, 1, 1)}, "timezone", id="naive-run-at"),
    pytest.param({"run_at": "2030-01-01T00:00:00Z"}, "run_at", id="run-at-str"),
    pytest.param({"run_at": future, "delay": 5}, "not both", id="run-at-and-delay"),
    # Past the year 9999 (timestamptz holds 294276, but no reader could load it)
    # and past timestamptz itself: ValueError, not DatetimeFieldOverflow or OverflowError.
    pytest.param({"delay": 1e12}, "delay must be at most", id="delay-of-31,700-years"),
    pytest.param({"delay": 1e14}, "delay must be at most", id="delay-past-timestamptz"),
    pytest.param({"delay": dt.timedelta.max}, "delay must be at most", id="timedelta-max"),
    pytest.param(
        {"run_at": dt.datetime.max.replace(tzinfo=dt.timezone(-dt.timedelta(hours=12)))},
        "outside the years",
        id="run-at-past-9999-utc",
    ),
    pytest.param(
        {"run_at": dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=12)))},
        "outside the years",
        id="run-at-before-year-1-utc",
    ),
]


@pytest.mark.parametrize(("options", "reason"), BAD_OPTIONS)
def test_bad_options_raise_value_error_with_the_reason(app: App, dsn, options, reason):
    with pytest.raises(ValueError, match=reason):
        app.enqueue("k", {"a": 1}, **options)
    with pytest.raises(ValueError, match=reason):
        app.enqueue_many("k", [{"a": 1}], **options)
    with pytest.raises(ValueError, match=reason):
        app.job()(send_email).options(**options)
    assert _count(dsn) == 0


@pytest.mark.parametrize(("options", "reason"), BAD_OPTIONS)
async def test_bad_options_raise_value_error_async(app: App, dsn, options, reason):
    with pytest.raises(ValueError, match=reason):
        await app.enqueue_async("k", {"a": 1}, **options)
    with pytest.raises(ValueError, match=reason):
        await app.enqueue_many_async("k", [{"a": 1}], **options)
    assert _count(dsn) == 0


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"queue": ""}, "queue"),
        ({"queue": "q" * 129}, "128"),
        ({"priority": 40_000}, "priority"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
    ],
)
def test_bad_job_defaults_raise_value_error_at_registration(app: App, options, reason):
    with pytest.raises(ValueError, match=reason):
        app.job(**options)(send_email)
    assert app.jobs == {}


def test_empty_kind_raises_value_error(app: App, dsn):
    with pytest.raises(ValueError, match="kind"):
        app.enqueue("", {"a": 1})
    with pytest.raises(ValueError, match="kind"):
        app.enqueue_many("", [{"a": 1}])
    assert _count(dsn) == 0


def test_a_handler_parameter_named_conn_is_refused(app: App):
    def handler(conn: Any, x: int) -> None: ...

    with pytest.raises(TypeError, match="conn"):
        app.job()(handler)
    assert app.jobs == {}


def test_duplicate_kind_is_refused(app: App):
    def first() -> None: ...

    def second() -> None: ...

    app.job(kind="same")(first)
    with pytest.raises(ValueError, match="same"):
        app.job(kind="same")(second)
    assert app.jobs["same"].func is first


# The caller's row factory ----------------------------------------------------


class _Row:
    """Any class a caller's connection may build its rows with (psycopg's class_row)."""

    def __init__(self, **columns: Any) -> None:
        self.columns = columns


ROW_FACTORIES = pytest.mark.parametrize(
    "row_factory",
    [dict_row, namedtuple_row, class_row(_Row)],
    ids=["dict_row", "namedtuple_row", "class_row"],
)


@ROW_FACTORIES
def test_transactional_enqueue_and_cancel_work_whatever_the_row_factory(
    app: App, dsn, row_factory: RowFactory[Any]
):
    """fastjobs reads its own rows as tuples: with the caller's factory, row[0] raised KeyError
    after the INSERT had run, so a caller who retried enqueued twice."""
    with psycopg.connect(dsn, row_factory=row_factory) as conn:
        with conn.transaction():
            first = app.enqueue("k", {"n": 1}, conn=conn, unique_key="key")
            assert app.enqueue("k", {"n": 2}, conn=conn, unique_key="key") == first  # the holder's id
            other = app.enqueue("k", {"n": 3}, conn=conn, delay=60)
            assert app.cancel(other, conn=conn) == "cancelled"
            assert app.cancel(other, conn=conn) == "cancelled"  # read back as its state
        assert conn.execute("SELECT 1 AS one").fetchone() is not None  # the caller's factory is untouched
    assert [(r["id"], r["state"], r["args"]) for r in _jobs(dsn)] == [
        (first, "available", {"n": 1}),
        (other, "cancelled", {"n": 3}),
    ]


@ROW_FACTORIES
async def test_transactional_enqueue_async_works_whatever_the_row_factory(app: App, dsn, row_factory: Any):
    conn = await psycopg.AsyncConnection.connect(dsn, row_factory=row_factory)
    async with conn, conn.transaction():
        first = await app.enqueue_async("k", {"n": 1}, conn=conn, unique_key="key")
        assert await app.enqueue_async("k", {"n": 2}, conn=conn, unique_key="key") == first
        second = await app.enqueue_async("k", {"n": 3}, conn=conn)
    assert [(r["id"], r["args"]) for r in _jobs(dsn)] == [(first, {"n": 1}), (second, {"n": 3})]
