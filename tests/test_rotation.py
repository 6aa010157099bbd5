"""The rotating slots of fastjobs_jobs_all (migrations/005_rotation.sql, fastjobs.maintenance.rotate_once).

Jobs due now without a unique key go to the current rotating slot; the
leader empties the oldest slot by TRUNCATE, which frees its storage whatever
snapshot is open, after copying out the rows it still holds. These tests
call `rotate_once` directly and read the truth from the partitions.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from fastjobs import App, control, sql
from fastjobs.maintenance import SLOTS, RotationConfig, rotate_once

from .helpers import run_one_batch, wait_for


def current_slot(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT pg_sequence_last_value('fastjobs_slot')").fetchone()
    assert row is not None
    return int(row[0])


def slots(db: psycopg.Connection[Any]) -> dict[int, int]:
    """Live rows per slot."""
    return dict(db.execute("SELECT slot, count(*) FROM fastjobs_jobs_all GROUP BY slot").fetchall())


def rotate(db: psycopg.Connection[Any], config: RotationConfig | None = None) -> dict[str, int]:
    return rotate_once(db, config or RotationConfig())


def test_jobs_due_now_go_to_the_current_slot_and_the_others_to_the_durable_one(app: App, db) -> None:
    assert current_slot(db) == 1
    app.enqueue("k", {})
    assert app.enqueue_many("k", [{}, {}]) == 2
    app.enqueue("k", {}, unique_key="u")
    app.enqueue("k", {}, delay=3600)
    assert slots(db) == {1: 3, 0: 2}  # unique keys and scheduled jobs stay durable

    @app.enqueue_middleware
    def trace(enqueue: Any, call_next: Any) -> Any:
        enqueue.meta["trace"] = "t"
        return call_next()

    app.enqueue("k", {})  # with meta (enqueue middleware: tracing) too
    app.enqueue("k", {}, unique_key="v")
    assert slots(db) == {1: 4, 0: 3}
    assert db.execute(
        'SELECT count(*) FROM fastjobs_jobs_all WHERE meta = \'{"trace": "t"}\''
    ).fetchone() == (2,)
    assert rotate(db)["rotated"] == 1
    assert current_slot(db) == 2
    assert db.execute(
        "SELECT slot FROM fastjobs_jobs_all WHERE id = %s", (app.enqueue("k", {}),)
    ).fetchone() == (2,)


def test_the_rotation_moves_what_the_oldest_slot_holds_and_truncates_it(db) -> None:
    """Rows left in the slot keep their id, state, attempt and worker: unfinished ones go to the
    current slot, the others to slot 0."""
    columns = "id, state::text, attempt, attempted_by, errors"
    db.execute(
        """INSERT INTO fastjobs_jobs_all (kind, state, attempt, attempted_by, errors, finalized_at, slot)
           VALUES ('k', 'available', 0, NULL, NULL, NULL, 2),
                  ('k', 'running', 1, 'w1', NULL, NULL, 2),
                  ('k', 'retryable', 1, 'w1', '[{"error": "boom"}]', NULL, 2),
                  ('k', 'completed', 1, 'w1', NULL, now(), 2)"""
    )
    before = db.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall()
    assert rotate(db) == {"rotated": 1, "moved": 2, "settled": 2}  # slot 2: the one after 1
    assert db.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall() == before
    assert dict(db.execute("SELECT state::text, slot FROM fastjobs_jobs_all").fetchall()) == {
        "available": 1,
        "running": 1,
        "retryable": 0,
        "completed": 0,
    }
    assert db.execute("SELECT pg_relation_size('fastjobs_jobs_2')").fetchone() == (0,)
    assert current_slot(db) == 2


def test_truncation_frees_what_vacuum_cannot_while_a_snapshot_is_held(db, dsn) -> None:
    with psycopg.connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM fastjobs_workers")  # a snapshot, no lock on the jobs
        db.execute("INSERT INTO fastjobs_jobs_all (kind) SELECT 'k' FROM generate_series(1, 20000)")
        db.execute("DELETE FROM fastjobs_jobs_all")  # as completions do
        db.execute("VACUUM fastjobs_jobs_1")
        held = db.execute("SELECT pg_relation_size('fastjobs_jobs_1')").fetchone()
        assert held is not None and held[0] > 500_000  # every dead row kept for the snapshot
        for _ in range(SLOTS):  # a whole turn: slot 1 is the oldest at the last
            assert rotate(db)["rotated"] == 1
        freed = db.execute("SELECT pg_total_relation_size('fastjobs_jobs_1')").fetchone()
        assert freed is not None and freed[0] < 100_000
        holder.rollback()


def test_a_job_moved_while_it_runs_completes_as_usual(app: App, dsn: str, db) -> None:
    """The worker's outcome finds its job in the slot it was moved to (the finish waits for the
    rotation's lock, then reads a snapshot taken after its commit): nothing is left running."""
    rotated: list[dict[str, int]] = []

    @app.job(kind="moved")
    def moved() -> None:
        if rotated:
            return  # the batch's first job rotates for all three
        with psycopg.connect(dsn, autocommit=True) as leader:
            for _ in range(SLOTS):  # slot 1, where the batch was claimed, is emptied at the last
                rotated.append(rotate_once(leader))

    app.enqueue_many("moved", [{} for _ in range(3)])
    assert run_one_batch(app, 3) == 3
    assert [r["rotated"] for r in rotated] == [1] * SLOTS
    assert rotated[-1]["moved"] == 3  # the three running jobs
    assert slots(db) == {}  # completed and deleted in slot 1's successor, none stale


