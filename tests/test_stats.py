"""`fastjobs stats` and the metrics endpoint against a live master: they report what ran."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App, exposition, report, sql, stats
from fastjobs.scoreboard import Scoreboard, shm_dir
from fastjobs.stats import LEADER, WORKER

from . import procs
from .conftest import _create_database, _drop_database
from .procs import count, wait_for


def runs_by_pid(db: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(db.execute("SELECT pid, count(*) FROM runs GROUP BY pid").fetchall())


def emails_age(db: psycopg.Connection[Any]) -> float:
    """Seconds since the oldest job of `emails` became due, by the database's clock."""
    row = db.execute(
        "SELECT extract(epoch FROM now() - min(run_at))::float8 FROM fastjobs_jobs_all WHERE queue = 'emails'"
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
        lambda: count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE queue = 'default'") == 0, "the drain"
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
    assert not list(shm_dir().glob(f"fastjobs-{master.pid}-*.stats"))


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
    assert not [k for k in found if k.startswith("fastjobs_queue_") and 'queue="default"' in k]
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


def test_the_query_of_the_oldest_snapshot_is_printed_on_its_line(
    app: App, db: psycopg.Connection[Any]
) -> None:
    """A multi-line query (a CTE as written in an application) holding the horizon is shown as one
    line, its control characters escaped: `fastjobs stats` keeps one line per fact."""
    with psycopg.connect(app.dsn, application_name="report") as holder:
        holder.execute("WITH t AS (\n  SELECT txid_current() AS x\n)\nSELECT x, '\x1b[31m' FROM t")
        human = procs.cli(app.dsn, "stats", "--horizon-warning", "0")
        assert human.returncode == 0, human.stderr
        [line] = [line for line in human.stdout.splitlines() if line.startswith("oldest snapshot:")]
        query = "WITH t AS ( SELECT txid_current() AS x ) SELECT x, '\\x1b[31m' FROM t"
        assert line.endswith(f"(report, idle in transaction, {query})"), line
        assert "\x1b" not in human.stdout
        [warning] = [
            line for line in human.stdout.splitlines() if line.startswith("WARNING: cleanup horizon")
        ]
        assert "WITH t AS ( SELECT txid_current() AS x ) SELECT" in warning
        holder.rollback()
    assert procs.stats_json(app.dsn, "--horizon-warning", "0")["health"]["horizon"] is None


def test_dead_rows_and_vacuums_of_the_fastjobs_tables(app: App, db: psycopg.Connection[Any]) -> None:
    # The jobs go to the current rotating slot, fastjobs_jobs_1 (never autovacuumed).
    db.execute("ALTER TABLE fastjobs_jobs SET (autovacuum_enabled = off)")
    # One session for both, so its counts reach the statistics in order (the
    # estimate of live rows is inserts minus deletes as they arrive).
    app.enqueue_many("record", ({"n": n} for n in range(500)), conn=db)
    db.execute("DELETE FROM fastjobs_jobs_all WHERE (args->>'n')::int < 300")
    db.execute("SELECT pg_stat_force_next_flush()")

    def jobs_table() -> dict[str, Any] | None:
        tables = {t["table"]: t for t in procs.stats_json(app.dsn)["health"]["tables"]}
        assert {"fastjobs_jobs", "fastjobs_jobs_1", "fastjobs_workers", "fastjobs_periodic"} <= set(tables)
        table: dict[str, Any] = tables["fastjobs_jobs_1"]
        return table if (table["live"], table["dead"]) == (200, 300) else None

    table = wait_for(jobs_table, "200 live and 300 dead rows in the statistics")
    assert table["table_bytes"] > 0 and table["index_bytes"] > 0
    assert table["last_vacuum"] is None
    db.execute("VACUUM fastjobs_jobs_1")
    db.execute("SELECT pg_stat_force_next_flush()")

    def vacuumed() -> dict[str, Any] | None:
        [table] = [
            t for t in procs.stats_json(app.dsn)["health"]["tables"] if t["table"] == "fastjobs_jobs_1"
        ]
        return table if table["dead"] == 0 else None

    assert wait_for(vacuumed, "the vacuum in the statistics")["last_vacuum"] is not None
    human = procs.cli(app.dsn, "stats").stdout
    row = r"fastjobs_jobs_1\s+200\s+0\s+[\d.]+ kB\s+[\d.]+ kB  \d+s ago \(0 autovacuums\)"
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
    # The NOTIFY queue is the server's, shared with every other database on it: a page
    # of another session's pending notifications shows here. Below the warning level.
    assert 0 <= found["fastjobs_notify_queue_usage_ratio"] < 0.05
    assert found['fastjobs_table_bytes{table="fastjobs_jobs",part="indexes"}'] > 0
    assert 'fastjobs_table_dead_rows{table="fastjobs_jobs"}' in found
    assert master.stop() == 0, master.stderr()


def stats_files(master_pid: int) -> list[Path]:
    """The stats files named after `master_pid` (today's naming and the old one)."""
    return sorted(shm_dir().glob(f"fastjobs-{master_pid}-*.stats")) + sorted(
        shm_dir().glob(f"fastjobs-{master_pid}.stats")
    )


def test_a_master_that_cannot_bind_its_metrics_port_exits_and_leaves_no_stats_file(
    masters: procs.Masters, app: App
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        master = masters.start("--processes", "1", "--metrics-port", str(port))
        assert master.wait(15) != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in master.stderr(), master.stderr()
    assert "Traceback" not in master.stderr()
    assert len(master.forks()) <= 1, "a worker or the leader was started"  # the metrics process only
    assert stats_files(master.pid) == []


def test_a_killed_masters_file_is_told_from_a_live_master_with_its_pid_and_removed(
    masters: procs.Masters,
    app: App,
    db: psycopg.Connection[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A directory of the test's own: any `fastjobs stats` on the host removes a dead master's
    # file, and another test's, running beside this one (pytest -n), would come first.
    monkeypatch.setenv("FASTJOBS_STATS_DIR", str(tmp_path))
    master = masters.start("--processes", "1")
    wait_for(
        lambda: master.pid in [m["master_pid"] for m in procs.stats_json(app.dsn)["masters"]],
        "the master in `fastjobs stats`",
    )
    [path] = stats_files(master.pid)
    runs = count(db, "SELECT count(*) FROM runs")
    app.enqueue("hang", {"n": 1})  # its worker outlives the master until SIGKILL
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") == runs + 1, "the hung job to start")
    worker = master.wait_child("fastjobs: worker 1 ")
    os.kill(master.pid, signal.SIGKILL)
    master.wait()
    assert procs.alive(worker)  # an orphan holds what it inherited: not the master's lock
    # Its pid is taken by a live process now: this test's own.
    with path.open("r+b") as fh:
        fh.seek(12)  # magic, version, cards, then the master's pid
        fh.write(struct.pack("<I", os.getpid()))
    result = procs.cli(app.dsn, "stats", "--json")
    assert result.returncode == 0, result.stderr
    assert os.getpid() not in [m["master_pid"] for m in json.loads(result.stdout)["masters"]]
    assert not path.exists()
    assert f"skipped {path}: its master is gone (removed)" in result.stderr, result.stderr


def test_a_stats_directory_the_master_cannot_write_stops_it_at_start_with_a_message(
    masters: procs.Masters, app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing"
    monkeypatch.setenv("FASTJOBS_STATS_DIR", str(missing))
    master = masters.start("--processes", "1")
    assert master.wait(15) != 0
    assert f"cannot create the stats file in {missing}" in master.stderr(), master.stderr()
    assert "FASTJOBS_STATS_DIR" in master.stderr() and "Traceback" not in master.stderr()
    assert len(master.forks()) <= 1, "a worker or the leader was started"


UNSHARE_PID = ("unshare", "--pid", "--fork")


def test_masters_in_separate_pid_namespaces_sharing_dev_shm_keep_apart(
    masters: procs.Masters, app: App
) -> None:
    if subprocess.run([*UNSHARE_PID, "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not permitted here")
    one = masters.start("--processes", "1", wrapper=UNSHARE_PID)
    two = masters.start("--processes", "2", wrapper=UNSHARE_PID)

    def both() -> list[dict[str, Any]] | None:
        found = procs.stats_json(app.dsn)["masters"]
        return found if sorted(len(m["processes"]) for m in found) == [2, 3] else None

    found = wait_for(both, "both masters, each with its own processes", timeout=15)
    assert [m["master_pid"] for m in found] == [1, 1]  # each is pid 1 of its namespace
    assert len({m["file"] for m in found}) == 2
    for master in (one, two):
        [pid] = master.children()  # the master, under unshare
        os.kill(pid, signal.SIGTERM)
        assert master.wait() == 0, master.stderr()
        assert "Bus error" not in master.stderr() and "SIGBUS" not in master.stderr()
    assert not [m["file"] for m in found if Path(m["file"]).exists()]


# Run inside a mount namespace with a /dev/shm of its own, so no other
# `fastjobs stats` on this host meets these files.
GARBAGE = """
import fcntl, json, os, struct, subprocess, sys
from fastjobs import scoreboard, stats

shm = scoreboard.shm_dir()
header = struct.pack("<IIII", scoreboard.MAGIC, scoreboard.VERSION, 3, 1)
valid_header = header.ljust(scoreboard.HEADER.size, b"\\0")
planted = {
    "fastjobs-1-truncated.stats": valid_header,  # a header for 3 cards, and no cards
    "fastjobs-1.stats": valid_header,
    "fastjobs-2-foreign.stats": b"not ours",
}
for name, data in planted.items():
    (shm / name).write_bytes(data)
os.symlink("/etc/hostname", shm / "fastjobs-3-link.stats")
os.mkfifo(shm / "fastjobs-4-fifo.stats")
os.mkdir(shm / "fastjobs-5-dir.stats")
# A complete file anyone may read, held by a live "master" (this script), of no database.
readable = shm / "fastjobs-6-readable.stats"
readable.write_bytes(valid_header.ljust(scoreboard.HEADER.size + 3 * stats.CARD_FLOATS * 8, b"\\0"))
readable.chmod(0o644)
held = os.open(readable, os.O_RDONLY)
fcntl.flock(held, fcntl.LOCK_EX)
names = sorted(os.listdir(shm))


def stats_of(*user):
    try:
        done = subprocess.run(
            [*user, sys.executable, "-m", "fastjobs.cli", "--dsn", sys.argv[1], "stats", "--json"],
            capture_output=True, text=True, timeout=15,
        )
    except subprocess.TimeoutExpired:
        return {"rc": "timed out", "stdout": "", "stderr": ""}
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


result = stats_of()
# Another user's view of the same files (what `fastjobs stats` reads, without its database part).
listing = (
    "import json; from fastjobs import scoreboard; found, skipped = scoreboard.live_masters();"
    "print(json.dumps([[str(m.path) for m in found], [[str(s.path), s.reason] for s in skipped]]))"
)
nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", listing]
done = subprocess.run(nobody, capture_output=True, text=True, timeout=15)
result["other_user"] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
result["planted"] = [str(shm / name) for name in names]
result["left"] = sorted(os.listdir(shm))
print(json.dumps(result))
"""


def test_truncated_and_foreign_files_in_dev_shm_are_skipped_with_a_note(tmp_path: Path, dsn: str) -> None:
    private_shm = [
        "unshare",
        "--mount",
        "sh",
        "-c",
        'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"',
    ]
    if subprocess.run([*private_shm, "sh", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("cannot give a process a /dev/shm of its own here")
    script = tmp_path / "garbage.py"
    script.write_text(GARBAGE)
    done = subprocess.run(
        [*private_shm, "sh", sys.executable, str(script), dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["rc"] == 0, result["stderr"]
    assert json.loads(result["stdout"])["masters"] == []
    assert "Traceback" not in result["stderr"]
    readable = next(p for p in result["planted"] if p.endswith("-readable.stats"))
    for path in result["planted"]:
        if path != readable:  # live (locked), of another database: not listed, no note
            assert f"skipped {path}: " in result["stderr"], (path, result["stderr"])
    # Another user reads none of root's files, not even one it may open.
    other = result["other_user"]
    assert other["rc"] == 0, other["stderr"]
    found, skipped = json.loads(other["stdout"])
    assert found == []
    assert [readable, "owned by uid 0, not this user"] in skipped, skipped
    assert result["left"] == sorted(Path(p).name for p in result["planted"])  # nothing of others removed


def test_the_stats_file_is_new_owner_only_and_never_opened_through_a_planted_link(tmp_path: Path) -> None:
    board = Scoreboard.create(1)
    try:
        info = os.stat(board.path)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        assert stat.S_ISREG(os.lstat(board.path).st_mode)
    finally:
        board.close(unlink=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports by its exit code)
        code = 9
        try:
            os.read(ready_r, 1)
            secrets.token_hex = lambda nbytes=None: "deadbeefdeadbeef"
            Scoreboard.create(2)
            code = 0
        except FileExistsError:
            code = 7
        finally:
            os._exit(code)
    links = [shm_dir() / f"fastjobs-{pid}.stats", shm_dir() / f"fastjobs-{pid}-deadbeefdeadbeef.stats"]
    try:
        for link in links:
            link.symlink_to(victim)
        os.write(ready_w, b"x")
        _, status = os.waitpid(pid, 0)
    finally:
        for link in links:
            link.unlink(missing_ok=True)
        os.close(ready_r)
        os.close(ready_w)
    assert victim.read_bytes() == b"precious"
    assert os.waitstatus_to_exitcode(status) == 7


def test_stats_lists_only_the_masters_of_its_database_unless_asked_for_all(
    masters: procs.Masters, app: App, template_db: str
) -> None:
    name = f"fastjobs_o_{os.getpid()}"
    other = _create_database(name, template_db)
    try:
        procs.create_runs_table(other)
        mine = masters.start("--processes", "1")
        theirs = masters.start("--processes", "1", dsn=other)

        def listed() -> dict[str, Any] | None:
            doc = procs.stats_json(app.dsn, "--all-masters")
            pids = {m["master_pid"] for m in doc["masters"]}
            return doc if {mine.pid, theirs.pid} <= pids else None

        everyone = wait_for(listed, "both masters with --all-masters")
        by_pid = {m["master_pid"]: m for m in everyone["masters"]}
        assert by_pid[mine.pid]["database"] != by_pid[theirs.pid]["database"]
        assert [m["master_pid"] for m in procs.stats_json(app.dsn)["masters"]] == [mine.pid]
        assert [m["master_pid"] for m in procs.stats_json(other)["masters"]] == [theirs.pid]
        human = procs.cli(app.dsn, "stats", "--all-masters").stdout
        assert (by_pid[mine.pid]["this_database"], by_pid[theirs.pid]["this_database"]) == (True, False)
        assert everyone["masters"][0]["master_pid"] == mine.pid  # this database's first
        assert f"master pid {mine.pid} on this host\n" in human
        other_db = by_pid[theirs.pid]["database"]
        assert f"master pid {theirs.pid} on this host (ANOTHER DATABASE: {other_db})\n" in human
        assert human.index(f"master pid {mine.pid} ") < human.index(f"master pid {theirs.pid} ")
        assert mine.stop() == 0 and theirs.stop() == 0
    finally:
        _drop_database(name)


def test_the_leaders_vacuums_are_exported_when_autovacuum_is_off(db: psycopg.Connection[Any]) -> None:
    db.execute("ALTER TABLE fastjobs_jobs SET (autovacuum_enabled = off)")
    before = time.time()
    with psycopg.RawCursor(db) as cur:
        cur.execute(sql.vacuum_jobs)  # the leader's VACUUM
    db.execute("SELECT pg_stat_force_next_flush()")

    def vacuumed() -> report.Health | None:
        found = report.health(db)
        [jobs] = [t for t in found.tables if t.table == "fastjobs_jobs"]
        return found if jobs.last_vacuum is not None else None

    found_health = wait_for(vacuumed, "the VACUUM in the statistics")
    board = Scoreboard.create(1)
    try:
        text = exposition.prometheus(board, report.queue_depths(db), found_health)
    finally:
        board.close(unlink=True)
    found = samples(text)
    assert "# TYPE fastjobs_table_last_vacuum_timestamp_seconds gauge" in text
    last = found['fastjobs_table_last_vacuum_timestamp_seconds{table="fastjobs_jobs"}']
    assert before - 1 <= last <= time.time() + 1
    assert found['fastjobs_table_last_autovacuum_timestamp_seconds{table="fastjobs_jobs"}'] == 0


def worker_card(dsn: str, master_pid: int) -> dict[str, Any] | None:
    """The first worker of master `master_pid` as `stats --json` shows it (None: not listed yet)."""
    for m in procs.stats_json(dsn)["masters"]:
        if m["master_pid"] == master_pid:
            return next((p for p in m["processes"] if p["role"] == WORKER), None)
    return None


def test_the_listener_state_is_true_while_the_worker_is_busy(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    # Work waits before the master starts: its worker is busy from the first claim and never sleeps
    # on its listener (which `stats` used to show as DOWN until the worker was idle).
    app.enqueue_many("record", ({"n": n, "sleep": 0.05} for n in range(600)))
    master = masters.start("--processes", "1", "--batch-max", "4")
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") >= 1, "the drain to start")
    busy = wait_for(lambda: worker_card(app.dsn, master.pid), "the worker in `fastjobs stats`")
    assert count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'available'") > 0, "no longer busy"
    assert (busy["listening"], busy["listener_reconnects"]) == (1, 0)
    assert busy["listener_ok"] > 0

    # Its listener dies while it drains: `stats` says so then, not once the queue is empty.
    [listener] = db.execute(
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'LISTEN fastjobs_ping'"
    ).fetchall()
    db.execute("SELECT pg_terminate_backend(%s)", listener)
    down = wait_for(
        lambda: (w := worker_card(app.dsn, master.pid)) and w["listening"] == 0 and w, "the listener down"
    )
    assert down["listener_reconnects"] == 1
    human = procs.cli(app.dsn, "stats").stdout
    assert count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'available'") > 0, "no longer busy"
    assert re.search(r"\nworker 1 .*  DOWN \(polling\), 1 reconnects\n", human), human
    # Idle, it makes its listener again.
    db.execute("DELETE FROM fastjobs_jobs_all WHERE state = 'available'")
    back = wait_for(
        lambda: (w := worker_card(app.dsn, master.pid)) and w["listening"] == 1 and w, "the listener back"
    )
    assert back["listener_reconnects"] == 1 and back["listener_ok"] > busy["listener_ok"]
    assert master.stop() == 0, master.stderr()


def test_stats_json_gives_whole_numbers_as_integers_and_tables_keep_wide_values_apart(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    wide = "q" * 60
    app.enqueue_many("record", ({"n": n} for n in range(3)), queue=wide)
    master = masters.start("--processes", "1", "--queues", "default")
    card = wait_for(lambda: worker_card(app.dsn, master.pid), "the worker in `fastjobs stats`")
    raw = procs.cli(app.dsn, "stats", "--json").stdout
    assert not re.search(r'"(pid|role|index|completed|listener_reconnects)": -?\d+\.\d', raw), raw
    doc = json.loads(raw)
    [mine] = [m for m in doc["masters"] if m["master_pid"] == master.pid]
    assert mine["this_database"] is True and mine["database"] == doc["database"]
    for p in mine["processes"]:
        for name in stats.INTEGER_FIELDS:
            assert type(p[name]) is int, (name, p)
        assert type(p["heartbeat"]) is float and type(p["rate"]) is float
    assert card["pid"] in master.children()

    # Wide values: a 60-character queue, and table sizes past 1,000 kB beside a dead-row count.
    db.execute("ALTER TABLE fastjobs_jobs SET (autovacuum_enabled = off)")
    # Scheduled, so in slot 0 (fastjobs_jobs): the running leader truncates the rotating slots.
    app.enqueue_many(
        "record", ({"n": n, "pad": "x" * 100} for n in range(20_000)), queue="bulk", delay=3600, conn=db
    )
    db.execute("DELETE FROM fastjobs_jobs_all WHERE queue = 'bulk' AND (args->>'n')::int % 2 = 0")
    db.execute("SELECT pg_stat_force_next_flush()")
    wait_for(
        lambda: (
            next(t for t in procs.stats_json(app.dsn)["health"]["tables"] if t["table"] == "fastjobs_jobs")[
                "dead"
            ]
            >= 10_000
        ),
        "10,000 dead rows in the statistics",
    )
    human = procs.cli(app.dsn, "stats")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert re.search(rf"^{wide}  available  +3  +[\d.,]+s$", human.stdout, re.M), human.stdout
    [jobs_table] = [line for line in lines if line.startswith("fastjobs_jobs ")]
    # Each column is two spaces or more from the next, however wide: table, live, dead, two sizes, vacuum.
    fields = re.split(r"\s{2,}", jobs_table)
    assert len(fields) == 6, jobs_table
    assert re.fullmatch(r"1\d,\d{3}", fields[2]) and re.fullmatch(r"[\d,.]+ [kM]B", fields[3]), fields
    for header in ("queue", "process", "table"):
        [head] = [line for line in lines if line.startswith(f"{header} ")]
        block = lines[lines.index(head) : lines.index(head) + 3]
        columns = len(re.split(r"\s{2,}", head))
        assert all(len(re.split(r"\s{2,}", line.strip())) >= columns - 1 for line in block), block
    assert master.stop() == 0, master.stderr()


def test_stats_flags_pending_kinds_that_no_live_worker_handles(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastjobs import Worker
    from fastjobs.cli import main

    from .helpers import WorkerThread, insert_raw
    from .helpers import wait_for as wait_until

    @app.job(kind="known")
    def known() -> None: ...

    insert_raw(dsn, "known", "{}")
    stray = insert_raw(dsn, "gone.elsewhere", "{}")  # its handler lives in no module this worker imported
    insert_raw(dsn, "gone.elsewhere", "{}", queue="unserved")  # no live worker serves that queue
    with psycopg.connect(dsn, autocommit=True) as db, WorkerThread(Worker(app, ["default"])):
        assert wait_until(
            lambda: (
                count(db, "SELECT count(*) FROM fastjobs_workers WHERE counters ? 'handles'") == 1
                and count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = %s AND attempt = 1", stray)
                == 1
            ),
            timeout=10,
        )
        assert main(["--dsn", dsn, "stats", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["unhandled_kinds"] == [
            {"queue": "default", "kind": "gone.elsewhere", "pending": 1, "workers": 1}
        ]
        assert main(["--dsn", dsn, "stats"]) == 0
        out = capsys.readouterr().out
    assert (
        "WARNING: 1 pending job of kind 'gone.elsewhere' on queue 'default', and no live worker handles"
        " that kind" in out
    )
    assert "fastjobs jobs discard --kind gone.elsewhere" in out
