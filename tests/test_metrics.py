"""The metrics endpoint cannot hurt the master: idle connections, a locked table, a killed master."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from fastjobs import App

from . import procs
from .procs import wait_for
from .test_stats import samples


def metrics_port(master: procs.Master) -> int:
    return int(master.wait_stderr(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", timeout=15)[1])


def scrape(port: int, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        body: str = response.read().decode()
        return body


def listening_inode(port: int) -> int:
    """The inode of the socket listening on 127.0.0.1:`port` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
            return int(fields[9])
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def holders(pids: list[int], inode: int) -> list[int]:
    """Which of `pids` have the socket `inode` open."""
    found = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if f"socket:[{inode}]" in links:
            found.append(pid)
    return found


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_only_the_metrics_process_holds_the_port(masters: procs.Masters, app: App) -> None:
    master = masters.start("--processes", "2", "--metrics-port", "0")
    port = metrics_port(master)
    master.wait_child("fastjobs: worker 2 ")
    master.wait_child("fastjobs: leader")
    assert samples(scrape(port))
    # The listening socket is the metrics process's alone: no worker or leader
    # inherited it, and the master has no thread serving scrapes.
    [server] = holders(procs.group(master.pid), listening_inode(port))
    assert procs.title(server) == "fastjobs: metrics", procs.title(server)
    assert os.listdir(f"/proc/{master.pid}/task") == [str(master.pid)], "the master runs threads"
    assert master.stop() == 0, master.stderr()
    assert not procs.alive(server)


def test_idle_connections_cannot_starve_a_scrape_nor_exhaust_descriptors(
    masters: procs.Masters, app: App
) -> None:
    master = masters.start("--processes", "1", "--metrics-port", "0")
    port = metrics_port(master)
    master.wait_child("fastjobs: leader")
    assert samples(scrape(port))
    serving = holders(procs.group(master.pid), listening_inode(port))
    server = next((p for p in serving if procs.title(p) == "fastjobs: metrics"), master.pid)
    master_fds = fds(master.pid)
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        began = time.monotonic()
        found = samples(scrape(port, timeout=5))
        assert time.monotonic() - began < 2.0
        assert 'fastjobs_jobs_completed_total{role="worker",index="0"}' in found
        # The connections beyond the bound were closed, the oldest silent first.
        assert fds(server) <= 32 + 16, fds(server)
        assert fds(master.pid) <= master_fds + 2, fds(master.pid)
    finally:
        for sock in idle:
            sock.close()
    assert master.stop() == 0, master.stderr()


def test_a_scrape_under_a_lock_on_the_jobs_table_answers_in_time_and_leaves_no_backend_waiting(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    master = masters.start("--processes", "1", "--metrics-port", "0")
    port = metrics_port(master)
    wait_for(lambda: "# TYPE fastjobs_queue_jobs gauge" in scrape(port), "a scrape that read the database")
    with psycopg.connect(app.dsn) as holder:
        holder.execute("LOCK TABLE fastjobs_jobs IN ACCESS EXCLUSIVE MODE")
        bodies: list[str] = []
        errors: list[BaseException] = []

        def one() -> None:
            try:
                bodies.append(scrape(port, timeout=5))
            except BaseException as exc:
                errors.append(exc)

        began = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert time.monotonic() - began < 3.0

        def timed() -> str | None:
            began = time.monotonic()
            body = scrape(port, timeout=5)
            assert time.monotonic() - began < 1.5
            return body if samples(body)["fastjobs_scrape_database_ok"] == 0 else None

        # The last good read is reused for a second; then the database is tried, and given up on.
        body = wait_for(timed, "a scrape that says it answers without the database", timeout=3)
        found = samples(body)
        assert 'fastjobs_jobs_completed_total{role="worker",index="0"}' in found
        assert re.search(r"^# queue depths and MVCC health unavailable: the database is slow", body, re.M)
        assert "fastjobs_queue_jobs{" not in body
        # Its one connection, named for pg_stat_activity, gave up on the lock. (The leader's own
        # health check may wait there: not the endpoint's doing.)
        metrics = db.execute(
            "SELECT count(*), count(*) FILTER (WHERE wait_event_type = 'Lock') FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'fastjobs metrics'"
        ).fetchone()
        assert metrics == (1, 0)
        holder.rollback()
    app.enqueue("record", {"n": 1}, queue="elsewhere")

    def back() -> dict[str, float] | None:
        found = samples(scrape(port))
        return found if found.get("fastjobs_scrape_database_ok") == 1 else None

    found = wait_for(back, "the database's part back", timeout=5)
    assert found['fastjobs_queue_jobs{queue="elsewhere",state="available"}'] == 1
    assert master.stop() == 0, master.stderr()


def test_a_new_master_binds_the_metrics_port_of_a_killed_one_while_its_worker_lives(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    old = masters.start("--processes", "1", "--metrics-port", "0")
    port = metrics_port(old)
    app.enqueue("hang", {"n": 1})  # its worker outlives the master until SIGKILL
    wait_for(lambda: procs.count(db, "SELECT count(*) FROM runs") == 1, "the hung job to start")
    worker = old.wait_child("fastjobs: worker 1 ")
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    # The metrics process dies with its master at once (PR_SET_PDEATHSIG).
    wait_for(
        lambda: not [p for p in procs.group(old.pid) if procs.title(p) == "fastjobs: metrics"],
        "the old metrics process to die",
        timeout=2,
    )
    assert procs.alive(worker), "the orphan worker is still in its job"
    new = masters.start("--processes", "1", "--metrics-port", str(port))
    outcome = new.wait_stderr(r"metrics on http://127\.0\.0\.1:(\d+)/metrics|cannot serve metrics.*", 15)
    assert outcome[1] == str(port), new.stderr()
    assert samples(scrape(port))
    assert procs.alive(worker), "the test needs the orphan alive while the new master binds"
    assert new.stop() == 0, new.stderr()


def test_a_dead_metrics_process_is_restarted_on_the_same_port(masters: procs.Masters, app: App) -> None:
    master = masters.start("--processes", "1", "--metrics-port", "0")
    port = metrics_port(master)
    first = master.wait_child("fastjobs: metrics")
    os.kill(first, signal.SIGKILL)
    second = master.wait_child("fastjobs: metrics", exclude=(first,), timeout=5)
    assert wait_for(lambda: _scrapes(port), "a scrape of the restarted metrics process", timeout=5)
    assert "metrics process was killed by signal 9; restarting" in master.stderr()
    # A stop signal sent to the whole group leaves it serving until the master is done.
    os.kill(second, signal.SIGTERM)
    os.kill(second, signal.SIGINT)
    assert _scrapes(port)
    assert master.stop() == 0, master.stderr()
    assert not procs.alive(second)


def _scrapes(port: int) -> bool:
    try:
        return bool(samples(scrape(port, timeout=2)))
    except OSError:
        return False