def test_the_rotation_gives_way_to_a_transaction_still_writing_the_slot_then_moves_its_rows(
    db, dsn: str
) -> None:
    with psycopg.connect(dsn) as writer:
        writer.execute("INSERT INTO fastjobs_jobs_all (kind, slot) VALUES ('k', 2)")  # not committed yet
        began = time.monotonic()
        assert rotate(db, RotationConfig(lock_timeout=0.05)) == {"gave way": 1, "settled": 0}
        assert time.monotonic() - began < 1.0
        assert current_slot(db) == 1  # nothing changed
        writer.commit()
    assert rotate(db) == {"rotated": 1, "moved": 1, "settled": 0}
    assert slots(db) == {1: 1}


def test_a_slot_holding_a_backlog_is_left_to_drain(db) -> None:
    db.execute("INSERT INTO fastjobs_jobs_all (kind, slot) SELECT 'k', 2 FROM generate_series(1, 11)")
    assert rotate(db, RotationConfig(max_move=10)) == {"deferred": 1, "settled": 0}
    assert current_slot(db) == 1 and slots(db) == {2: 11}
    assert rotate(db, RotationConfig(max_move=11)) == {"rotated": 1, "moved": 11, "settled": 0}


def test_settled_rows_leave_the_oldest_slot_by_row_locks_so_kept_jobs_never_stop_the_rotation(db) -> None:
    """Kept completed jobs (or discarded, retryable ones) beyond max_move go to slot 0 before the lock;
    a backlog of available ones still defers."""
    db.execute(
        "INSERT INTO fastjobs_jobs_all (kind, state, attempt, finalized_at, slot)"
        " SELECT 'k', 'completed', 1, now(), 2 FROM generate_series(1, 25)"
    )
    assert rotate(db, RotationConfig(max_move=10)) == {"rotated": 1, "moved": 0, "settled": 25}
    assert slots(db) == {0: 25}
    db.execute(
        "INSERT INTO fastjobs_jobs_all (kind, state, slot)"
        " SELECT 'k', 'available', 3 FROM generate_series(1, 11)"
    )
    assert rotate(db, RotationConfig(max_move=10)) == {"deferred": 1, "settled": 0}


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_enqueues_never_wait_for_the_rotation_lock(app: App, dsn: str, db, many: bool) -> None:
    """An insert locks only the slot it goes to: while the rotation holds the oldest slot
    (here for as long as the test likes), enqueues go on."""
    with psycopg.connect(dsn) as rotation:
        rotation.execute("LOCK TABLE fastjobs_jobs_2 IN ACCESS EXCLUSIVE MODE")
        done = threading.Event()

        def enqueue() -> None:
            if many:
                app.enqueue_many("k", [{} for _ in range(100)])
            else:
                for _ in range(20):
                    app.enqueue("k", {})
            done.set()

        thread = threading.Thread(target=enqueue)
        began = time.monotonic()
        thread.start()
        assert done.wait(10), "an enqueue waited for the rotation's lock"
        assert time.monotonic() - began < 2.0
        rotation.rollback()
    thread.join()
    assert slots(db) == {1: 100 if many else 20}


def test_the_slot_default_costs_an_insert_no_lookup(db) -> None:
    """The slot comes from the sequence's last value (no row read, no lock taken on another table)."""
    default = db.execute(
        "SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef d JOIN pg_attribute a"
        " ON a.attrelid = d.adrelid AND a.attnum = d.adnum"
        " WHERE d.adrelid = 'fastjobs_jobs_all'::regclass AND a.attname = 'slot'"
    ).fetchone()
    assert default == ("pg_sequence_last_value('fastjobs_slot'::regclass)",)


def _waits_on_a_lock(db: psycopg.Connection[Any], pid: int) -> bool:
    return bool(
        db.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (pid,)
        ).fetchone()
    )


