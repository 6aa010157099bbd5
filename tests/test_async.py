"""Async handlers: the concurrency they were given, a graceful stop mid-batch, their own CancelledError."""

from __future__ import annotations

import asyncio
import threading
import time

from fastjobs import App
from fastjobs.executor import Executor
from fastjobs.worker import Worker, WorkerConfig

from .helpers import OVERLAP, WorkerThread, batch_loop, jobs, run_one_batch, wait_for


@OVERLAP
def test_async_jobs_run_as_many_at_once_as_their_concurrency(app: App, dsn, overlap):
    """30 jobs of 0.5 s at concurrency 10: batches grow to a wave of 10, about 3 s in all.

    The batch cap judged by wall time alone saw 0.5 s per job and kept batches
    at 1 or 2 jobs: 15 s, whatever the concurrency.
    """
    active = [0]
    peak = [0]
    done = [0]

    @app.job(kind="nap")
    async def nap(n: int) -> None:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.5)
        active[0] -= 1
        done[0] += 1

    nap.enqueue_many({"n": n} for n in range(30))
    began = time.monotonic()
    with WorkerThread(Worker(app, config=WorkerConfig(concurrency=10, overlap=overlap))):
        assert wait_for(lambda: done[0] == 30, timeout=6.0), f"{done[0]} done, at most {peak[0]} at once"
        took = time.monotonic() - began
    assert peak[0] >= 8, peak[0]
    assert took < 6.0, took
    assert jobs(dsn) == []


@OVERLAP
def test_a_graceful_stop_gives_back_the_async_jobs_waiting_for_a_slot(app: App, dsn, overlap):
    """A stop while the first wave runs: that wave finishes, the 20 waiting jobs go back unstarted."""
    started: list[int] = []
    wave_in = threading.Event()
    executor = Executor(10)

    @app.job(kind="wave")
    async def wave(n: int) -> None:
        started.append(n)
        if len(started) == 10:
            wave_in.set()
        await asyncio.sleep(0.3)

    wave.enqueue_many({"n": n} for n in range(30))
    with batch_loop(app, 30, overlap=overlap, executor=executor) as loop:
        ran: list[int] = []
        stepper = threading.Thread(target=lambda: ran.append(loop.step()))
        stepper.start()
        assert wave_in.wait(5.0)
        began = time.monotonic()
        executor.stopping = loop.stopping = True  # what Worker.stop does
        stepper.join(5.0)
        assert not stepper.is_alive()
        loop.finish()
    assert time.monotonic() - began < 0.5 + 0.3  # the wave that ran, not two more
    assert len(started) == 10, f"{len(started)} started after the stop"
    assert ran == [30]
    rows = jobs(dsn)
    assert len(rows) == 20
    assert {(r["state"], r["attempt"], r["errors"]) for r in rows} == {("available", 0, None)}
    assert {r["args"]["n"] for r in rows}.isdisjoint(started)


@OVERLAP
def test_an_async_handler_raising_cancelled_error_fails_its_job_only(app: App, dsn, overlap):
    """CancelledError that no cancel request caused is that job's failure; the batch completes."""
    ran: list[int] = []

    @app.job(kind="maybe", max_attempts=3)
    async def maybe(n: int) -> None:
        ran.append(n)
        if n == 1:
            raise asyncio.CancelledError("raised by the handler itself")

    maybe.enqueue_many({"n": n} for n in range(3))
    assert run_one_batch(app, 3, overlap=overlap) == 3

    assert sorted(ran) == [0, 1, 2]
    rows = jobs(dsn)
    assert [(r["args"]["n"], r["state"], r["attempt"]) for r in rows] == [(1, "retryable", 1)]
    [error] = rows[0]["errors"]
    assert error["error"] == "CancelledError: raised by the handler itself"
    assert error["attempt"] == 1
