"""Middleware: around every job's execution and every enqueue, with the job's whole context."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App, Cancel, Enqueue, JobContext, Retry, Snooze, _core, _core_py, current_job
from fastjobs.errors import FastjobsError
from fastjobs.executor import Executor
from fastjobs.maintenance import periodic_once

from . import procs
from .helpers import drain, jobs, query

Seen = list[tuple[str, Any]]


def _fields(job: JobContext) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "queue": job.queue,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "args": job.args,
        "meta": job.meta,
    }


def _recording(seen: Seen, name: str) -> Callable[[JobContext, Callable[[], Any]], Any]:
    def middleware(job: JobContext, call_next: Callable[[], Any]) -> Any:
        seen.append((f"{name} before", _fields(job)))
        try:
            result = call_next()
        except BaseException as exc:
            seen.append((f"{name} raised", type(exc).__name__))
            raise
        seen.append((f"{name} after", result))
        return result

    return middleware


def test_middleware_wraps_each_sync_job_in_registration_order_with_its_whole_context(app: App) -> None:
    seen: Seen = []
    app.middleware(_recording(seen, "outer"))
    app.middleware(_recording(seen, "inner"))
    times: list[tuple[Any, ...]] = []

    @app.job(kind="add", queue="maths", max_attempts=3)
    def add(a: int, b: int) -> int:
        job = current_job()
        assert job is not None
        times.append((job.enqueued_at, job.scheduled_at, job.started_at))
        seen.append(("handler", a + b))
        return a + b

    before = dt.datetime.now(dt.UTC)
    job_id = add.enqueue(a=1, b=2)
    drain(app, ["maths"])
    context = {
        "id": job_id,
        "kind": "add",
        "queue": "maths",
        "attempt": 1,
        "max_attempts": 3,
        "args": {"a": 1, "b": 2},
        "meta": {},
    }
    assert seen == [
        ("outer before", context),
        ("inner before", context),
        ("handler", 3),
        ("inner after", 3),
        ("outer after", 3),
    ]
    [(enqueued, scheduled, started)] = times
    # The database's clock and ours: the same machine, a second of slack.
    slack = dt.timedelta(seconds=1)
    assert before - slack <= enqueued <= scheduled <= started + slack
    assert started <= dt.datetime.now(dt.UTC)
    assert jobs(app.dsn) == []


def test_without_middleware_a_job_knows_its_id_kind_and_attempt_only(app: App) -> None:
    seen: list[JobContext] = []

    @app.job(kind="look")
    def look() -> None:
        job = current_job()
        assert job is not None
        seen.append(job)
        assert (job.kind, job.attempt) == ("look", 1)
        assert (job.queue, job.args, job.meta, job.enqueued_at, job.started_at) == (None,) * 5

    look.enqueue()
    drain(app)
    assert len(seen) == 1


def test_a_def_middleware_wraps_def_handlers_and_an_async_one_async_handlers(app: App) -> None:
    seen: Seen = []
    app.middleware(_recording(seen, "sync"))

    @app.middleware
    async def asynchronous(job: JobContext, call_next: Callable[[], Any]) -> Any:
        seen.append(("async before", _fields(job)))
        assert job is current_job()  # the task's own context
        result = await call_next()
        seen.append(("async after", result))
        return result

    @app.job(kind="sleepy")
    async def sleepy(n: int) -> int:
        await asyncio.sleep(0)
        seen.append(("async handler", n))
        return n

    @app.job(kind="slow", timeout=30)  # a sync job the executor runs (its timeout)
    def slow(n: int) -> int:
        seen.append(("slow handler", n))
        return n

    async_id = sleepy.enqueue(n=1)
    slow_id = slow.enqueue(n=2)
    drain(app)
    context = {"queue": "default", "attempt": 1, "max_attempts": 25, "meta": {}}
    assert ("async before", {**context, "id": async_id, "kind": "sleepy", "args": {"n": 1}}) in seen
    assert ("sync before", {**context, "id": slow_id, "kind": "slow", "args": {"n": 2}}) in seen
    names = [name for name, _ in seen]
    assert [n for n in names if n.startswith(("sync", "slow"))] == [
        "sync before",
        "slow handler",
        "sync after",
    ]
    assert [n for n in names if n.startswith("async")] == ["async before", "async handler", "async after"]
    assert len(names) == 6  # neither wraps the other's handlers


@pytest.mark.parametrize(
    ("raised", "state"),
    [(Retry(3600), "retryable"), (Snooze(3600), "scheduled"), (Cancel("no"), "cancelled")],
    ids=["Retry", "Snooze", "Cancel"],
)
def test_retry_snooze_and_cancel_pass_through_middleware(app: App, raised: Exception, state: str) -> None:
    seen: Seen = []
    app.middleware(_recording(seen, "mw"))

    @app.job(kind="steer")
    def steer() -> None:
        raise raised

    job_id = steer.enqueue()
    drain(app)
    assert seen[1:] == [("mw raised", type(raised).__name__)]
    assert query(app.dsn, "SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,)) == [
        {"state": state}
    ]


def test_middleware_may_transform_what_the_handler_raises_and_fails_the_job_when_it_raises(app: App) -> None:
    @app.middleware
    def steer(job: JobContext, call_next: Callable[[], Any]) -> Any:
        if job.args == {"mode": "broken"}:
            raise RuntimeError("middleware says no")
        try:
            return call_next()
        except KeyError as exc:
            raise Snooze(3600) from exc
        except ValueError:
            return None  # swallowed: the job completes

    @app.job(kind="mode")
    def mode(mode: str) -> None:
        raise {"snooze": KeyError, "swallow": ValueError}.get(mode, LookupError)(mode)

    snoozed, swallowed, broken = (mode.enqueue(mode=m) for m in ("snooze", "swallow", "broken"))
    drain(app)
    rows = {
        r["id"]: r for r in query(app.dsn, "SELECT id, state::text, attempt, errors FROM fastjobs_jobs_all")
    }
    assert (rows[snoozed]["state"], rows[snoozed]["attempt"]) == ("scheduled", 0)
    assert swallowed not in rows  # completed and deleted
    assert rows[broken]["state"] == "retryable"
    assert rows[broken]["errors"][0]["error"] == "RuntimeError: middleware says no"
    assert "in steer" in rows[broken]["errors"][0]["traceback"]


def test_enqueue_middleware_stores_meta_on_every_job_of_each_kind_of_enqueue(app: App) -> None:
    calls: list[tuple[str, bool, dict[str, Any] | None, Any]] = []

    @app.enqueue_middleware
    def stamp(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        enqueue.meta["request"] = f"r{len(calls)}"
        result = call_next()
        calls.append((enqueue.kind, enqueue.many, enqueue.args, result))
        return result

    seen: list[tuple[int, Any]] = []

    @app.middleware
    def record(job: JobContext, call_next: Callable[[], Any]) -> Any:
        assert job.args is not None
        seen.append((job.args["n"], job.meta))
        return call_next()

    app.job(kind="plain")(lambda n: None)
    app.job(kind="once", unique=True)(lambda n: None)

    one = app.enqueue("plain", {"n": 0})
    assert app.enqueue_many("plain", ({"n": n} for n in (1, 2))) == 2  # binary COPY
    assert app.enqueue_many("plain", [{"n": 3}], delay=0.001) == 1  # COPY with run_at
    assert app.enqueue_many("once", [{"n": 4}, {"n": 4}, {"n": 5}]) == 2  # staged COPY, unique
    with psycopg.connect(app.dsn) as conn:  # the caller's transaction
        app.enqueue("plain", {"n": 6}, conn=conn)
    assert calls == [
        ("plain", False, {"n": 0}, one),
        ("plain", True, None, 2),
        ("plain", True, None, 1),
        ("once", True, None, 2),
        ("plain", False, {"n": 6}, calls[-1][3]),
    ]
    stored = {r["args"]["n"]: r["meta"] for r in query(app.dsn, "SELECT args, meta FROM fastjobs_jobs_all")}
    assert stored == {
        0: {"request": "r0"},
        1: {"request": "r1"},
        2: {"request": "r1"},
        3: {"request": "r2"},
        4: {"request": "r3"},
        5: {"request": "r3"},
        6: {"request": "r4"},
    }
    drain(app)
    assert sorted(seen) == sorted(stored.items())


async def test_async_enqueue_middleware_wraps_the_async_enqueues(app: App) -> None:
    @app.enqueue_middleware
    def sync_only(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        raise AssertionError("a def enqueue middleware does not wrap the async methods")

    @app.enqueue_middleware
    async def stamp(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        enqueue.meta["via"] = "async"
        return await call_next()

    one = await app.enqueue_async("k", {"n": 1})
    assert await app.enqueue_many_async("k", [{"n": 2}, {"n": 3}]) == 2
    await app.aclose()
    rows = query(app.dsn, "SELECT id, meta FROM fastjobs_jobs_all ORDER BY id")
    assert rows[0]["id"] == one
    assert [r["meta"] for r in rows] == [{"via": "async"}] * 3


def test_enqueue_middleware_refuses_by_raising_and_nothing_is_inserted(app: App) -> None:
    class Refused(Exception):
        pass

    @app.enqueue_middleware
    def gate(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        if enqueue.queue == "closed":
            raise Refused(enqueue.kind)
        return call_next()

    with pytest.raises(Refused):
        app.enqueue("k", {}, queue="closed")
    with pytest.raises(Refused):
        app.enqueue_many("k", [{}, {}], queue="closed")
    assert jobs(app.dsn) == []
    app.enqueue("k", {}, queue="open")
    assert len(jobs(app.dsn)) == 1


def test_meta_that_is_not_json_fails_the_enqueue_with_its_reason(app: App) -> None:
    @app.enqueue_middleware
    def bad(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        enqueue.meta["when"] = object()
        return call_next()

    with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
        app.enqueue("k", {})
    with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
        app.enqueue_many("k", [{}])
    assert jobs(app.dsn) == []


def _contexts(core: Any, dsn: str) -> list[dict[str, Any]]:
    """The contexts middleware saw in one batch of `core`'s loop with full context."""
    app = App(dsn)
    seen: list[dict[str, Any]] = []

    def record(job: JobContext, call_next: Callable[[], Any]) -> Any:
        seen.append({**_fields(job), "enqueued_at": job.enqueued_at, "scheduled_at": job.scheduled_at})
        return call_next()

    async def record_async(job: JobContext, call_next: Callable[[], Any]) -> Any:
        record(job, lambda: None)
        return await call_next()

    app.middleware(record)
    app.middleware(record_async)
    app.job(kind="fast")(lambda n: None)
    app.job(kind="timed", timeout=30)(lambda n: None)

    async def coroutine(n: int) -> None:
        return None

    app.job(kind="async")(coroutine)
    ids = [app.enqueue(kind, {"n": n}) for n, kind in enumerate(["fast", "timed", "async", "fast"])]
    query(dsn, "UPDATE fastjobs_jobs_all SET meta = '[\"not an object\"]' WHERE id = %s", (ids[3],))
    executor = Executor()
    executor.bind()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            loop = core.BatchLoop(
                conn, app.runnable(), executor, "w", ["default"], batch_min=4, batch_max=4, whole_context=True
            )
            loop.prepare()
            assert loop.step() == 4
            loop.stopping = True
            loop.finish()
    finally:
        executor.close()
        app.close()
    assert jobs(dsn) == []  # all completed
    # The fast jobs inline, then the executor's: the timed one, the async one.
    for context, job_id in zip(seen, [ids[0], ids[3], ids[1], ids[2]], strict=True):
        assert context.pop("id") == job_id
    return seen