@pytest.mark.parametrize("action", ["cancel", "retry", "discard"])
def test_a_cancel_retry_or_discard_waiting_on_the_settle_step_acts_on_the_moved_row(
    app: App, db, dsn: str, action: str
) -> None:
    """The settle step moves a retryable row (delete, insert into slot 0) while a cancel, retry or
    discard waits for its lock: the waiter finds the row deleted and must look again by id, not
    answer 'retryable' (a lost cancel) or 'is running' (a wrong message)."""
    row = db.execute(
        "INSERT INTO fastjobs_jobs_all (kind, state, attempt, run_at, slot)"
        " VALUES ('k', 'retryable', 1, now() + interval '1 hour', 2) RETURNING id"
    ).fetchone()
    assert row is not None
    job_id = row[0]
    result: dict[str, Any] = {}
    with psycopg.connect(dsn) as settle, psycopg.connect(dsn, autocommit=True) as acting:
        with psycopg.RawCursor(settle) as cur:
            assert cur.execute(sql.slot_settle, (2, 1000)).rowcount == 1  # holds the row until commit
        pid = acting.info.backend_pid

        def act() -> None:
            try:
                if action == "cancel":
                    result["got"] = control.cancel(acting, job_id)
                elif action == "retry":
                    result["got"] = control.retry(acting, job_id).state
                else:
                    result["got"] = control.discard(acting, job_id)
            except Exception as exc:  # the test reports what the call raised
                result["got"] = exc

        thread = threading.Thread(target=act)
        thread.start()
        try:
            assert wait_for(lambda: _waits_on_a_lock(db, pid), timeout=5)
        finally:
            settle.commit()
            thread.join(10)
    expected = {"cancel": "cancelled", "retry": "available", "discard": "discarded"}[action]
    assert result["got"] == expected
    assert db.execute(
        "SELECT state::text, slot FROM fastjobs_jobs_all WHERE id = %s", (job_id,)
    ).fetchone() == (
        expected,
        0,
    )


def test_cancels_racing_the_rotation_are_never_lost(app: App, db, dsn: str) -> None:
    """Bounded race: retryable jobs in the oldest slot, a rotator settling them while another
    session cancels each. Every cancel answers 'cancelled' and every job ends cancelled."""
    count = 600
    ids = [
        r[0]
        for r in db.execute(
            "INSERT INTO fastjobs_jobs_all (kind, state, attempt, run_at, slot)"
            " SELECT 'k', 'retryable', 1, now() + interval '1 hour', 2 FROM generate_series(1, %s)"
            " RETURNING id",
            (count,),
        ).fetchall()
    ]
    answers: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as rotator, psycopg.connect(dsn, autocommit=True) as admin:
        stop = threading.Event()

        def settle() -> None:
            # Each batch held a moment: the canceller, faster, catches up and waits on it.
            with psycopg.RawCursor(rotator) as cur:
                while not stop.is_set():
                    with rotator.transaction():
                        moved = cur.execute(sql.slot_settle, (2, 10)).rowcount
                        time.sleep(0.005)
                    if not moved:
                        return

        thread = threading.Thread(target=settle)
        thread.start()
        try:
            for job_id in sorted(ids):  # in the settle's order, right behind it
                answers.append(control.cancel(admin, job_id))
        finally:
            stop.set()
            thread.join(10)
    assert answers == ["cancelled"] * count
    assert db.execute("SELECT state::text, count(*) FROM fastjobs_jobs_all GROUP BY 1").fetchall() == [
        ("cancelled", count)
    ]


def test_rows_another_transaction_holds_through_the_settle_step_are_moved_whole(db, dsn: str) -> None:
    """The settle step skips rows another transaction holds (a concurrent cancel or retry): the
    move step, under the slot's lock once they are released, must carry them out intact."""
    db.execute(
        """INSERT INTO fastjobs_jobs_all (kind, queue, args, priority, state, run_at, attempt, max_attempts,
                                          attempted_at, attempted_by, errors, meta, crashes, slot)
           VALUES ('k', 'q', '{"a": 1}', 3, 'retryable', now() + interval '1 hour', 2, 7, now(), 'w1',
                   '[{"error": "boom"}]', '{"m": 1}', 1, 2),
                  ('k', 'q', '{"b": 2}', -1, 'scheduled', now() + interval '2 hours', 0, 5, NULL, NULL,
                   NULL, NULL, 0, 2)"""
    )
    columns = (
        "id, queue, kind, args, priority, state::text, run_at, attempt, max_attempts, created_at,"
        " attempted_at, finalized_at, attempted_by, errors, unique_key, meta, crashes, cancel_requested"
    )
    before = db.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall()
    result: dict[str, Any] = {}
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT id FROM fastjobs_jobs_all WHERE slot = 2 FOR UPDATE")

        def rotation() -> None:
            with psycopg.connect(dsn, autocommit=True) as leader:
                result["rotated"] = rotate_once(leader, RotationConfig(lock_timeout=5.0))

        thread = threading.Thread(target=rotation)
        thread.start()
        try:
            # Settled nothing (both rows held), now waiting for the slot's lock.
            assert wait_for(
                lambda: bool(
                    db.execute(
                        "SELECT 1 FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE%'"
                    ).fetchone()
                ),
                timeout=5,
            )
        finally:
            holder.commit()
            thread.join(10)
    assert result["rotated"] == {"rotated": 1, "moved": 2, "settled": 0}
    assert db.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall() == before
    assert slots(db) == {0: 2}  # settled rows go to the durable slot
