"""Enqueue mistakes caught at the call: a kind no handler knows, a `conn=` that cannot take the jobs.

Each refusal raises before anything is sent, and nothing is inserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from fastjobs import App, UnknownKind, Worker

from .helpers import drain, query


def count(dsn: str) -> int:
    return int(query(dsn, "SELECT count(*) AS n FROM fastjobs_jobs_all")[0]["n"])


def untouched(log: list[int]) -> Iterator[dict[str, Any]]:
    """Bulk args that record each row taken: a refused call takes none."""
    for n in range(3):
        log.append(n)
        yield {"n": n}


@pytest.fixture
def emails(app: App) -> App:
    """An app with handlers: it knows its kinds, and only those."""

    @app.job(kind="emails.send_welcome", queue="emails")
    def send_welcome(user_id: int) -> None: ...

    @app.job(kind="emails.send_reset")
    def send_reset(user_id: int) -> None: ...

    @app.periodic("0 * * * *", kind="reports.hourly")
    def hourly() -> None: ...

    return app


# --- kinds ---------------------------------------------------------------------------------------

# Every way to enqueue by kind, with the typo "emails.send_welcom".
ENQUEUES: dict[str, Callable[[App, str, list[int]], Any]] = {
    "enqueue": lambda app, kind, log: app.enqueue(kind, {"user_id": 1}),
    "enqueue_unique": lambda app, kind, log: app.enqueue(kind, {"user_id": 1}, unique_key="u1"),
    "enqueue_delayed": lambda app, kind, log: app.enqueue(kind, {"user_id": 1}, delay=60),
    "enqueue_many": lambda app, kind, log: app.enqueue_many(kind, untouched(log)),
    "enqueue_async": lambda app, kind, log: asyncio.run(_async_enqueue(app, kind)),
    "enqueue_many_async": lambda app, kind, log: asyncio.run(_async_enqueue_many(app, kind, log)),
    "enqueue_conn": lambda app, kind, log: _with_conn(app, lambda c: app.enqueue(kind, {}, conn=c)),
    "enqueue_many_conn": lambda app, kind, log: _with_conn(
        app, lambda c: app.enqueue_many(kind, untouched(log), conn=c)
    ),
}


async def _async_enqueue(app: App, kind: str) -> int:
    try:
        return await app.enqueue_async(kind, {"user_id": 1})
    finally:
        await app.aclose()


async def _async_enqueue_many(app: App, kind: str, log: list[int]) -> int:
    try:
        return await app.enqueue_many_async(kind, untouched(log))
    finally:
        await app.aclose()


def _with_conn(app: App, call: Callable[[psycopg.Connection[Any]], Any]) -> Any:
    with psycopg.connect(app.dsn) as conn, conn.transaction():
        return call(conn)


@pytest.mark.parametrize("how", ENQUEUES)
def test_an_app_with_handlers_refuses_a_typo_naming_the_close_match(emails: App, dsn: str, how: str):
    log: list[int] = []
    with pytest.raises(UnknownKind) as excinfo:
        ENQUEUES[how](emails, "emails.send_welcom", log)
    message = str(excinfo.value)
    assert message.startswith("job kind 'emails.send_welcom' is not registered on this App")
    assert "did you mean 'emails.send_welcome'" in message
    assert "app.declare('emails.send_welcom'" in message  # the way out for a kind handled elsewhere
    assert isinstance(excinfo.value, ValueError)  # a bad argument, like the other enqueue refusals
    assert log == []
    assert count(dsn) == 0


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("", "non-empty string"),
        (None, "non-empty string"),
        (["k"], "non-empty string"),
        ("k" * 513, "at most 512"),
    ],
)
def test_what_is_no_kind_is_refused_as_such_by_an_app_with_handlers(
    emails: App, dsn: str, kind: Any, reason: str
):
    with pytest.raises(ValueError, match=reason):
        emails.enqueue(kind, {})
    with pytest.raises(ValueError, match=reason):
        emails.enqueue_many(kind, [{}])
    assert count(dsn) == 0


def test_the_short_name_of_a_default_kind_finds_it(app: App, dsn: str):
    @app.job()
    def send_welcome(user_id: int) -> None: ...

    with pytest.raises(UnknownKind, match=re.escape(f"did you mean {send_welcome.kind!r}")):
        app.enqueue("send_welcome", {"user_id": 1})
    assert count(dsn) == 0


def test_with_no_close_match_the_error_names_the_kinds_it_knows(emails: App, dsn: str):
    with pytest.raises(UnknownKind) as excinfo:
        emails.enqueue("billing.charge", {"invoice": 42})
    assert "it knows 'emails.send_reset', 'emails.send_welcome', 'reports.hourly'" in str(excinfo.value)
    assert count(dsn) == 0


def test_the_kinds_an_app_knows_enqueue_by_name_and_by_handle(emails: App, dsn: str):
    emails.enqueue("emails.send_welcome", {"user_id": 1})
    emails.enqueue("reports.hourly")  # a periodic kind is a registered one
    assert emails.enqueue_many("emails.send_reset", [{"user_id": 2}]) == 1
    assert [r["kind"] for r in query(dsn, "SELECT kind FROM fastjobs_jobs_all ORDER BY id")] == [
        "emails.send_welcome",
        "reports.hourly",
        "emails.send_reset",
    ]


def test_an_app_that_knows_no_kinds_is_a_producer_and_enqueues_any(app: App, dsn: str):
    app.enqueue("billing.charge", {"invoice": 42})
    app.enqueue_many("billing.refund", [{"invoice": 43}])
    assert count(dsn) == 2


def test_a_declared_kind_is_enqueued_with_its_defaults_and_never_run_here(emails: App, dsn: str):
    charge = emails.declare("billing.charge", queue="billing", priority=5, max_attempts=3)
    charge.enqueue(invoice=1)
    emails.enqueue("billing.charge", {"invoice": 2})
    charge.options(priority=9).enqueue_many([{"invoice": 3}])
    asyncio.run(_async_enqueue(emails, "billing.charge"))
    rows = query(dsn, "SELECT queue, priority, max_attempts FROM fastjobs_jobs_all ORDER BY id")
    assert [tuple(r.values()) for r in rows] == [
        ("billing", 5, 3),
        ("billing", 5, 3),
        ("billing", 9, 3),
        ("billing", 5, 3),
    ]
    # This app's workers neither run it nor serve its queue.
    assert "billing.charge" not in emails.runnable()
    assert Worker(emails).queues == ["default", "emails"]
    drain(emails)
    assert [r["state"] for r in query(dsn, "SELECT state::text FROM fastjobs_jobs_all")] == ["available"] * 4
    with pytest.raises(TypeError, match="declared here but runs elsewhere"):
        charge(invoice=4)


def test_declaring_a_kind_makes_a_producer_check_its_kinds(app: App, dsn: str):
    app.declare("billing.charge", queue="billing")
    with pytest.raises(UnknownKind, match=r"did you mean 'billing\.charge'"):
        app.enqueue("billing.chrage", {"invoice": 1})
    assert count(dsn) == 0


def test_a_declared_unique_kind_derives_its_key_from_the_args(app: App, dsn: str):
    charge = app.declare("billing.charge", unique=("invoice",))
    first = charge.enqueue(invoice=1, attempt=1)
    assert charge.enqueue(invoice=1, attempt=2) == first
    assert count(dsn) == 1


def test_a_kind_is_registered_or_declared_not_both(app: App):
    @app.job(kind="here")
    def here() -> None: ...

    with pytest.raises(ValueError, match="'here' is registered here"):
        app.declare("here")
    app.declare("there")
    with pytest.raises(ValueError, match="'there' is declared as handled elsewhere"):
        app.job(kind="there")(here.__wrapped__)


@pytest.mark.parametrize(
    ("kind", "options", "reason"),
    [
        ("", {}, "job kind must be a non-empty string"),
        ("k", {"queue": ""}, "queue must be a non-empty string"),
        ("k", {"priority": 1 << 20}, "priority must be between"),
        ("k", {"max_attempts": 0}, "max_attempts must be between"),
    ],
)
def test_a_bad_declaration_raises_value_error(app: App, kind: str, options: dict[str, Any], reason: str):
    with pytest.raises(ValueError, match=reason):
        app.declare(kind, **options)
    assert app.declared == {}


# --- conn= ---------------------------------------------------------------------------------------


@pytest.fixture
def sync_conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn) as conn:
        yield conn


@pytest.fixture
def foreign(dsn: str) -> Iterator[list[Any]]:
    """What is mistaken for a psycopg 3 connection: another driver's DB-API connection, a DSN, a cursor."""
    with contextlib.closing(sqlite3.connect(":memory:")) as other, psycopg.connect(dsn) as conn:
        yield [other, dsn, conn.cursor()]


