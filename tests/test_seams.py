"""Where the features meet: threads, counts per kind, typed arguments, the testing kit, enqueue checks.

Each was tested alone on its branch; these tests run them together, through
real `fastjobs run` masters (both hot loops run this module) and the kit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import textwrap
import uuid
from typing import Any

import orjson
import psycopg
import pytest

from fastjobs import App, Cancel, Retry, Snooze, UnknownKind, current_job
from fastjobs.abc import OUTCOMES
from fastjobs.testing import Drained

from . import procs
from .helpers import insert_raw
from .procs import count, wait_for
from .test_metrics import metrics_port, scrape
from .test_stats import samples

# Kinds typed and not, in an order the counts' rows must keep: each handler
# checks what it was given, and a wrong type fails its one attempt (discarded).
SEAMS_MODULE = """
import asyncio
import dataclasses
import datetime as dt
import os
import threading

import psycopg

import fastjobs

app = fastjobs.App()


@dataclasses.dataclass
class Point:
    x: int
    y: int


def _check(p, kind):
    assert isinstance(p, Point), f"{kind}: got {p!r}"
    job = fastjobs.current_job()
    assert job is not None and job.kind == kind and job.id > 0, job
    if os.environ.get("FJ_SEAMS_POOLED"):
        assert threading.current_thread() is not threading.main_thread(), "not on the pool"


@app.job("plain", max_attempts=1)
def plain(n):
    pass


@app.job("typed", max_attempts=1)
def typed(p: Point, at: dt.datetime) -> None:
    _check(p, "typed")
    assert isinstance(at, dt.datetime) and at.tzinfo is not None, at


@app.job("native", max_attempts=1)
def native(n: int) -> None:
    assert type(n) is int


@app.job("typed_retry", max_attempts=2)
def typed_retry(p: Point) -> None:
    _check(p, "typed_retry")
    raise fastjobs.Retry(0)


@app.job("typed_cancel")
def typed_cancel(p: Point) -> None:
    _check(p, "typed_cancel")
    raise fastjobs.Cancel("not wanted")


_snoozed = set()


@app.job("typed_snooze", max_attempts=1)
def typed_snooze(p: Point) -> None:
    _check(p, "typed_snooze")
    job = fastjobs.current_job()
    if job.id not in _snoozed:  # one worker process: once per job
        _snoozed.add(job.id)
        raise fastjobs.Snooze(0)


@app.job("typed_timeout", timeout=30, max_attempts=1)
def typed_timeout(p: Point) -> None:
    _check(p, "typed_timeout")


@app.job("typed_async", max_attempts=1)
async def typed_async(p: Point) -> None:
    assert isinstance(p, Point), p
    job = fastjobs.current_job()
    assert job is not None and job.kind == "typed_async"
    await asyncio.sleep(0)


@app.job("typed_async_timeout", timeout=30, max_attempts=1)
async def typed_async_timeout(p: Point) -> None:
    assert isinstance(p, Point), p
    await asyncio.sleep(0)
