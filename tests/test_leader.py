"""The leader: advisory-lock election and failover, and its services called with a frozen clock.

Election tests run `Leader.run` in threads against one database and read the
truth from PostgreSQL (pg_locks: who holds the key; pg_stat_activity: who is
trying). The services (`schedule_once`, `rescue_once`, `clean_once`) are
called directly with a frozen `now` on rows written by SQL. Two tests run real
`fastjobs run` masters: rescue after kill -9 of a worker (slow: the default
settings take ~15-20 s), and a cron tick across a leader change between two
masters. Every wait is a bounded poll on state, never a fixed sleep.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from fastjobs import App, control
from fastjobs.errors import ConfigurationError
from fastjobs.leader import Leader, LeaderConfig
from fastjobs.maintenance import (
    CleanerConfig,
    RescuerConfig,
    SchedulerConfig,
    clean_once,
    rescue_once,
    schedule_once,
)
from fastjobs.sql import LEADER_LOCK_KEY, NOTIFY_CHANNEL
from fastjobs.vacuum import VacuumConfig, Vacuumer

from . import procs
from .helpers import query
from .procs import wait_for

NOW = dt.datetime(2030, 6, 3, 12, 0, tzinfo=dt.UTC)


def ago(seconds: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=seconds)


# --- rows written by SQL -----------------------------------------------------------------------


def add_job(dsn: str, **columns: Any) -> int:
    """Insert one job row with these columns (kind 'k' unless given); its id."""
    columns.setdefault("kind", "k")
    statement = pgsql.SQL("INSERT INTO fastjobs_jobs ({}) VALUES ({}) RETURNING id").format(
        pgsql.SQL(", ").join(map(pgsql.Identifier, columns)),
        pgsql.SQL(", ").join([pgsql.Placeholder()] * len(columns)),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(statement, list(columns.values())).fetchone()
    assert row is not None
    return int(row[0])


def add_jobs(dsn: str, count: int, **columns: Any) -> None:
    """`count` identical job rows in one statement."""
    columns.setdefault("kind", "k")
    statement = pgsql.SQL("INSERT INTO fastjobs_jobs ({}) SELECT {} FROM generate_series(1, %s)").format(
        pgsql.SQL(", ").join(map(pgsql.Identifier, columns)),
        pgsql.SQL(", ").join([pgsql.Placeholder()] * len(columns)),
    )
    query(dsn, statement.as_string(None), [*columns.values(), count])


def add_worker(dsn: str, worker_id: str, heartbeat_at: dt.datetime) -> None:
    query(
        dsn,
        "INSERT INTO fastjobs_workers (id, host, pid, queues, heartbeat_at)"
        " VALUES (%s, 'h', 1, '{default}', %s)",
        (worker_id, heartbeat_at),
    )


def row(dsn: str, job_id: int) -> dict[str, Any]:
    rows = query(dsn, "SELECT *, state::text AS state FROM fastjobs_jobs_all WHERE id = %s", (job_id,))
    assert rows, f"job {job_id} is gone"
    return rows[0]


def ids(dsn: str) -> list[int]:
    return [r["id"] for r in query(dsn, "SELECT id FROM fastjobs_jobs_all ORDER BY id")]


# --- election ----------------------------------------------------------------------------------


def lock_holders(dsn: str, key: int = LEADER_LOCK_KEY) -> list[int]:
    """Backend pids holding advisory lock `key` in this test's database.

    A bigint key is stored as classid (high 32 bits), objid (low 32 bits), objsubid 1.
    """
    return [
        r["pid"]
        for r in query(
            dsn,
            """SELECT pid FROM pg_locks
                WHERE locktype = 'advisory' AND granted AND objsubid = 1
                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND classid::int8 = %s AND objid::int8 = %s""",
            (key >> 32, key & 0xFFFFFFFF),
        )
    ]


def trying(dsn: str) -> dict[int, dt.datetime]:
    """Backends not holding an advisory lock whose last statement was the leader's attempt
    to take it: pid -> when that was sent."""
    rows = query(
        dsn,
        """SELECT pid, query_start FROM pg_stat_activity
            WHERE datname = current_database() AND pid <> pg_backend_pid()
              AND query LIKE 'SELECT pg_try_advisory_lock%%'
              AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)""",
    )
    return {r["pid"]: r["query_start"] for r in rows}


def next_attempt(dsn: str, pid: int, after: dt.datetime) -> dt.datetime:
    """Wait for backend `pid` to send its lock attempt again, after the one sent at `after`."""

    def attempted() -> dt.datetime | None:
        started = trying(dsn).get(pid)
        return started if started is not None and started > after else None

    return wait_for(attempted, f"backend {pid} to try the lock again", timeout=5)


class LeaderThread:
    """`Leader.run` in a background thread; stopped and joined on exit."""

    def __init__(self, app: App, config: LeaderConfig) -> None:
        self.leader = Leader(app, config)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.leader.run()
        except BaseException as exc:
            self.error = exc

    @property
    def leading(self) -> bool:
        return self.leader.leading

    def __enter__(self) -> LeaderThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leader.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the leader did not stop within 10 s of stop()"
        if self.error is not None and exc[0] is None:
            raise self.error


def sample_exclusive(a: LeaderThread, b: LeaderThread, samples: int = 200) -> int:
    """Read both `leading` flags `samples` times over ~1 s; the number of samples with a leader.

    Fails at the first sample where both report leading.
    """
    pause = threading.Event()
    led = 0
    for _ in range(samples):
        both = (a.leading, b.leading)
        assert both != (True, True), "two leaders at the same moment"
        led += any(both)
        pause.wait(0.005)
    return led


# Fast enough for tests: a non-leader retries every 0.2 s; a leader runs its
# scheduler (and so notices a dead connection) every 0.1 s.
FAST = LeaderConfig(retry_interval=0.2, scheduler=SchedulerConfig(interval=0.1))


def test_two_contending_leaders_exactly_one_holds_the_lock(app: App, dsn: str) -> None:
    with LeaderThread(app, FAST) as a, LeaderThread(app, FAST) as b:
        wait_for(lambda: a.leading or b.leading, "a leader")
        leader, other = (a, b) if a.leading else (b, a)
        holders = lock_holders(dsn)
        assert len(holders) == 1
        # The other is connected and keeps trying: its attempt is sent again and again.
        first_try = wait_for(lambda: trying(dsn), "the other leader's lock attempts")
        [(pid, started)] = first_try.items()
        assert pid != holders[0]
        next_attempt(dsn, pid, started)
        assert sample_exclusive(a, b) == 200
        assert (leader.leading, other.leading) == (True, False)
        assert lock_holders(dsn) == holders

        # The leader acts: a due scheduled job is promoted.
        job_id = add_job(dsn, state="scheduled", run_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        wait_for(lambda: row(dsn, job_id)["state"] == "available", "the leader's scheduler", timeout=5)
    assert lock_holders(dsn) == []  # stopped leaders release the lock


def test_terminating_the_leaders_backend_hands_over_within_a_bound(app: App, dsn: str) -> None:
    # The first leader waits 1 s before reconnecting, so the second (0.2 s) wins the handover.
    first_config = LeaderConfig(retry_interval=1.0, scheduler=SchedulerConfig(interval=0.1))
    with LeaderThread(app, first_config) as first:
        wait_for(lambda: first.leading, "the first leader")
        [doomed] = lock_holders(dsn)
        with LeaderThread(app, FAST) as second:
            wait_for(lambda: trying(dsn), "the second leader's lock attempts")
            assert sample_exclusive(first, second) == 200
            assert not second.leading

            query(dsn, "SELECT pg_terminate_backend(%s)", (doomed,))
            killed = time.monotonic()
            wait_for(lambda: second.leading, "the second leader to take over", timeout=10)
            failover = time.monotonic() - killed
            wait_for(lambda: not first.leading, "the first leader to step down", timeout=10)
            stepped_down = time.monotonic() - killed
            print(
                f"\nleader failover after pg_terminate_backend: {failover:.3f}s (retry_interval 0.2 s);"
                f" the old leader stepped down after {stepped_down:.3f}s"
            )
            # Bound: one retry_interval plus a lock attempt; documented generously.
            assert failover < 5.0
            assert stepped_down < 5.0

            [heir] = lock_holders(dsn)
            assert heir != doomed
            # The first reconnects and contends again, without taking the lock back.
            wait_for(lambda: any(pid != heir for pid in trying(dsn)), "the first leader to contend again")
            assert sample_exclusive(first, second) == 200
            assert (first.leading, second.leading) == (False, True)
            assert lock_holders(dsn) == [heir]

            # The new leader acts.
            job_id = add_job(dsn, state="scheduled", run_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
            wait_for(
                lambda: row(dsn, job_id)["state"] == "available", "the new leader's scheduler", timeout=5
            )


def test_a_stopped_leader_releases_the_lock_for_another_at_once(app: App, dsn: str) -> None:
    first = LeaderThread(app, FAST)
    with first:
        wait_for(lambda: first.leading, "the first leader")
        [holder] = lock_holders(dsn)
        with LeaderThread(app, FAST) as second:
            wait_for(lambda: trying(dsn), "the second leader's lock attempts")
            first.leader.stop()
            first.thread.join(10)
            stopped = time.monotonic()
            wait_for(lambda: second.leading, "the second leader", timeout=5)
            assert time.monotonic() - stopped < 5.0
            assert lock_holders(dsn) not in ([], [holder])


def test_the_lease_must_outlast_the_leaders_beat() -> None:
    with pytest.raises(ConfigurationError, match="lease must be at least 3 s"):
        LeaderConfig(lease=1.0)


def test_a_custom_lock_key_is_the_one_taken(app: App, dsn: str) -> None:
    key = 0x1234_5678_9ABC
    with psycopg.connect(dsn, autocommit=True) as application:
        # The application holds the default key for its own purposes: no matter.
        application.execute("SELECT pg_advisory_lock(%s)", (LEADER_LOCK_KEY,))
        with LeaderThread(app, LeaderConfig(lock_key=key, retry_interval=0.2)) as custom:
            wait_for(lambda: custom.leading, "the leader on its own key", timeout=5)
            [holder] = lock_holders(dsn, key)
            assert lock_holders(dsn, LEADER_LOCK_KEY) != [holder]


def test_a_leader_waits_while_someone_holds_its_key(app: App, dsn: str) -> None:
    key = 424242
    with psycopg.connect(dsn, autocommit=True) as squatter:
        squatter.execute("SELECT pg_advisory_lock(%s)", (key,))
        with LeaderThread(app, LeaderConfig(lock_key=key, retry_interval=0.2)) as waiting:
            [(pid, started)] = wait_for(lambda: trying(dsn), "the leader's lock attempts").items()
            # Two more attempts fail while the key is held.
            retried = next_attempt(dsn, pid, started)
            next_attempt(dsn, pid, retried)
            assert not waiting.leading
            squatter.execute("SELECT pg_advisory_unlock(%s)", (key,))
            released = time.monotonic()
            wait_for(lambda: waiting.leading, "the leader once the key is free", timeout=5)
            assert time.monotonic() - released < 5.0
            assert lock_holders(dsn, key) == [pid]


# --- scheduler ---------------------------------------------------------------------------------


def test_schedule_once_promotes_what_is_due_at_the_frozen_now_and_wakes_workers(dsn: str) -> None:
    due = [
        add_job(dsn, state="scheduled", run_at=ago(1), queue="mail"),
        add_job(dsn, state="retryable", run_at=NOW, queue="mail"),
        add_job(dsn, state="scheduled", run_at=ago(86400)),
    ]
    not_due = [
        add_job(dsn, state="scheduled", run_at=NOW + dt.timedelta(seconds=1)),
        add_job(dsn, state="retryable", run_at=NOW + dt.timedelta(hours=1), queue="mail"),
    ]
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as conn:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        assert schedule_once(conn, NOW) == {"mail": 2, "default": 1}
        woken = {n.payload for n in listener.notifies(timeout=5, stop_after=2)}
        assert woken == {"mail", "default"}
        assert schedule_once(conn, NOW) == {}
    assert [row(dsn, i)["state"] for i in due] == ["available"] * 3
    assert [row(dsn, i)["state"] for i in not_due] == ["scheduled", "retryable"]


# --- rescuer -----------------------------------------------------------------------------------


def test_rescue_once_returns_dead_workers_jobs_and_leaves_live_ones(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    add_worker(dsn, "live-worker", ago(1))
    running = {"state": "running", "attempted_at": ago(120), "attempt": 1}
    stale_row = add_job(dsn, attempted_by="dead-worker", **running)
    no_row = add_job(dsn, attempted_by="vanished-worker", **running)
    live = add_job(dsn, state="running", attempted_by="live-worker", attempted_at=ago(3600), attempt=1)
    just_claimed = add_job(
        dsn, state="running", attempted_by="vanished-worker", attempted_at=ago(5), attempt=1
    )
    queued = add_job(dsn, state="available", attempted_by="dead-worker", attempt=1)

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW) == {"retryable": 2}
        assert rescue_once(conn, NOW) == {}

    for job_id, worker in ((stale_row, "dead-worker"), (no_row, "vanished-worker")):
        job = row(dsn, job_id)
        assert (job["state"], job["crashes"], job["attempt"], job["run_at"]) == ("retryable", 1, 1, NOW)
        assert job["finalized_at"] is None
        [error] = job["errors"]
        assert worker in error["error"] and "died" in error["error"] and "crash 1" in error["error"]
        assert error["attempt"] == 1
    for job_id in (live, just_claimed):
        job = row(dsn, job_id)
        assert (job["state"], job["crashes"], job["errors"]) == ("running", 0, None)
    assert row(dsn, queued)["state"] == "available"

    # A rescued job is due now: the scheduler makes it available, and a claim counts attempt 2.
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert schedule_once(conn, NOW) == {"default": 2}


def test_rescue_once_quarantines_a_job_that_keeps_killing_its_worker(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    job_id = add_job(dsn, state="running", attempted_by="dead-worker", attempted_at=ago(120), attempt=1)
    config = RescuerConfig(max_crashes=3)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for crash in (1, 2, 3):
            if crash > 1:  # claimed again, and its worker dies again
                query(
                    dsn,
                    "UPDATE fastjobs_jobs_all SET state = 'running', attempt = attempt + 1 WHERE id = %s",
                    (job_id,),
                )
            expected = "discarded" if crash == 3 else "retryable"
            assert rescue_once(conn, NOW, config) == {expected: 1}
            assert row(dsn, job_id)["crashes"] == crash
    job = row(dsn, job_id)
    assert (job["state"], job["attempt"], job["finalized_at"]) == ("discarded", 3, NOW)
    assert [e["attempt"] for e in job["errors"]] == [1, 2, 3]
    assert "quarantined" in job["errors"][-1]["error"]
    assert "3 times" in job["errors"][-1]["error"]
    assert "quarantined" not in job["errors"][0]["error"]


def test_rescue_once_quarantines_at_once_a_job_with_crashes_at_the_limit(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    job_id = add_job(
        dsn, state="running", attempted_by="dead-worker", attempted_at=ago(120), attempt=3, crashes=2
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW) == {"discarded": 1}
    job = row(dsn, job_id)
    assert job["state"] == "discarded" and job["crashes"] == 3
    assert job["errors"][-1]["error"].startswith("quarantined")


def test_rescue_once_discards_a_job_with_no_attempt_left(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    job_id = add_job(
        dsn, state="running", attempted_by="dead-worker", attempted_at=ago(120), attempt=3, max_attempts=3
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW) == {"discarded": 1}
    job = row(dsn, job_id)
    assert (job["state"], job["crashes"], job["finalized_at"]) == ("discarded", 1, NOW)
    assert "dead-worker" in job["errors"][-1]["error"]
    assert "quarantined" not in job["errors"][-1]["error"]


def test_rescue_once_respects_stale_after(dsn: str) -> None:
    add_worker(dsn, "quiet-worker", ago(60))
    job_id = add_job(dsn, state="running", attempted_by="quiet-worker", attempted_at=ago(600), attempt=1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW, RescuerConfig(stale_after=120)) == {}
        assert rescue_once(conn, NOW, RescuerConfig(stale_after=30)) == {"retryable": 1}
    assert row(dsn, job_id)["state"] == "retryable"


def test_rescue_once_works_in_batches_until_one_comes_back_short(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    add_jobs(dsn, 35, state="running", attempted_by="dead-worker", attempted_at=ago(120), attempt=1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW, RescuerConfig(batch=10)) == {"retryable": 35}
    assert query(dsn, "SELECT state::text, crashes, count(*) AS n FROM fastjobs_jobs_all GROUP BY 1, 2") == [
        {"state": "retryable", "crashes": 1, "n": 35}
    ]


def test_rescue_once_finishes_a_job_whose_cancellation_was_requested_as_cancelled(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    job_id = add_job(
        dsn,
        state="running",
        attempted_by="dead-worker",
        attempted_at=ago(120),
        attempt=1,
        cancel_requested=True,
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        rescue_once(conn, NOW)
    assert row(dsn, job_id)["state"] == "cancelled"


def test_a_retried_quarantined_job_gets_its_crash_allowance_back(dsn: str) -> None:
    add_worker(dsn, "dead-worker", ago(60))
    job_id = add_job(
        dsn, state="running", attempted_by="dead-worker", attempted_at=ago(120), attempt=3, crashes=2
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW) == {"discarded": 1}
        assert control.retry(conn, job_id).state == "available"  # the operator fixed the cause
    # Claimed again, and its worker is killed once (a deploy, an unrelated OOM).
    query(
        dsn,
        "UPDATE fastjobs_jobs_all SET state = 'running', attempt = attempt + 1, attempted_by = 'dead-worker',"
        " attempted_at = %s WHERE id = %s",
        (ago(120), job_id),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rescue_once(conn, NOW) == {"retryable": 1}


# --- cleaner -----------------------------------------------------------------------------------


def vacuum_stats(dsn: str) -> dict[str, Any]:
    [stats] = query(
        dsn,
        "SELECT n_dead_tup AS dead, vacuum_count AS vacuums FROM pg_stat_user_tables"
        " WHERE relid = 'fastjobs_jobs'::regclass",
    )
    return stats


def dead_rows(dsn: str, count: int) -> None:
    """`count` dead row versions in the jobs table, reported to the statistics."""
    add_jobs(dsn, count)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM fastjobs_jobs_all")
        conn.execute("SELECT pg_stat_force_next_flush()")
    wait_for(lambda: vacuum_stats(dsn)["dead"] >= count, f"{count} dead rows in the statistics")


def test_vacuum_once_vacuums_the_jobs_table_past_its_threshold_of_dead_rows(dsn: str) -> None:
    vacuumer = Vacuumer(dsn, VacuumConfig(threshold=500, interval=0.5, duty=0.5), lambda: True)
    dead_rows(dsn, 300)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert vacuumer.vacuum_once(conn) == 0.5  # under the threshold: nothing to do
        assert vacuum_stats(dsn)["vacuums"] == 0 and vacuumer.runs == 0
        dead_rows(dsn, 300)
        rest = vacuumer.vacuum_once(conn)
    assert vacuumer.runs == 1 and rest >= 0.5
    assert wait_for(lambda: (s := vacuum_stats(dsn))["vacuums"] == 1 and s["dead"] == 0 and s, "the vacuum")


def test_vacuum_once_leaves_the_empty_pages_at_the_tables_end(dsn: str) -> None:
    """Cutting them off takes an ACCESS EXCLUSIVE lock every claim and enqueue waits behind, and a
    queue fills them again a moment later: the leader's VACUUM leaves them (sql.vacuum_jobs)."""
    vacuumer = Vacuumer(dsn, VacuumConfig(threshold=100, interval=0.5), lambda: True)
    dead_rows(dsn, 2_000)
    [before] = query(dsn, "SELECT pg_relation_size('fastjobs_jobs') AS size")
    assert before["size"] > 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        vacuumer.vacuum_once(conn)
    assert vacuumer.runs == 1
    assert query(dsn, "SELECT pg_relation_size('fastjobs_jobs') AS size") == [before]