SYNC_CALLS: dict[str, Callable[[App, Any, list[int]], Any]] = {
    "enqueue": lambda app, conn, log: app.enqueue("k", {"n": 1}, conn=conn),
    "enqueue_many": lambda app, conn, log: app.enqueue_many("k", untouched(log), conn=conn),
    "cancel": lambda app, conn, log: app.cancel(1, conn=conn),
    "job.enqueue": lambda app, conn, log: app.declare("k").enqueue(n=1, conn=conn),
    "job.enqueue_many": lambda app, conn, log: app.declare("k").enqueue_many(untouched(log), conn=conn),
    "job.using": lambda app, conn, log: app.declare("k").using(conn).enqueue(n=1),
}


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_a_conn_of_another_driver_is_a_type_error_saying_what_is_accepted(
    app: App, dsn: str, foreign: list[Any], call: str
):
    log: list[int] = []
    for conn in foreign:
        with pytest.raises(TypeError) as excinfo:
            SYNC_CALLS[call](app, conn, log)
        message = str(excinfo.value)
        expected = (
            "using() takes a psycopg 3 Connection or AsyncConnection"
            if call == "job.using"
            else "conn= must be a psycopg 3 Connection"
        )
        assert f"{expected} (psycopg2 and other drivers are not supported)" in message
        assert f"not {type(conn).__module__}.{type(conn).__qualname__}" in message
        assert "connection underneath" in message
    assert log == []
    assert count(dsn) == 0


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_an_async_connection_to_the_sync_api_is_a_type_error(app: App, dsn: str, call: str):
    async def attempt() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(TypeError, match=r"conn= is a psycopg\.AsyncConnection: use enqueue_async"):
                SYNC_CALLS[call](app, conn, log)

    log: list[int] = []
    asyncio.run(attempt())
    assert log == []
    assert count(dsn) == 0