"""

# kind: (jobs, args) enqueued through the App (checked and stored as JSON).
POINT = {"p": {"x": 1, "y": 2}}
ENQUEUED: dict[str, tuple[int, dict[str, Any]]] = {
    "plain": (9, {"n": 1}),
    "typed": (8, {**POINT, "at": "2026-01-01T00:00:00+00:00"}),
    "native": (7, {"n": 3}),
    "typed_retry": (3, POINT),
    "typed_cancel": (2, POINT),
    "typed_snooze": (4, POINT),
    "typed_timeout": (5, POINT),
    "typed_async": (6, POINT),
    "typed_async_timeout": (3, POINT),
}
# Rows that do not convert (raw SQL, an older version): discarded at once, InvalidArguments.
INVALID = {"typed": 2, "typed_timeout": 1, "typed_async": 1}
EXPECTED = {  # kind: (completed, retried, discarded, cancelled, snoozed), handler runs
    "plain": ((9, 0, 0, 0, 0), 9),
    "typed": ((8, 0, 2, 0, 0), 10),
    "native": ((7, 0, 0, 0, 0), 7),
    "typed_retry": ((0, 3, 3, 0, 0), 6),
    "typed_cancel": ((0, 0, 0, 2, 0), 2),
    "typed_snooze": ((4, 0, 0, 0, 4), 8),
    "typed_timeout": ((5, 0, 1, 0, 0), 6),
    "typed_async": ((6, 0, 1, 0, 0), 7),
    "typed_async_timeout": ((3, 0, 0, 0, 0), 3),
}


def _enqueue_raw(dsn: str) -> None:
    """Every job as rows of raw SQL (the kinds' checks are the App's; conversion is the worker's)."""
    for kind, (n, args) in ENQUEUED.items():
        attempts = 2 if kind == "typed_retry" else (25 if kind == "typed_cancel" else 1)
        for _ in range(n):
            _insert(dsn, kind, orjson.dumps(args).decode(), attempts)
    for kind, n in INVALID.items():
        for _ in range(n):
            _insert(dsn, kind, '{"p": "not a point", "at": "2026-01-01T00:00:00+00:00"}', 25)


def _insert(dsn: str, kind: str, args_json: str, max_attempts: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO fastjobs_jobs (kind, args, max_attempts) VALUES (%s, %s::jsonb, %s)",
            (kind, args_json, max_attempts),
        )


@pytest.mark.parametrize("queues", ["default", "default:4"], ids=["loop_thread", "pooled"])
def test_typed_jobs_on_the_pool_and_off_it_are_converted_and_counted_under_their_own_kind(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any], queues: str, monkeypatch: Any
) -> None:
    """Typed and plain kinds in one app, sync, with timeouts, async, on threads or not: each
    handler gets its annotated types and current_job(), a row that does not convert is discarded,
    and each outcome and run time is counted under its own kind (the loop's row numbers and the
    master's names agree), in the metrics and in `fastjobs stats --json`."""
    (masters.cwd / "fjseams.py").write_text(textwrap.dedent(SEAMS_MODULE))
    if queues.endswith(":4"):
        monkeypatch.setenv("FJ_SEAMS_POOLED", "1")
    _enqueue_raw(app.dsn)
    master = masters.start("--processes", "1", "--queues", queues, "--metrics-port", "0", module="fjseams")
    port = metrics_port(master)
    finished = "SELECT count(*) FROM fastjobs_jobs_all WHERE state NOT IN ('discarded', 'cancelled')"
    wait_for(lambda: count(db, finished) == 0, f"every job to finish:\n{master.stderr()}")
    total = sum(sum(outcomes) for outcomes, _ in EXPECTED.values())

    def counted() -> dict[str, float] | None:
        found = samples(scrape(port))
        done = sum(v for k, v in found.items() if k.startswith("fastjobs_job_outcomes_total{"))
        return found if done == total else None

    found = wait_for(counted, "the outcomes to be counted")
    errors = db.execute(
        "SELECT kind, errors FROM fastjobs_jobs_all WHERE state = 'discarded' AND kind <> 'typed_retry'"
    ).fetchall()
    for kind, errs in errors:
        assert "InvalidArguments" in errs[-1]["error"] and "'p'" in errs[-1]["error"], (kind, errs)
    assert len(errors) == sum(INVALID.values())
    for kind, (outcomes, runs) in EXPECTED.items():
        labels = f'queue="default",kind="{kind}"'
        got = tuple(int(found[f'fastjobs_job_outcomes_total{{{labels},outcome="{o}"}}']) for o in OUTCOMES)
        assert got == outcomes, kind
        assert found.get(f"fastjobs_job_run_seconds_count{{{labels}}}", 0) == runs, kind
    assert not any('kind="(other)"' in k and v for k, v in found.items() if "outcomes_total" in k)

    doc = procs.stats_json(app.dsn)
    [mine] = [m for m in doc["masters"] if m["master_pid"] == master.pid]
    kinds = {k["kind"]: k for k in mine["kinds"]}
    for kind, (outcomes, runs) in EXPECTED.items():
        assert tuple(kinds[kind]["outcomes"][o] for o in OUTCOMES) == outcomes, kind
        assert kinds[kind]["run_seconds"]["count"] == runs, kind

    # The cluster view: the same counts, named the same, through the worker's heartbeat.
    def beaten() -> list[dict[str, Any]] | None:
        [host] = procs.stats_json(app.dsn)["cluster"]
        done = sum(row[o] for row in host["kinds"] for o in OUTCOMES)
        return host["kinds"] if done == total else None

    rows = {row["kind"]: row for row in wait_for(beaten, "a heartbeat to carry every outcome", timeout=15)}
    for kind, (outcomes, _) in EXPECTED.items():
        assert tuple(rows[kind][o] for o in OUTCOMES) == outcomes, kind
    assert master.stop() == 0, master.stderr()