def test_no_vacuum_again_while_the_snapshot_that_held_the_last_one_back_stays_open(dsn: str) -> None:
    vacuumer = Vacuumer(dsn, VacuumConfig(threshold=100, interval=0.5), lambda: True)
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as holder:
        holder.execute("SELECT txid_current()")  # before the rows die: it may still see them
        dead_rows(dsn, 300)
        vacuumer.vacuum_once(conn)
        assert vacuumer.runs == 1 and vacuumer.held_back is not None
        assert vacuumer.held_back.ident == str(holder.info.backend_pid)
        dead_rows(dsn, 300)
        assert vacuumer.vacuum_once(conn) == 0.5 and vacuumer.runs == 1  # futile: not run
        holder.rollback()
        vacuumer.vacuum_once(conn)
        assert vacuumer.runs == 2 and vacuumer.held_back is None
    assert vacuum_stats(dsn) == {"dead": 0, "vacuums": 2}


def test_the_leader_warns_of_a_snapshot_holding_cleanup_back(
    app: App, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    vacuum = VacuumConfig(interval=0.1, horizon_warning=0.3, horizon_interval=0.2)
    with LeaderThread(app, LeaderConfig(retry_interval=0.1, vacuum=vacuum)) as leader:
        wait_for(lambda: leader.leading, "the leader to lead")
        with psycopg.connect(dsn, application_name="report") as holder:
            holder.execute("SELECT txid_current()")
            pid = holder.info.backend_pid
            pinned = rf"^leader: WARNING: cleanup horizon pinned for \d+s by backend {pid} \(report,"
            wait_for(
                lambda: any(re.search(pinned, message) for message in caplog.messages), "the leader's warning"
            )


def test_the_leader_vacuums_while_it_leads(app: App, dsn: str) -> None:
    config = LeaderConfig(retry_interval=0.1, vacuum=VacuumConfig(threshold=1_000, interval=0.1))
    with LeaderThread(app, config) as leader:
        wait_for(lambda: leader.leading, "the leader to lead")
        dead_rows(dsn, 2_000)
        wait_for(lambda: vacuum_stats(dsn)["vacuums"] >= 1, "the leader's vacuum")
    disabled = LeaderConfig(retry_interval=0.1, vacuum=VacuumConfig(enabled=False, threshold=1, interval=0.1))
    with LeaderThread(app, disabled) as leader:
        wait_for(lambda: leader.leading, "the leader to lead")
        dead_rows(dsn, 2_000)
        time.sleep(0.5)  # ten of its intervals: long enough for a vacuum it would have run
        assert vacuum_stats(dsn)["vacuums"] == 1


def test_clean_once_deletes_finished_jobs_past_their_retention(dsn: str) -> None:
    day = 86400.0
    old_completed = add_job(dsn, state="completed", finalized_at=ago(2 * day))
    old_cancelled = add_job(dsn, state="cancelled", finalized_at=ago(2 * day))
    new_completed = add_job(dsn, state="completed", finalized_at=ago(3600))
    new_cancelled = add_job(dsn, state="cancelled", finalized_at=ago(3600))
    # Discarded jobs are kept longer (7 days): someone may want to look at them.
    discarded_2d = add_job(dsn, state="discarded", finalized_at=ago(2 * day))
    discarded_8d = add_job(dsn, state="discarded", finalized_at=ago(8 * day))
    # Unfinished jobs are never cleaned, however old.
    unfinished = [
        add_job(dsn, state=state, created_at=ago(30 * day), run_at=ago(30 * day))
        for state in ("available", "scheduled", "retryable", "running")
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = clean_once(conn, NOW)
        assert counts == {"completed": 2, "discarded": 1, "results": 0, "buckets": 0, "workers": 0}
        assert clean_once(conn, NOW) == {
            "completed": 0,
            "discarded": 0,
            "results": 0,
            "buckets": 0,
            "workers": 0,
        }
    assert ids(dsn) == sorted([new_completed, new_cancelled, discarded_2d, *unfinished])
    assert {old_completed, old_cancelled, discarded_8d}.isdisjoint(ids(dsn))


def test_clean_once_retentions_are_settings(dsn: str) -> None:
    completed = add_job(dsn, state="completed", finalized_at=ago(120))
    discarded = add_job(dsn, state="discarded", finalized_at=ago(120))
    config = CleanerConfig(completed_retention=60, discarded_retention=180)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert clean_once(conn, NOW, config) == {
            "completed": 1,
            "discarded": 0,
            "results": 0,
            "buckets": 0,
            "workers": 0,
        }
        later = NOW + dt.timedelta(minutes=2)
        assert clean_once(conn, later, config) == {
            "completed": 0,
            "discarded": 1,
            "results": 0,
            "buckets": 0,
            "workers": 0,
        }
    assert completed not in ids(dsn) and discarded not in ids(dsn)


def test_clean_once_works_in_batches_until_one_comes_back_short(dsn: str) -> None:
    add_jobs(dsn, 35, state="completed", finalized_at=ago(2 * 86400))
    add_jobs(dsn, 20, state="discarded", finalized_at=ago(8 * 86400))
    add_jobs(dsn, 5, state="completed", finalized_at=ago(60))  # kept
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = clean_once(conn, NOW, CleanerConfig(batch=10))
    assert counts == {"completed": 35, "discarded": 20, "results": 0, "buckets": 0, "workers": 0}
    assert len(ids(dsn)) == 5


def test_clean_once_prunes_silent_workers_but_not_those_holding_running_jobs(dsn: str) -> None:
    add_worker(dsn, "silent", ago(7200))
    add_worker(dsn, "silent-with-finished-jobs", ago(7200))
    add_worker(dsn, "silent-holding-a-job", ago(7200))
    add_worker(dsn, "recent", ago(600))
    add_worker(dsn, "live", ago(1))
    add_job(dsn, state="completed", attempted_by="silent-with-finished-jobs", finalized_at=ago(60))
    add_job(dsn, state="running", attempted_by="silent-holding-a-job", attempted_at=ago(7200))
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert clean_once(conn, NOW)["workers"] == 2
        assert clean_once(conn, NOW, CleanerConfig(worker_retention=300))["workers"] == 1
    left = [r["id"] for r in query(dsn, "SELECT id FROM fastjobs_workers ORDER BY id")]
    # The one holding a running job stays until the rescuer has taken its job back.
    assert left == ["live", "silent-holding-a-job"]


# --- real masters --------------------------------------------------------------------------------

RESCUE_JOBS = '''
"""A job that blocks on its first attempt and returns on the next; each execution is a row of `runs`."""

import os
import threading

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {}


def _record(n):
    pid = os.getpid()
    if pid not in _conn:
        _conn.clear()
        _conn[pid] = psycopg.connect(os.environ["FJ_TEST_RUNS_DSN"], autocommit=True)
    _conn[pid].execute("INSERT INTO runs (n, pid) VALUES (%s, %s)", (n, pid))


@app.job("block_first")
def block_first():
    attempt = fastjobs.current_job().attempt
    _record(attempt)
    if attempt == 1:
        threading.Event().wait()  # until the test kills this worker
'''

CRON_JOBS = '''
"""A job enqueued by the leader every minute; each execution records its job id in `runs`."""

import os

import psycopg

import fastjobs

app = fastjobs.App()
_conn = {}


@app.periodic("* * * * *", kind="every_minute")
def every_minute():
    pid = os.getpid()
    if pid not in _conn:
        _conn.clear()
        _conn[pid] = psycopg.connect(os.environ["FJ_TEST_RUNS_DSN"], autocommit=True)
    _conn[pid].execute("INSERT INTO runs (n, pid) VALUES (%s, %s)", (fastjobs.current_job().id, pid))
'''


@pytest.fixture
def masters(tmp_path: Path, dsn: str) -> Iterator[procs.Masters]:
    procs.create_runs_table(dsn)
    (tmp_path / "rescuejobs.py").write_text(textwrap.dedent(RESCUE_JOBS))
    (tmp_path / "cronjobs.py").write_text(textwrap.dedent(CRON_JOBS))
    with procs.Masters(tmp_path, dsn) as m:
        yield m


def executions(dsn: str) -> list[tuple[int, int]]:
    """(n, pid) of every handler execution, in order."""
    return [(r["n"], r["pid"]) for r in query(dsn, "SELECT n, pid FROM runs ORDER BY at")]


@pytest.mark.slow
def test_a_job_of_a_worker_killed_mid_job_is_rescued_and_runs_again(
    masters: procs.Masters, app: App, dsn: str
) -> None:
    """Default settings: stale_after 15 s, rescuer every 5 s, scheduler every 1 s."""
    job_id = app.enqueue("block_first")
    master = masters.start("--processes", "1", "--keep-completed", module="rescuejobs")
    wait_for(lambda: executions(dsn), "the first attempt")
    victim = master.wait_child("fastjobs: worker 1 ")
    [(attempt, pid)] = executions(dsn)
    assert (attempt, pid) == (1, victim)
    worker_id = row(dsn, job_id)["attempted_by"]
    assert f":{victim}:" in worker_id

    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    master.wait_stderr(rf"worker 1 \(pid {victim}\) was killed by signal 9; restarting")
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(victim,))
    wait_for(lambda: len(executions(dsn)) == 2, "the rescued job's second attempt", timeout=60)
    elapsed = time.monotonic() - killed
    print(f"\nrescue: {elapsed:.1f}s from kill -9 of the worker to the job running again")
    # The worker's last heartbeat is at most 2 s before the kill; its job is
    # rescued once that is 15 s old, at the rescuer's next pass (5 s, +-10%),
    # and the scheduler (1 s) makes it available.
    assert 12.0 <= elapsed < 30.0
    assert executions(dsn)[1] == (2, heir)

    wait_for(lambda: row(dsn, job_id)["state"] == "completed", "the second attempt to complete")
    job = row(dsn, job_id)
    assert (job["attempt"], job["crashes"]) == (2, 1)
    [error] = job["errors"]
    assert error["attempt"] == 1 and worker_id in error["error"] and "died" in error["error"]
    assert "rescuer: retryable 1" in master.stderr()
    assert master.stop() == 0, master.stderr()


def test_a_cron_tick_runs_once_across_a_leader_change_between_two_masters(
    masters: procs.Masters, dsn: str
) -> None:
    """Two `fastjobs run` against one database, `* * * * *`: the first master's leader enqueues
    the current minute; it is killed; the second master's leader takes over, makes its pass,
    and does not enqueue that minute again."""
    first = masters.start("--processes", "1", "--keep-completed", module="cronjobs")
    first.wait_stderr(r"leader elected")
    [job] = wait_for(lambda: query(dsn, "SELECT id, unique_key FROM fastjobs_jobs_all"), "the tick's job")
    wait_for(lambda: row(dsn, job["id"])["state"] == "completed", "the tick's job to run")
    [holder] = lock_holders(dsn)

    second = masters.start("--processes", "1", "--keep-completed", module="cronjobs")
    wait_for(lambda: trying(dsn), "the second master's leader to contend")
    first.kill()  # the whole first master: its leader's session ends, the lock is free
    [heir] = wait_for(lambda: [p for p in lock_holders(dsn) if p != holder], "a new leader", timeout=15)
    second.wait_stderr(r"leader elected")

    # The new leader's first turn runs every service; the periodic one is the
    # only one in a transaction, so its COMMIT (the backend idle after it) ends the pass.
    def passed() -> bool:
        rows = query(dsn, "SELECT state, query FROM pg_stat_activity WHERE pid = %s", (heir,))
        return bool(rows) and rows[0]["state"] == "idle" and rows[0]["query"] == "COMMIT"

    wait_for(passed, "the new leader's periodic pass", timeout=10)
    assert second.stop() == 0, second.stderr()

    jobs = query(dsn, "SELECT id, unique_key, state::text AS state FROM fastjobs_jobs_all ORDER BY id")
    keys = [j["unique_key"] for j in jobs]
    assert keys[0] == job["unique_key"]
    assert len(set(keys)) == len(keys), keys  # one job per tick (a second only if a minute turned)
    ran = Counter(n for n, _ in executions(dsn))
    assert set(ran.values()) == {1}, ran
    assert set(ran) == {j["id"] for j in jobs if j["state"] == "completed"}


def test_a_stopped_leader_loses_the_lock_to_another_master_within_its_lease(
    masters: procs.Masters, dsn: str
) -> None:
    """Two `fastjobs run` on one database; SIGSTOP the first's leader (its socket stays open and
    TCP-alive). With the default lease (10 s) and retry interval (2 s), the second master's leader
    terminates the silent session and leads within lease + retry + a turn; the stopped leader, woken
    up, finds its session gone and steps down without acting."""
    first = masters.start("--processes", "1", module="cronjobs")
    first.wait_stderr(r"leader elected")
    frozen = first.wait_child("fastjobs: leader")
    [holder] = lock_holders(dsn)
    second = masters.start("--processes", "1", module="cronjobs")
    wait_for(lambda: trying(dsn), "the second master's leader to contend")
    heir = second.wait_child("fastjobs: leader")

    os.kill(frozen, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        second.wait_stderr(rf"leader elected \(pid {heir}\)", timeout=20)
        failover = time.monotonic() - stopped
        print(f"\nleader failover after SIGSTOP of the leader: {failover:.2f}s (lease 10 s, retry 2 s)")
        assert failover < 10.0 + 2.0 + 3.0
        assert re.search(
            rf"the leader's session \(backend {holder}, client \S+\) was silent", second.stderr()
        )
        [new_holder] = lock_holders(dsn)
        assert new_holder != holder
        # The new leader acts: a due scheduled job (of a queue no worker serves) is promoted.
        due = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        job_id = add_job(dsn, queue="unserved", state="scheduled", run_at=due)
        wait_for(lambda: row(dsn, job_id)["state"] == "available", "the new leader's scheduler", timeout=5)
    finally:
        os.kill(frozen, signal.SIGCONT)
    # Woken, the old leader's first statement fails on its terminated session: it steps down.
    first.wait_stderr(rf"leader \(pid {frozen}\) stepped down", timeout=10)
    assert lock_holders(dsn) == [new_holder]
    assert first.stderr().count("leader elected") == 1
    assert first.stop() == 0, first.stderr()
    assert second.stop() == 0, second.stderr()