ASYNC_CALLS: dict[str, Callable[[App, Any, list[int]], Any]] = {
    "enqueue_async": lambda app, conn, log: app.enqueue_async("k", {"n": 1}, conn=conn),
    "enqueue_many_async": lambda app, conn, log: app.enqueue_many_async("k", untouched(log), conn=conn),
    "job.enqueue_async": lambda app, conn, log: app.declare("k").enqueue_async(n=1, conn=conn),
    "job.using": lambda app, conn, log: app.declare("k").using(conn).enqueue_async(n=1),
}


@pytest.mark.parametrize("call", ASYNC_CALLS)
def test_a_sync_or_foreign_conn_to_the_async_api_is_a_type_error(
    app: App, dsn: str, foreign: list[Any], call: str
):
    log: list[int] = []

    async def attempt(conn: Any, match: str) -> None:
        with pytest.raises(TypeError, match=match):
            await ASYNC_CALLS[call](app, conn, log)

    with psycopg.connect(dsn) as conn:
        asyncio.run(attempt(conn, "conn= is a psycopg.Connection: the async methods take an AsyncConnection"))
    for conn in foreign:
        asyncio.run(
            attempt(conn, "(conn= must be|using\\(\\) takes) a psycopg 3 (Connection or )?AsyncConnection")
        )
    assert log == []
    assert count(dsn) == 0


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_a_closed_conn_is_a_value_error(app: App, dsn: str, sync_conn: psycopg.Connection[Any], call: str):
    log: list[int] = []
    sync_conn.close()
    with pytest.raises(ValueError, match="conn= is closed"):
        SYNC_CALLS[call](app, sync_conn, log)
    assert log == []
    assert count(dsn) == 0


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_a_conn_in_a_failed_transaction_is_a_value_error_and_usable_after_rollback(
    app: App, dsn: str, sync_conn: psycopg.Connection[Any], call: str
):
    log: list[int] = []
    with pytest.raises(psycopg.errors.DivisionByZero):
        sync_conn.execute("SELECT 1 / 0")
    with pytest.raises(ValueError, match="conn= is in a failed transaction: roll it back"):
        SYNC_CALLS[call](app, sync_conn, log)
    assert log == []
    sync_conn.rollback()
    with sync_conn.transaction():
        app.enqueue("k", {"n": 1}, conn=sync_conn)
    assert count(dsn) == 1