# --- the testing kit with typed handlers, declared kinds -------------------------


@dataclasses.dataclass
class Item:
    sku: str
    count: int


class Size(enum.Enum):
    SMALL = "s"
    LARGE = "l"


def test_assert_enqueued_matches_typed_args_by_the_value_enqueued_or_its_stored_form(app: App) -> None:
    """A typed kind's args match by the Python value the test enqueued (converted as the enqueue
    converted it: a Decimal, a set, a dataclass, an aware datetime) or by the JSON form stored."""

    @app.job(kind="order")
    def order(
        item: Item, total: decimal.Decimal, tags: set[str], at: dt.datetime, size: Size, ref: uuid.UUID
    ) -> None:
        pass

    paris = dt.timezone(dt.timedelta(hours=1))
    args: dict[str, Any] = {
        "item": Item("a-1", 2),
        "total": decimal.Decimal("10.50"),
        "tags": {"gift"},
        "at": dt.datetime(2026, 1, 5, 9, 30, 0, 1, tzinfo=paris),
        "size": Size.LARGE,
        "ref": uuid.UUID(int=7),
    }
    order.enqueue(**args)
    with app.testing() as kit:
        kit.assert_enqueued(order, args=args, count=1)
        for name, value in args.items():
            kit.assert_enqueued(order, args={name: value}, count=1)
        stored = {
            "item": {"sku": "a-1", "count": 2},
            "total": "10.50",
            "tags": ["gift"],
            "at": "2026-01-05T09:30:00.000001+01:00",
            "size": "l",
            "ref": str(uuid.UUID(int=7)),
        }
        kit.assert_enqueued(order, args=stored, count=1)
        kit.assert_enqueued("order", args={"total": decimal.Decimal("10.50")}, count=1)
        # A set matches whatever order its JSON array was stored in (a set's iteration order varies).
        tags = {f"tag{n}" for n in range(8)}
        stored_args = {**stored, "tags": list(tags)[::-1]}
        insert_raw(app.dsn, "order", orjson.dumps(stored_args).decode())
        kit.assert_enqueued(order, args={"tags": tags}, count=1)
        kit.assert_enqueued(order, args={"tags": list(tags)[::-1]}, count=1)  # the JSON form, as stored
        kit.refute_enqueued(order, args={"total": decimal.Decimal("10.51")})
        kit.assert_enqueued(order, args={"total": decimal.Decimal("10.5")}, count=2)  # equal as a Decimal
        kit.refute_enqueued(order, args={"item": Item("a-1", 3)})
        with pytest.raises(AssertionError, match="expected a job"):
            kit.assert_enqueued(order, args={"tags": {"other"}})
        with pytest.raises(TypeError, match=r"could never match.*name the job's kind for its annotations"):
            kit.assert_enqueued(args={"total": decimal.Decimal("10.50")})


def test_drain_and_inline_leave_a_declared_kind_to_its_own_service(app: App) -> None:
    """A declared kind (handled elsewhere, on its own queue) is enqueued, never run by the kit."""
    charge = app.declare("billing.charge", queue="billing")

    @app.job(kind="signup")
    def signup(user: int) -> None:
        charge.enqueue(user=user, cents=500)

    with app.testing() as kit:
        signup.enqueue(user=1)
        assert kit.drain() == Drained(completed=1)
        [job] = kit.assert_enqueued(charge, args={"user": 1, "cents": 500}, count=1)
        assert job.state == "available" and job.attempt == 0 and job.errors is None
        assert kit.drain() == Drained()
    with app.testing(mode="inline") as kit:
        signup.enqueue(user=2)
        charge.enqueue(user=3, cents=100)
        kit.assert_enqueued(charge, args={"user": 2}, count=1)
        kit.assert_enqueued(charge, args={"user": 3}, count=1)
        assert kit.enqueued(charge) == kit.enqueued(charge, state="available")
        assert len(kit.enqueued(charge)) == 3


