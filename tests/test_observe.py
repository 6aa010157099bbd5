"""Counts per queue and kind, their histograms, and the cluster view, through real `fastjobs run` masters.

Every outcome a job can have is counted by the hot loop of the implementation
under test (both run this module), in shared memory, and read three ways:
the metrics endpoint, `fastjobs stats --json`, and the workers' heartbeats in
the database (the cluster view, which two masters posing as two hosts share).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import struct
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App, _core, _core_py, report, scoreboard
from fastjobs.abc import BUCKETS, COMPLETED, INT64_MAX, OUTCOMES, PICKUP_SUM, ROW
from fastjobs.children import EXIT_BOOT_ERROR
from fastjobs.executor import Executor

from . import procs
from .procs import count, wait_for
from .test_metrics import metrics_port, scrape
from .test_stats import samples

# Each kind ends its jobs one way; the slow ones go through the executor.
OUTCOMES_MODULE = """
import asyncio

import fastjobs

app = fastjobs.App()
_snoozed = set()


@app.job("ok")
def ok(n):
    pass


@app.job("flaky", max_attempts=2)
def flaky(n):
    raise fastjobs.Retry(0)


@app.job("cancels")
def cancels(n):
    raise fastjobs.Cancel("not wanted")


@app.job("snoozes")
def snoozes(n):
    job = fastjobs.current_job()
    if job.id not in _snoozed:  # one worker process: once per job
        _snoozed.add(job.id)
        raise fastjobs.Snooze(0)


@app.job("slow_ok", timeout=30)
def slow_ok(n):
    pass


@app.job("async_ok")
async def async_ok(n):
    await asyncio.sleep(0)


@app.job("async_fails", max_attempts=1)
async def async_fails(n):
    raise ValueError("no")