@pytest.mark.parametrize("call", ASYNC_CALLS)
def test_a_closed_or_failed_async_conn_is_a_value_error(app: App, dsn: str, call: str):
    log: list[int] = []

    async def attempt() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn)
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("SELECT 1 / 0")
        with pytest.raises(ValueError, match="conn= is in a failed transaction"):
            await ASYNC_CALLS[call](app, conn, log)
        await conn.close()
        with pytest.raises(ValueError, match="conn= is closed"):
            await ASYNC_CALLS[call](app, conn, log)

    asyncio.run(attempt())
    assert log == []
    assert count(dsn) == 0


def test_a_typo_names_only_close_kinds_not_every_kind_of_the_same_module(app: App, dsn: str):
    @app.job(kind="shop.jobs.send_email")
    def send_email(to: str) -> None: ...

    @app.job(kind="shop.jobs.call_api")
    def call_api(to: str) -> None: ...

    @app.job(kind="shop.jobs.moody")
    def moody(to: str) -> None: ...

    with pytest.raises(UnknownKind) as excinfo:
        app.enqueue("shop.jobs.send_emial", {"to": "a"})
    assert "did you mean 'shop.jobs.send_email'?" in str(excinfo.value)  # and no other
    assert count(dsn) == 0


# Every way to give a job's handle a connection.
HANDLE_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "using": lambda job, conn: job.using(conn).enqueue(user_id=1),
    "enqueue": lambda job, conn: job.enqueue(user_id=1, conn=conn),
    "enqueue_many": lambda job, conn: job.enqueue_many([{"user_id": 1}], conn=conn),
    "enqueue_async": lambda job, conn: asyncio.run(job.enqueue_async(user_id=1, conn=conn)),
    "enqueue_many_async": lambda job, conn: asyncio.run(job.enqueue_many_async([{"user_id": 1}], conn=conn)),
}


@pytest.mark.parametrize("call", HANDLE_CALLS)
def test_a_conn_of_another_driver_given_to_a_handle_says_what_is_accepted(
    app: App, dsn: str, foreign: list[Any], call: str
):
    @app.job()
    def send_welcome(user_id: int) -> None: ...

    for conn in foreign:
        with pytest.raises(TypeError) as excinfo:
            HANDLE_CALLS[call](send_welcome, conn)
        message = str(excinfo.value)
        assert "(psycopg2 and other drivers are not supported)" in message
        assert f"not {type(conn).__module__}.{type(conn).__qualname__};" in message  # sqlite3.Connection
        assert "connection underneath" in message
        assert "_async" not in message  # a cursor is no AsyncConnection
    assert count(dsn) == 0


def test_a_handle_given_the_other_kind_of_psycopg_conn_names_the_methods_for_it(app: App, dsn: str):
    @app.job()
    def send_welcome(user_id: int) -> None: ...

    with (
        psycopg.connect(dsn) as conn,
        pytest.raises(TypeError, match="the async methods take an AsyncConnection"),
    ):
        asyncio.run(send_welcome.using(conn).enqueue_async(user_id=1))

    async def attempt() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            with pytest.raises(TypeError, match="use enqueue_async or enqueue_many_async"):
                send_welcome.using(aconn).enqueue(user_id=1)

    asyncio.run(attempt())
    assert count(dsn) == 0


# --- registering handlers (issue 25) ---------------------------------------------------------


def test_a_bare_job_decorator_registers_as_with_parentheses(app: App, dsn: str):
    @app.job
    def bare(n: int) -> int:
        return n * 2

    kind = f"{__name__}.test_a_bare_job_decorator_registers_as_with_parentheses.<locals>.bare"
    assert app.jobs[kind].func is bare.__wrapped__
    assert bare(n=2) == 4  # still callable as the function
    bare.enqueue(n=1)
    assert count(dsn) == 1

    @app.job
    async def bare_async() -> None: ...

    assert app.jobs[bare_async.kind].is_async


def test_a_kind_that_is_neither_a_string_nor_a_function_is_a_type_error(app: App):
    with pytest.raises(TypeError, match="kind must be a string, not 3"):
        app.job(3)  # type: ignore[call-overload]


def test_a_handler_taking_star_args_is_refused_at_registration(app: App):
    with pytest.raises(TypeError, match=r"\*items can never receive anything: a job's args are passed"):

        @app.job(kind="star")
        def star(*items: int) -> None: ...

    with pytest.raises(TypeError, match=r"\*rest"):

        @app.job
        def mixed(first: int, *rest: int, **options: Any) -> None: ...

    assert app.jobs == {}