def test_the_twins_fill_the_same_context(twin_dsns: tuple[str, str]) -> None:
    python = _contexts(_core_py, twin_dsns[0])
    c = _contexts(_core, twin_dsns[1])
    for ours, theirs in zip(python, c, strict=True):
        assert ours.pop("enqueued_at") <= ours.pop("scheduled_at")
        assert theirs.pop("enqueued_at") <= theirs.pop("scheduled_at")
    assert python == c
    assert [(x["kind"], x["args"], x["meta"], x["queue"], x["attempt"]) for x in python] == [
        ("fast", {"n": 0}, {}, "default", 1),
        ("fast", {"n": 3}, {}, "default", 1),  # a meta that is no object reads as {}
        ("timed", {"n": 1}, {}, "default", 1),
        ("async", {"n": 2}, {}, "default", 1),
    ]


MODULE = "fjmiddleware"
SOURCE = '''
"""Middleware through `fastjobs run`: each execution one JSON line in $FJ_TEST_SEEN."""

import json
import os

import fastjobs

app = fastjobs.App()


@app.middleware
def record(job, call_next):
    try:
        outcome = call_next()
    except fastjobs.Retry:
        outcome = "retry"
        raise
    finally:
        line = {
            "id": job.id, "kind": job.kind, "queue": job.queue, "attempt": job.attempt,
            "args": job.args, "meta": job.meta, "pid": os.getpid(), "outcome": outcome,
            "waited": (job.started_at - job.enqueued_at).total_seconds(),
        }
        with open(os.environ["FJ_TEST_SEEN"], "a") as seen:
            seen.write(json.dumps(line) + "\\n")


@app.job(kind="flaky", queue="mw")
def flaky(n):
    if fastjobs.current_job().attempt == 1:
        raise fastjobs.Retry(0)
    return "done"
'''