def test_the_kit_runs_typed_handlers_as_a_worker_does(app: App, dsn: str) -> None:
    """Typed args are converted in drain and inline runs, Retry/Snooze/Cancel raised by a typed
    handler act, and a row that does not convert is discarded by the drain."""
    seen: list[Any] = []

    @app.job(kind="ship", max_attempts=2)
    def ship(item: Item, how: str) -> None:
        job = current_job()
        assert job is not None and job.kind == "ship"
        seen.append((item, job.attempt))
        if how == "retry":
            raise Retry(0)
        if how == "snooze" and job.id not in snoozed:
            snoozed.add(job.id)
            raise Snooze(0)
        if how == "cancel":
            raise Cancel("no")

    @app.job(kind="ship_async", timeout=5)
    async def ship_async(item: Item) -> None:
        seen.append(item)

    snoozed: set[int] = set()
    with app.testing() as kit:
        for how in ("ok", "retry", "snooze", "cancel"):
            ship.enqueue(item=Item(how, 1), how=how)
        ship_async.enqueue(item=Item("async", 1))
        insert_raw(dsn, "ship", '{"item": {"sku": "x"}, "how": "ok"}')
        assert kit.drain(now=dt.timedelta(hours=1)) == Drained(
            completed=3, retried=1, discarded=2, cancelled=1, snoozed=1
        )
        assert all(isinstance(s[0] if isinstance(s, tuple) else s, Item) for s in seen)
        [bad] = kit.enqueued("ship", state="discarded", args={"how": "ok"})
        assert bad.errors is not None and "InvalidArguments" in bad.errors[-1]["error"]
    seen.clear()
    with app.testing(mode="inline") as kit, psycopg.connect(dsn) as conn:
        with conn.transaction():
            ship.using(conn).enqueue(item=Item("in tx", 2), how="ok")
            assert seen == []
        assert seen == [(Item("in tx", 2), 1)]


DECLARING_MODULE = """
import fastjobs

app = fastjobs.App()
app.declare("billing.charge")  # on "default", which this app's workers serve
app.declare("billing.refund", queue="billing")


@app.job("mine")
def mine():
    pass
"""


def test_a_master_serving_the_queue_of_a_declared_kind_says_so(masters: procs.Masters) -> None:
    (masters.cwd / "fjdeclaring.py").write_text(DECLARING_MODULE)
    master = masters.start("--processes", "1", module="fjdeclaring")
    master.wait_child("fastjobs: worker 1 ")
    master.wait_stderr(r"job kind 'billing.charge' is declared as handled elsewhere, but its queue 'default'")
    assert master.stop() == 0, master.stderr()
    assert "billing.refund" not in master.stderr()


def test_the_kits_assertions_refuse_a_kind_the_app_could_not_enqueue(app: App) -> None:
    """An App that knows kinds refuses a typo at enqueue; its kit's assertions do too, or
    refute_enqueued("welcom") would pass whatever the code under test enqueued."""

    @app.job(kind="welcome")
    def welcome(n: int) -> None:
        pass

    charge = app.declare("billing.charge", queue="billing")
    welcome.enqueue(n=1)
    charge.enqueue(n=2)
    with app.testing() as kit:
        for check in (kit.refute_enqueued, kit.assert_enqueued, kit.enqueued):
            with pytest.raises(UnknownKind, match="did you mean 'welcome'"):
                check("welcom")
        kit.assert_enqueued("welcome", count=1)
        kit.assert_enqueued("billing.charge", args={"n": 2}, count=1)
        kit.refute_enqueued(charge, args={"n": 1})
    producer = App(app.dsn)  # knows no kinds: enqueues any, and its kit looks for any
    try:
        producer.enqueue("anything", {"n": 3})
        with producer.testing() as kit:
            kit.assert_enqueued("anything", count=1)
            kit.refute_enqueued("welcom")
    finally:
        producer.close()