"""

# kind: (jobs enqueued, their max_attempts), and what each kind's row must count.
ENQUEUED = {
    "ok": (40, 25),
    "flaky": (5, 2),
    "cancels": (3, 25),
    "snoozes": (4, 25),
    "slow_ok": (6, 25),
    "async_ok": (7, 25),
    "async_fails": (2, 1),
    "nohandler": (2, 1),
}
EXPECTED = {  # kind: (completed, retried, discarded, cancelled, snoozed), handler runs, claims
    "ok": ((40, 0, 0, 0, 0), 40, 40),
    "flaky": ((0, 5, 5, 0, 0), 10, 10),
    "cancels": ((0, 0, 0, 3, 0), 3, 3),
    "snoozes": ((4, 0, 0, 0, 4), 8, 8),
    "slow_ok": ((6, 0, 0, 0, 0), 6, 6),
    "async_ok": ((7, 0, 0, 0, 0), 7, 7),
    "async_fails": ((0, 0, 2, 0, 0), 2, 2),
    scoreboard.OTHER: ((0, 0, 2, 0, 0), 0, 2),  # a kind with no handler, at its last attempt
}


def unfinished(db: psycopg.Connection[Any]) -> int:
    return count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state NOT IN ('discarded', 'cancelled')")


def test_every_outcome_is_counted_per_queue_and_kind_with_its_run_time_and_pickup(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    (masters.cwd / "fjoutcomes.py").write_text(textwrap.dedent(OUTCOMES_MODULE))
    for kind, (n, attempts) in ENQUEUED.items():
        app.enqueue_many(kind, ({"n": i} for i in range(n)), max_attempts=attempts)
    master = masters.start("--processes", "1", "--metrics-port", "0", module="fjoutcomes")
    port = metrics_port(master)
    wait_for(lambda: unfinished(db) == 0, "every job to finish")

    def counted() -> dict[str, float] | None:
        found = samples(scrape(port))
        done = sum(v for k, v in found.items() if k.startswith("fastjobs_job_outcomes_total{"))
        return found if done == sum(sum(outcomes) for outcomes, _, _ in EXPECTED.values()) else None

    found = wait_for(counted, "the outcomes to be counted")
    for kind, (outcomes, runs, claims) in EXPECTED.items():
        labels = f'queue="default",kind="{kind}"'
        got = tuple(int(found[f'fastjobs_job_outcomes_total{{{labels},outcome="{o}"}}']) for o in OUTCOMES)
        assert got == outcomes, kind
        assert found.get(f"fastjobs_job_run_seconds_count{{{labels}}}", 0) == runs, kind
        assert found.get(f'fastjobs_job_run_seconds_bucket{{{labels},le="+Inf"}}', 0) == runs, kind
        assert found[f"fastjobs_job_pickup_seconds_count{{{labels}}}"] == claims, kind
        assert found[f'fastjobs_job_pickup_seconds_bucket{{{labels},le="+Inf"}}'] == claims, kind
        # Cumulative buckets, a plausible sum: all waited less than the test ran.
        buckets = [
            v for k, v in found.items() if k.startswith(f"fastjobs_job_pickup_seconds_bucket{{{labels},")
        ]
        assert buckets == sorted(buckets) and len(buckets) == len(BUCKETS) + 1
        assert 0 <= found[f"fastjobs_job_pickup_seconds_sum{{{labels}}}"] < claims * 60
    assert "# TYPE fastjobs_job_run_seconds histogram" in scrape(port)

    # `fastjobs stats --json` reads the same counts from the stats file.
    doc = procs.stats_json(app.dsn)
    [mine] = [m for m in doc["masters"] if m["master_pid"] == master.pid]
    kinds = {k["kind"]: k for k in mine["kinds"]}
    assert set(kinds) == set(EXPECTED)
    for kind, (outcomes, runs, claims) in EXPECTED.items():
        assert tuple(kinds[kind]["outcomes"][o] for o in OUTCOMES) == outcomes, kind
        assert kinds[kind]["run_seconds"]["count"] == runs
        assert kinds[kind]["pickup_seconds"]["count"] == claims
        assert kinds[kind]["queue"] == "default"
    assert master.stop() == 0, master.stderr()


def host_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {h["host"]: h for h in doc["cluster"]}


def test_two_hosts_are_both_seen_with_their_counts_and_a_silent_one_is_flagged_stale(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """Two masters on one database posing as two hosts (--host-id): `fastjobs stats` shows both,
    each with what its workers ran; only the leader's metrics carry the cluster; a host whose
    worker stops heartbeating (SIGSTOP) is flagged stale while the other is not."""
    # A queue each, so that each host runs jobs (one worker could drain a shared queue alone).
    alpha = masters.start(
        "--processes", "1", "--host-id", "alpha", "--queues", "alpha", "--metrics-port", "0"
    )
    beta = masters.start(
        "--processes",
        "1",
        "--host-id",
        "beta",
        "--queues",
        "beta",
        "--metrics-port",
        "0",
        "--worker-timeout",
        "120",
    )
    ports = {"alpha": metrics_port(alpha), "beta": metrics_port(beta)}
    alpha.wait_child("fastjobs: worker 1 ")
    beta.wait_child("fastjobs: worker 1 ")
    for name in ("alpha", "beta"):
        app.enqueue_many("record", ({"n": n, "sleep": 0.002} for n in range(200)), queue=name)
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") == 400, "the drain", timeout=60)
    ran = dict(db.execute("SELECT pid, count(*) FROM runs GROUP BY pid").fetchall())

    def settled() -> dict[str, Any] | None:
        doc = procs.stats_json(app.dsn)
        hosts = host_of(doc)
        if set(hosts) != {"alpha", "beta"}:
            return None
        return doc if sum(h["totals"]["completed"] for h in hosts.values()) == 400 else None

    doc = wait_for(settled, "both hosts' heartbeats to carry 400 completions")
    for name, host in host_of(doc).items():
        [worker] = host["workers"]
        assert worker["id"].startswith(f"{name}:{worker['pid']}:")
        assert host["totals"]["completed"] == ran.get(worker["pid"], 0), name
        assert host["queues"] == [name] and host["stale"] == 0
        assert not worker["stale"] and worker["heartbeat_age"] < report.STALE_AFTER
        [row] = host["kinds"]
        assert (row["queue"], row["kind"], row["completed"]) == (
            name,
            "record",
            200,
        )
    assert set(ran) == {w["pid"] for h in doc["cluster"] for w in h["workers"]}  # both hosts ran jobs

    # The leader's master serves the cluster's series; the other master does not.
    def leader_scrapes() -> tuple[str, dict[str, float]] | None:
        bodies = {name: samples(scrape(port)) for name, port in ports.items()}
        leading = [n for n, b in bodies.items() if any(k.startswith("fastjobs_cluster_") for k in b)]
        return (leading[0], bodies[leading[0]]) if len(leading) == 1 else None

    leader, found = wait_for(leader_scrapes, "exactly one master to serve the cluster's series")
    for name, host in host_of(doc).items():
        assert found[f'fastjobs_cluster_workers{{host="{name}"}}'] == 1
        assert found[f'fastjobs_cluster_jobs_completed_total{{host="{name}"}}'] == host["totals"]["completed"]
        labels = f'host="{name}",queue="{name}",kind="record",outcome="completed"'
        assert found[f"fastjobs_cluster_job_outcomes_total{{{labels}}}"] == host["totals"]["completed"]

    # beta's worker falls silent: stopped, it heartbeats no more.
    [worker] = beta.titled("fastjobs: worker 1 ")
    os.kill(worker, signal.SIGSTOP)
    try:

        def beta_stale() -> dict[str, Any] | None:
            hosts = host_of(procs.stats_json(app.dsn))
            return hosts if hosts["beta"]["stale"] == 1 else None

        hosts = wait_for(beta_stale, "beta's worker to be flagged stale", timeout=report.STALE_AFTER + 10)
        assert hosts["alpha"]["stale"] == 0 and hosts["beta"]["rate"] == 0
        assert hosts["beta"]["workers"][0]["heartbeat_age"] > report.STALE_AFTER
        table = procs.cli(app.dsn, "stats")
        assert table.returncode == 0, table.stderr
        assert "cluster: 2 hosts" in table.stdout
        [line] = [line for line in table.stdout.splitlines() if line.strip().startswith("beta:")]
        assert line.endswith("STALE")
        found = samples(scrape(ports[leader]))
        assert found['fastjobs_cluster_workers_stale{host="beta"}'] == 1
        assert found['fastjobs_cluster_workers_stale{host="alpha"}'] == 0
    finally:
        os.kill(worker, signal.SIGCONT)
    assert alpha.stop() == 0, alpha.stderr()
    assert beta.stop() == 0, beta.stderr()
    assert procs.stats_json(app.dsn)["cluster"] == []  # a clean stop removes its workers' rows


def test_a_stats_file_of_another_format_is_skipped_naming_both_formats(tmp_path: Path) -> None:
    path = tmp_path / "fastjobs-1-old.stats"
    path.write_bytes(
        struct.pack("<IIII", scoreboard.MAGIC, 5, 1, 1).ljust(scoreboard.HEADER.size + 4096, b"\0")
    )
    found = scoreboard.read_master(path)
    assert isinstance(found, scoreboard.Skipped)
    assert found.reason == (
        f"written by another version of fastjobs (stats format 5; this one reads {scoreboard.VERSION})"
    )


def test_a_host_id_a_worker_id_cannot_carry_is_refused_before_the_application_is_imported(dsn: str) -> None:
    done = procs.cli(dsn, "run", "--host-id", "web:1", "no_such_module")
    assert done.returncode == EXIT_BOOT_ERROR  # what cannot start exits 3, as every command
    assert (
        "the host id must be at most 255 printable characters without spaces or ':', not 'web:1'"
        in done.stderr
    )
    assert "no_such_module" not in done.stderr


@pytest.mark.parametrize("core", [_core, _core_py], ids=["c", "python"])
def test_a_job_due_in_year_1_is_counted_in_the_last_bucket_and_sums_saturate(app: App, core: Any) -> None:
    """A run_at centuries back (year 1 is accepted) and a sum near its end: each observation is
    clamped and each sum saturates, on both loops, instead of overflowing an int64 cell (the
    Python loop raised, killing its worker; the C one wrapped)."""

    @app.job(kind="old")
    def old() -> None:
        pass

    app.enqueue("old", {}, run_at=dt.datetime(1, 1, 1, tzinfo=dt.UTC))
    app.enqueue("old", {})
    labels = scoreboard.Labels(list(app.jobs), [["default"]])
    counts = memoryview(bytearray(labels.rows * ROW * 8)).cast("q")
    [(at, _, _)] = [name for name in labels.names(0) if name[2] == "old"]
    counts[at + PICKUP_SUM] = INT64_MAX - 10
    executor = Executor()
    executor.bind()
    try:
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            loop = core.BatchLoop(
                conn, app.runnable(), executor, "w", ["default"], batch_min=2, batch_max=2, counts=counts
            )
            loop.prepare()
            while loop.step():
                pass
            loop.finish()
    finally:
        executor.close()
    assert counts[at + COMPLETED] == 2
    assert counts[at + PICKUP_SUM] == INT64_MAX
    pickup = counts[at + PICKUP_SUM + 1 : at + PICKUP_SUM + 2 + len(BUCKETS)]
    assert pickup[-1] == 1 and sum(pickup) == 2  # year 1 in +Inf, today's in a small bucket


@pytest.mark.parametrize("core", [_core, _core_py], ids=["c", "python"])
def test_a_counts_view_shorter_than_the_plan_is_refused(app: App, core: Any) -> None:
    @app.job(kind="k")
    def k() -> None:
        pass

    labels = scoreboard.Labels(list(app.jobs), [["default"]])
    short = memoryview(bytearray((labels.rows * ROW - 1) * 8)).cast("q")
    with (
        psycopg.connect(app.dsn, autocommit=True) as conn,
        pytest.raises(ValueError, match="counts view holds"),
    ):
        core.BatchLoop(conn, app.runnable(), Executor(), "w", ["default"], counts=short)