def stamp(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
    enqueue.meta["origin"] = "test"
    return call_next()


def test_middleware_runs_in_fastjobs_run(
    masters: procs.Masters, app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_path = tmp_path / "seen.jsonl"
    monkeypatch.setenv("FJ_TEST_SEEN", str(seen_path))
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    app.enqueue_middleware(stamp)  # the producer: this process
    master = masters.start("--processes", "1", "--queues", "mw", module=MODULE)
    master.wait_stderr(r"leader elected")
    job_id = app.enqueue("flaky", {"n": 7}, queue="mw")

    def lines() -> list[dict[str, Any]]:
        return [json.loads(x) for x in seen_path.read_text().splitlines()] if seen_path.exists() else []

    procs.wait_for(lambda: len(lines()) == 2, f"two executions in {seen_path}")
    assert master.stop() == 0, master.stderr()
    first, second = lines()
    common = {"id": job_id, "kind": "flaky", "queue": "mw", "args": {"n": 7}, "meta": {"origin": "test"}}
    assert {k: first[k] for k in common} == common == {k: second[k] for k in common}
    assert (first["attempt"], first["outcome"]) == (1, "retry")
    assert (second["attempt"], second["outcome"]) == (2, "done")
    assert first["pid"] != os.getpid()
    assert first["waited"] > -1  # started after it was enqueued (two clocks, a second of slack)


def test_the_leaders_periodic_enqueues_go_through_enqueue_middleware(app: App) -> None:
    seen: list[tuple[str, bool]] = []

    @app.enqueue_middleware
    def stamp(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        seen.append((enqueue.kind, enqueue.many))
        enqueue.meta["by"] = "leader"
        return call_next()

    app.periodic("*/5 * * * *", kind="tick")(lambda: None)
    tick = dt.datetime(2030, 1, 1, 12, 5, tzinfo=dt.UTC)
    with psycopg.connect(app.dsn, autocommit=True) as conn:
        specs = [spec for spec in app.jobs.values() if spec.cron]
        assert periodic_once(conn, specs, tick + dt.timedelta(seconds=20), app=app) == [("tick", tick)]
    assert seen == [("tick", False)]
    assert [(r["kind"], r["meta"]) for r in jobs(app.dsn)] == [("tick", {"by": "leader"})]


def test_an_enqueue_returns_what_it_inserted_and_a_middleware_that_skips_call_next_is_an_error(
    app: App,
) -> None:
    skip: list[bool] = [False]

    @app.enqueue_middleware
    def careless(enqueue: Enqueue, call_next: Callable[[], Any]) -> None:
        if not skip[0]:
            call_next()  # its result dropped: the caller still gets the id, the count

    job_id = app.enqueue("k", {})
    assert [r["id"] for r in jobs(app.dsn)] == [job_id]
    assert app.enqueue_many("k", [{}, {}]) == 2
    skip[0] = True
    with pytest.raises(
        FastjobsError, match=r"returned without calling call_next\(\): no 'k' job was enqueued"
    ):
        app.enqueue("k", {})
    assert len(jobs(app.dsn)) == 3


def test_jobs_on_a_queues_threads_run_behind_middleware_with_their_whole_context(app: App) -> None:
    """A queue given threads runs its sync jobs on the pool: each pool thread's context is the
    one its middleware sees, filled whole, and the handler's current_job() is that same one."""
    seen: Seen = []
    app.middleware(_recording(seen, "mw"))
    app.enqueue_middleware(lambda call, call_next: (call.meta.update(origin="test"), call_next())[1])
    same: list[bool] = []

    @app.job(kind="pooled", queue="io")
    def pooled(n: int) -> int:
        job = current_job()
        same.append(job is not None and job.id != 0 and job.args == {"n": n})
        return n

    ids = [pooled.enqueue(n=n) for n in range(6)]
    drain(app, ["io"], threads={"io": 3})
    befores = sorted((fields["id"], fields) for name, fields in seen if name == "mw before")
    assert [job_id for job_id, _ in befores] == ids
    for n, (job_id, fields) in enumerate(befores):
        assert fields == {
            "id": job_id,
            "kind": "pooled",
            "queue": "io",
            "attempt": 1,
            "max_attempts": 25,
            "args": {"n": n},
            "meta": {"origin": "test"},
        }
    assert sorted(result for name, result in seen if name == "mw after") == list(range(6))
    assert same == [True] * 6
    assert jobs(app.dsn) == []


def test_an_enqueue_middleware_raising_after_call_next_leaves_nothing_inserted(app: App) -> None:
    """Raising refuses the enqueue, before or after call_next(): without conn= the chain runs in
    one transaction of fastjobs' own; a second call_next() is an error, not a second job."""
    app.declare("k")

    def after(call: Enqueue, call_next: Callable[[], Any]) -> Any:
        call_next()
        if call.kind == "k":
            raise RuntimeError("reporting failed")

    app.enqueue_middleware(after)
    with pytest.raises(RuntimeError, match="reporting failed"):
        app.enqueue("k", {"n": 1})
    with pytest.raises(RuntimeError, match="reporting failed"):
        app.enqueue_many("k", [{"n": 2}, {"n": 3}])
    assert jobs(app.dsn) == []

    twice = App(app.dsn)
    twice.declare("k")
    twice.enqueue_middleware(lambda call, call_next: (call_next(), call_next())[1])
    try:
        with pytest.raises(FastjobsError, match=r"call_next\(\) more than once"):
            twice.enqueue("k", {"n": 4})
        assert jobs(app.dsn) == []
    finally:
        twice.close()


async def test_an_async_enqueue_middleware_raising_after_call_next_leaves_nothing_inserted(app: App) -> None:
    app.declare("k")

    async def after(call: Enqueue, call_next: Callable[[], Any]) -> Any:
        await call_next()
        raise RuntimeError("reporting failed")

    app.enqueue_middleware(after)
    with pytest.raises(RuntimeError, match="reporting failed"):
        await app.enqueue_async("k", {"n": 1})
    with pytest.raises(RuntimeError, match="reporting failed"):
        await app.enqueue_many_async("k", [{"n": 2}])
    await app.aclose()
    assert jobs(app.dsn) == []


def test_a_meta_too_deep_to_decode_reads_as_empty_and_the_job_runs(app: App) -> None:
    """jsonb nests deeper than orjson reads: that meta reads as {}, on both loops, and the job
    runs instead of its worker dying of it."""
    seen: Seen = []
    app.middleware(_recording(seen, "mw"))

    @app.job(kind="deep")
    def deep() -> None:
        pass

    job_id = deep.enqueue()
    query(
        app.dsn,
        "UPDATE fastjobs_jobs_all SET meta = %s::jsonb WHERE id = %s",
        ("[" * 1100 + "]" * 1100, job_id),
    )
    drain(app)
    assert [fields["meta"] for name, fields in seen if name == "mw before"] == [{}]
    assert jobs(app.dsn) == []
