"""`fastjobs stats` and the metrics endpoint against a live master: they report what ran."""

from __future__ import annotations

import re
import time
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


def emails_age(db: psycopg.Connection[Any]) -> float:
    """Seconds since the oldest job of `emails` became due, by the database's clock."""
    row = db.execute(
        "SELECT extract(epoch FROM now() - min(run_at))::float8 FROM fastjobs_jobs WHERE queue = 'emails'"
    ).fetchone()
    assert row is not None
    return float(row[0])


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
    # Waiting since they were enqueued, before the master started: older than a drain, younger than now.
    assert 0.1 < doc["queues"][0]["oldest_seconds"] <= emails_age(db)

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
    assert 0.1 < found['fastjobs_queue_oldest_seconds{queue="emails",state="available"}'] <= emails_age(db)
    assert not [k for k in found if 'queue="default"' in k]
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=10)
    assert missing.value.code == 404
    missing.value.close()
    assert master.stop() == 0, master.stderr()


def test_a_transaction_holding_back_cleanup_is_named_and_warned_about(
    app: App, db: psycopg.Connection[Any]
) -> None:
    quiet = procs.stats_json(app.dsn)
    assert quiet["warnings"] == []
    assert quiet["health"]["horizon"] is None
    with psycopg.connect(app.dsn, application_name="long-report") as holder:
        holder.execute("SELECT txid_current()")  # a snapshot and an xid, kept until the rollback
        holder_pid = holder.info.backend_pid
        doc = procs.stats_json(app.dsn, "--horizon-warning", "0")
        horizon = doc["health"]["horizon"]
        assert (horizon["source"], horizon["ident"]) == ("backend", str(holder_pid))
        assert horizon["seconds"] > 0 and horizon["xid_age"] >= 1
        assert "long-report" in horizon["detail"] and "idle in transaction" in horizon["detail"]
        [warning] = doc["warnings"]
        assert re.search(rf"pinned for \d+s by backend {holder_pid} \(long-report, idle in tr", warning)
        human = procs.cli(app.dsn, "stats", "--horizon-warning", "0")
        assert human.returncode == 0, human.stderr
        assert re.search(
            rf"oldest snapshot: backend {holder_pid}, open [\d.,]+s, [\d,]+ xids old", human.stdout
        ), human.stdout
        assert re.search(rf"\nWARNING: cleanup horizon pinned for \d+s by backend {holder_pid}", human.stdout)
        # Under the default threshold (60 s) a young transaction is no news.
        assert procs.stats_json(app.dsn)["warnings"] == []
        holder.rollback()
    assert procs.stats_json(app.dsn, "--horizon-warning", "0")["health"]["horizon"] is None


def test_dead_rows_and_vacuums_of_the_fastjobs_tables(app: App, db: psycopg.Connection[Any]) -> None:
    db.execute("ALTER TABLE fastjobs_jobs SET (autovacuum_enabled = off)")
    # One session for both, so its counts reach the statistics in order (the
    # estimate of live rows is inserts minus deletes as they arrive).
    app.enqueue_many("record", ({"n": n} for n in range(500)), conn=db)
    db.execute("DELETE FROM fastjobs_jobs WHERE (args->>'n')::int < 300")
    db.execute("SELECT pg_stat_force_next_flush()")

    def jobs_table() -> dict[str, Any] | None:
        tables = {t["table"]: t for t in procs.stats_json(app.dsn)["health"]["tables"]}
        assert {"fastjobs_jobs", "fastjobs_workers", "fastjobs_periodic"} <= set(tables)
        table: dict[str, Any] = tables["fastjobs_jobs"]
        return table if (table["live"], table["dead"]) == (200, 300) else None

    table = wait_for(jobs_table, "200 live and 300 dead rows in the statistics")
    assert table["table_bytes"] > 0 and table["index_bytes"] > 0
    assert table["last_vacuum"] is None
    db.execute("VACUUM fastjobs_jobs")
    db.execute("SELECT pg_stat_force_next_flush()")

    def vacuumed() -> dict[str, Any] | None:
        [table] = [t for t in procs.stats_json(app.dsn)["health"]["tables"] if t["table"] == "fastjobs_jobs"]
        return table if table["dead"] == 0 else None

    assert wait_for(vacuumed, "the vacuum in the statistics")["last_vacuum"] is not None
    human = procs.cli(app.dsn, "stats").stdout
    row = r"fastjobs_jobs\s+200\s+0\s+[\d.]+ kB\s+[\d.]+ kB  \d+s ago \(0 autovacuums\)"
    assert re.search(row, human), human


def test_listener_health_is_reported_and_a_killed_listener_comes_back(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    master = masters.start("--processes", "1", "--metrics-port", "0")
    port = int(master.wait_stderr(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])

    def worker() -> dict[str, Any] | None:
        [m] = [m for m in procs.stats_json(app.dsn)["masters"] if m["master_pid"] == master.pid]
        found = [p for p in m["processes"] if p["role"] == WORKER]
        return found[0] if found and found[0]["listening"] == 1 else None

    up = wait_for(worker, "the worker's listener to report")
    assert up["listener_reconnects"] == 0 and up["listener_ok"] > 0
    listeners = [
        pid
        for (pid,) in db.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND query IN ('LISTEN fastjobs_ping', %s)",
            ("SELECT pg_notify('fastjobs_ping', $1)",),
        )
    ]
    assert len(listeners) == 1
    db.execute("SELECT pg_terminate_backend(%s)", listeners)
    back = wait_for(lambda: (w := worker()) and w["listener_reconnects"] >= 1 and w, "the listener back")
    assert back["listener_ok"] > up["listener_ok"]
    assert "listener connection lost; reconnecting" in master.stderr()
    human = procs.cli(app.dsn, "stats").stdout
    ours = human.split(f"master pid {master.pid} on this host")[1].split("\n\n")[0]
    assert re.search(r"\nworker 1 .*  up, ping ok \d+s ago, 1 reconnects", ours), human
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        found = samples(response.read().decode())
    assert found['fastjobs_listener_up{role="worker",index="0"}'] == 1
    assert found['fastjobs_listener_reconnects_total{role="worker",index="0"}'] == 1
    assert 'fastjobs_listener_up{role="leader",index="1"}' not in found
    # A snapshot held open shows as the horizon's age, as long as it has been open.
    with psycopg.connect(app.dsn) as held:
        held.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        held.execute("SELECT 1")
        opened = time.monotonic()

        def horizon() -> float | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                age = samples(response.read().decode())["fastjobs_mvcc_horizon_age_seconds"]
            return age if age >= 0.3 else None

        age = wait_for(horizon, "the held snapshot as the horizon", timeout=10)
        assert age <= time.monotonic() - opened + 0.05
    assert found["fastjobs_notify_queue_usage_ratio"] == 0
    assert found['fastjobs_table_bytes{table="fastjobs_jobs",part="indexes"}'] > 0
    assert 'fastjobs_table_dead_rows{table="fastjobs_jobs"}' in found
    assert master.stop() == 0, master.stderr()
