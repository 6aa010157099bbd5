"""`fastjobs stats` and the metrics endpoint against a live master: they report what ran."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App
from fastjobs.stats import LEADER, WORKER

from . import procs
from .procs import count, wait_for


@pytest.fixture
def masters(tmp_path: Path, dsn: str) -> Iterator[procs.Masters]:
    procs.create_runs_table(dsn)
    with procs.Masters(tmp_path, dsn) as m:
        yield m


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def runs_by_pid(db: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(db.execute("SELECT pid, count(*) FROM runs GROUP BY pid").fetchall())


def drained_master(masters: procs.Masters, app: App, db: psycopg.Connection[Any], *args: str) -> procs.Master:
    """A master of 2 workers serving only `default` that ran 120 jobs; 3 more wait in `emails`."""
    app.enqueue_many("record", ({"n": n} for n in range(100)))
    app.enqueue_many("record", ({"n": n} for n in range(3)), queue="emails")
    master = masters.start("--processes", "2", "--queues", "default", *args)
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") >= 50, "50 executions")
    app.enqueue_many("record", ({"n": n} for n in range(100, 120)))
    wait_for(
        lambda: count(db, "SELECT count(*) FROM fastjobs_jobs WHERE queue = 'default'") == 0, "the drain"
    )
    assert count(db, "SELECT count(*) FROM runs") == 120
    return master


def test_stats_json_lists_the_live_processes_with_what_they_ran(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    master = drained_master(masters, app, db)
    ran = runs_by_pid(db)

    # A worker publishes its completions with its next statement, so wait for the counts to settle.
    def settled() -> dict[str, Any] | None:
        doc = procs.stats_json(app.dsn)
        mine = [m for m in doc["masters"] if m["master_pid"] == master.pid]
        if mine and sum(p["completed"] for p in mine[0]["processes"]) == 120:
            return doc
        return None

    doc = wait_for(settled, "the shared-memory counters to reach 120 completed")
    processes = next(m for m in doc["masters"] if m["master_pid"] == master.pid)["processes"]
    assert sorted(int(p["pid"]) for p in processes) == master.children()
    assert sorted((int(p["role"]), int(p["index"])) for p in processes) == [
        (WORKER, 0),
        (WORKER, 1),
        (LEADER, 2),
    ]
    for p in processes:
        assert p["completed"] == ran.get(int(p["pid"]), 0), (p, ran)
        assert p["failed"] == p["retried"] == p["discarded"] == 0
        assert p["heartbeat"] >= p["started"] > 0
    assert [(q["queue"], q["state"], q["count"]) for q in doc["queues"]] == [("emails", "available", 3)]
    assert doc["queues"][0]["oldest_seconds"] >= 0

    human = procs.cli(app.dsn, "stats")
    assert human.returncode == 0, human.stderr
    assert re.search(r"emails\s+available\s+3", human.stdout), human.stdout
    assert f"master pid {master.pid} on this host" in human.stdout
    for p in processes:
        if p["role"] == WORKER:
            line = rf"worker {int(p['index']) + 1}\s+{int(p['pid'])}\s+[\d,]+\s+{int(p['completed'])}\s"
            assert re.search(line, human.stdout), human.stdout
    assert master.stop() == 0, master.stderr()

    after = procs.stats_json(app.dsn)
    assert master.pid not in [m["master_pid"] for m in after["masters"]]
    assert not Path(f"/dev/shm/fastjobs-{master.pid}.stats").exists()


def test_stats_without_a_master(app: App) -> None:
    app.enqueue_many("record", ({"n": n} for n in range(5)))
    app.enqueue("record", {"n": 5}, queue="emails", delay=3600)
    human = procs.cli(app.dsn, "stats")
    assert human.returncode == 0, human.stderr
    assert re.search(r"queue\s+state\s+jobs\s+oldest", human.stdout)
    assert re.search(r"default\s+available\s+5\s+[\d.,]+s", human.stdout), human.stdout
    assert re.search(r"emails\s+scheduled\s+1\s", human.stdout), human.stdout
    doc = procs.stats_json(app.dsn)
    assert [(q["queue"], q["state"], q["count"]) for q in doc["queues"]] == [
        ("default", "available", 5),
        ("emails", "scheduled", 1),
    ]


def test_stats_of_an_empty_database(dsn: str) -> None:
    human = procs.cli(dsn, "stats")
    assert human.returncode == 0, human.stderr
    assert "(no jobs)" in human.stdout
    assert procs.stats_json(dsn)["queues"] == []


def test_stats_without_the_schema_says_to_migrate(empty_dsn: str) -> None:
    result = procs.cli(empty_dsn, "stats", "--json")
    assert result.returncode != 0
    assert "fastjobs migrate" in result.stderr
    assert "Traceback" not in result.stderr


def samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}, checking every line's shape."""
    found = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) fastjobs_\w+ .+|# .+", line), line
            continue
        match = re.fullmatch(r"(fastjobs_\w+(?:\{[^}]*\})?) (-?[\d.]+(?:e[-+]?\d+)?)", line)
        assert match, f"not a Prometheus sample: {line!r}"
        found[match[1]] = float(match[2])
    return found


def test_metrics_endpoint_serves_prometheus_text_of_what_ran(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    # Port 0: the kernel picks a free port, and the master prints the one it got.
    master = drained_master(masters, app, db, "--metrics-port", "0")
    port = int(master.wait_stderr(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body: str = response.read().decode()
            return body

    def settled() -> dict[str, float] | None:
        found = samples(scrape())
        done = sum(v for k, v in found.items() if k.startswith("fastjobs_jobs_completed_total{"))
        return found if done == 120 else None

    found = wait_for(settled, "fastjobs_jobs_completed_total to reach 120")
    text = scrape()
    assert "# TYPE fastjobs_jobs_completed_total counter" in text
    assert "# TYPE fastjobs_queue_jobs gauge" in text
    ran = runs_by_pid(db)
    pids = dict(
        zip(
            ("0", "1"),
            master.titled("fastjobs: worker 1 ") + master.titled("fastjobs: worker 2 "),
            strict=True,
        )
    )
    for index, pid in pids.items():
        assert found[f'fastjobs_jobs_completed_total{{role="worker",index="{index}"}}'] == ran.get(pid, 0)
    assert found['fastjobs_jobs_failed_total{role="worker",index="0"}'] == 0
    assert 'fastjobs_jobs_completed_total{role="leader",index="2"}' in found
    assert found['fastjobs_queue_jobs{queue="emails",state="available"}'] == 3
    assert found['fastjobs_queue_oldest_seconds{queue="emails",state="available"}'] >= 0
    assert not [k for k in found if 'queue="default"' in k]
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=10)
    assert missing.value.code == 404
    missing.value.close()
    assert master.stop() == 0, master.stderr()
