"""Upkeep that cannot stall or crash-loop: the rotation's privileges, backlog and pace, wherever workers run.

The rotation is the rotating slots' only cleanup (their autovacuum is off):
a leader that may not rotate says which GRANTs it lacks and runs its other
services; a backlog nobody serves is moved out of the rotation after its
patience; an in-process Worker rotates when no leader does; and `fastjobs
stats` and the metrics say when the rotation cannot do its work and why.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fastjobs import App
from fastjobs.abc import BATCH_SECONDS, FRONT_CLAIM_DUTY, FRONT_CLAIM_MAX_WAIT, GUARD_TICK, SLOT_FRESH
from fastjobs.exposition import prometheus
from fastjobs.leader import Leader, LeaderConfig
from fastjobs.maintenance import SLOTS, RotationConfig, Rotator, SchedulerConfig, rotate_once
from fastjobs.report import upkeep_warnings
from fastjobs.scoreboard import Scoreboard, database_identity
from fastjobs.sql import LEADER_LOCK_KEY
from fastjobs.stats import LEADER, ROTATION_DEFERRED, ROTATION_OK, ROTATION_PRIVILEGES
from fastjobs.worker import Worker, WorkerConfig

from . import procs
from .procs import wait_for

# The rotation's grants, as docs/operations/upgrades.md (Roles and grants) gives them.
ROTATION_GRANTS = (
    "GRANT TRUNCATE ON fastjobs_jobs_1, fastjobs_jobs_2, fastjobs_jobs_3, fastjobs_jobs_4 TO {role}",
    "GRANT UPDATE ON SEQUENCE fastjobs_slot TO {role}",
)


@pytest.fixture
def granted(dsn: str) -> Iterator[str]:
    """A role granted the tables (as the tests' other worker roles are), not their owner: its DSN."""
    role = f"fastjobs_granted_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT UPDATE ON SEQUENCE fastjobs_sleep_until TO {role}")
    try:
        yield make_conninfo(dsn, user=role)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def current_slot(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_sequence_last_value('fastjobs_slot')").fetchone()
    assert row is not None
    return int(row[0])


def enqueued(dsn: str, kind: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM fastjobs_jobs_all WHERE kind = %s", (kind,)).fetchone()
    assert row is not None
    return int(row[0])


class Rotations:
    """Counts the rotations by watching the current slot move (polled)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.last = current_slot(dsn)
        self.seen = 0

    def count(self) -> int:
        now = current_slot(self.dsn)
        self.seen += (now - self.last) % SLOTS
        self.last = now
        return self.seen


class LeaderThread:
    def __init__(self, app: App, config: LeaderConfig) -> None:
        self.cards = Scoreboard.create(1)
        self.card = self.cards[0]
        self.card.claim(LEADER, 0)
        self.leader = Leader(app, config, card=self.card)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.leader.run()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> LeaderThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leader.stop()
        self.thread.join(10)
        self.cards.close(unlink=True)
        assert not self.thread.is_alive()


FAST = LeaderConfig(
    retry_interval=0.1,
    scheduler=SchedulerConfig(interval=0.1),
    rotation=RotationConfig(interval=0.1, retry=0.05, worth=0),
)


def test_a_leader_that_may_not_rotate_names_the_grants_and_runs_its_other_services(
    dsn: str, granted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As a role granted the tables but not owning them, the rotator used to die on TRUNCATE at every
    turn, and the periodic service after it never ran: now a start-up error names the GRANTs, the
    cron job is enqueued, and the slot says why the rotation cannot work (stats, metrics)."""
    app = App(granted)
    app.periodic("* * * * *", kind="tick")(lambda: None)
    try:
        with caplog.at_level(logging.ERROR, logger="fastjobs.leader"), LeaderThread(app, FAST) as leader:
            wait_for(
                lambda: leader.error is not None or enqueued(dsn, "tick") > 0,
                "the cron job or the leader's death",
            )
            assert leader.error is None
            assert leader.thread.is_alive()
            assert leader.leader.rotator.problem == ROTATION_PRIVILEGES
            assert leader.card["rotation_problem"] == ROTATION_PRIVILEGES
            warnings = upkeep_warnings([leader.card.as_dict()])
            metrics = prometheus(leader.cards, None)
        assert any(
            "GRANT TRUNCATE ON fastjobs_jobs_1 TO" in m and "GRANT UPDATE ON SEQUENCE fastjobs_slot TO" in m
            for m in caplog.messages
        ), caplog.messages
        assert len(warnings) == 1 and "rotation cannot do its work (privileges" in warnings[0]
        assert 'fastjobs_rotation_problem{role="leader",index="0",reason="privileges"} 1' in metrics
        assert "fastjobs_rotation_age_seconds" in metrics
    finally:
        app.close()


def test_with_the_documented_grants_a_granted_role_rotates(dsn: str, granted: str) -> None:
    role = psycopg.conninfo.conninfo_to_dict(granted)["user"]
    with psycopg.connect(dsn, autocommit=True) as owner:
        for grant in ROTATION_GRANTS:
            owner.execute(grant.format(role=role))
        owner.execute("INSERT INTO fastjobs_jobs_all (kind, state, slot) VALUES ('k', 'available', 2)")
        owner.execute("INSERT INTO fastjobs_jobs_all (kind, state, slot) VALUES ('k', 'completed', 2)")
    app = App(granted)
    try:
        rotations = Rotations(dsn)
        with LeaderThread(app, FAST) as leader:
            wait_for(lambda: rotations.count() >= SLOTS, "a whole turn of rotations")
            assert leader.leader.rotator.problem == ROTATION_OK
            assert leader.error is None and not leader.leader.failures
        assert upkeep_warnings([leader.card.as_dict()]) == []
    finally:
        app.close()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT state::text, slot FROM fastjobs_jobs_all ORDER BY id").fetchall()[1] == (
            "completed",
            0,
        )


def test_a_failing_service_is_counted_and_the_others_run_on(
    dsn: str, granted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The cleaner fails at every turn (its role may not delete silent workers): logged with why,
    counted, reported; the scheduler and the periodic service still run."""
    role = psycopg.conninfo.conninfo_to_dict(granted)["user"]
    with psycopg.connect(dsn, autocommit=True) as owner:
        owner.execute(f"REVOKE DELETE ON fastjobs_workers FROM {role}")
        for grant in ROTATION_GRANTS:
            owner.execute(grant.format(role=role))
        row = owner.execute(
            "INSERT INTO fastjobs_jobs (kind, state, run_at) VALUES ('due', 'scheduled', now()) RETURNING id"
        ).fetchone()
    assert row is not None
    app = App(granted)
    app.periodic("* * * * *", kind="tick")(lambda: None)
    try:
        with caplog.at_level(logging.ERROR, logger="fastjobs.leader"), LeaderThread(app, FAST) as leader:

            def ran() -> bool:
                with psycopg.connect(dsn) as conn:
                    got = conn.execute(
                        "SELECT count(*) FILTER (WHERE kind = 'tick'),"
                        " count(*) FILTER (WHERE kind = 'due' AND state = 'available') FROM fastjobs_jobs_all"
                    ).fetchone()
                return got == (1, 1) or leader.error is not None

            wait_for(ran, "the periodic and scheduler services")
            wait_for(lambda: leader.leader.failures.get("cleaner", 0) >= 1, "the cleaner's failure")
            assert leader.error is None
            assert leader.card["services_failing"] == 1
            warnings = upkeep_warnings([leader.card.as_dict()])
            metrics = prometheus(leader.cards, None)
        assert any("leader cleaner failed" in m and "permission denied" in m for m in caplog.messages)
        assert any("1 maintenance service(s)" in w for w in warnings)
        assert 'fastjobs_maintenance_services_failing{role="leader",index="0"} 1' in metrics
    finally:
        app.close()


def test_a_backlog_nobody_serves_defers_the_rotation_only_for_its_patience(dsn: str) -> None:
    """More than max_move pending jobs of a queue nobody serves used to defer the rotation for good:
    past its patience the rotation moves them, intact, to slot 0 and rotates on."""
    columns = "id, queue, kind, args, priority, state::text, run_at, attempt, created_at"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO fastjobs_jobs_all (queue, kind, args, slot)"
            " SELECT 'nobody', 'k', jsonb_build_object('n', n), 2 FROM generate_series(1, 50) AS n"
        )
        before = conn.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall()
    config = LeaderConfig(
        retry_interval=0.1,
        rotation=RotationConfig(interval=0.1, retry=0.05, max_move=10, patience=0.5, worth=0),
    )
    app = App(dsn)
    try:
        rotations = Rotations(dsn)
        with LeaderThread(app, config) as leader:
            wait_for(lambda: rotations.count() >= 2 * SLOTS, "two whole turns of rotations", timeout=15)
            assert leader.error is None
    finally:
        app.close()
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT {columns} FROM fastjobs_jobs_all ORDER BY id").fetchall() == before
        assert conn.execute("SELECT slot, count(*) FROM fastjobs_jobs_all GROUP BY slot").fetchall() == [
            (0, 50)
        ]


def test_evacuation_moves_available_rows_to_slot_0_and_skips_rows_held(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO fastjobs_jobs_all (kind, slot) SELECT 'k', 2 FROM generate_series(1, 30)")
        config = RotationConfig(max_move=10)
        assert rotate_once(conn, config) == {"deferred": 1, "settled": 0}
        with psycopg.connect(dsn) as claim:
            claim.execute("SELECT id FROM fastjobs_jobs_all WHERE slot = 2 ORDER BY id LIMIT 5 FOR UPDATE")
            assert rotate_once(conn, RotationConfig(max_move=10, lock_timeout=0.05), evacuate=True) == {
                "gave way": 1,
                "settled": 0,
                "evacuated": 25,
            }
        assert rotate_once(conn, config, evacuate=True) == {
            "rotated": 1,
            "moved": 5,
            "settled": 0,
        }
        assert conn.execute(
            "SELECT slot, count(*) FROM fastjobs_jobs_all GROUP BY slot ORDER BY 1"
        ).fetchall() == [
            (0, 25),
            (1, 5),
        ]


def slots_bytes(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT sum(pg_total_relation_size(format('fastjobs_jobs_%s', s)::regclass))::int8"
        " FROM generate_series(1, 4) AS s"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_rotator_rotates_once_the_slots_are_worth_it_and_until_a_bursts_slot_is_emptied(dsn: str) -> None:
    """Each rotation stalls every claim for its lock (issue 22 §5): under light load a turn does not
    rotate while the rotating slots take less than `worth` bytes, and is up to date doing so. Once
    they take more (a burst), it rotates at every turn until the burst's slot is emptied, then rests."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        empty = slots_bytes(conn)
        rotator = Rotator(RotationConfig(worth=empty + 512 * 1024))
        first = current_slot(dsn)
        assert rotator.turn(conn) == ({"idle": 1}, rotator.config.interval)
        assert current_slot(dsn) == first and rotator.problem == ROTATION_OK and rotator.rotated_at == 0
        # A burst: done jobs' rows (left as dead rows by a completion) in the current slot.
        conn.execute(
            "INSERT INTO fastjobs_jobs_all (kind, args)"
            " SELECT 'k', jsonb_build_object('pad', repeat('x', 200)) FROM generate_series(1, 5000)"
        )
        conn.execute("DELETE FROM fastjobs_jobs_all")
        assert slots_bytes(conn) >= rotator.config.worth
        turns = []
        for _ in range(SLOTS + 1):
            result, _wait = rotator.turn(conn)
            turns.append(
                "rotated" if result.get("rotated") else "idle" if result.get("idle") else str(result)
            )
        # The burst's slot closes at the first rotation and is emptied at the SLOTS-th.
        assert turns == ["rotated"] * SLOTS + ["idle"], turns
        assert slots_bytes(conn) < rotator.config.worth
        assert rotator.problem == ROTATION_OK and rotator.rotated_at > 0


def test_in_process_rotators_take_turns_instead_of_each_rotating(dsn: str) -> None:
    """Each in-process Worker has its rotator: one that finds the slot moved since its last turn
    (another rotated) waits an interval, so N workers rotate as often as one leader."""
    with psycopg.connect(dsn, autocommit=True) as a, psycopg.connect(dsn, autocommit=True) as b:
        config = RotationConfig(worth=1)  # always worth it
        one, two = Rotator(config), Rotator(config)
        first = current_slot(dsn)
        turns = []
        for _ in range(4):  # turns in alternation, as the workers' jittered intervals make them
            for rotator, conn in ((one, a), (two, b)):
                result = rotator.turn(conn)[0]
                turns.append(
                    "rotated" if result.get("rotated") else "idle" if result.get("idle") else str(result)
                )
        # Their first turns know of no earlier rotation; then one rotation per round, not two.
        assert turns == ["rotated", "rotated"] + ["idle", "rotated"] * 3, turns
        assert (current_slot(dsn) - first) % SLOTS == 5 % SLOTS
        assert one.problem == two.problem == ROTATION_OK


def test_an_in_process_worker_rotates_when_no_leader_does(app: App, dsn: str) -> None:
    """fastjobs.Worker without `fastjobs run` (no master, no leader) used to never rotate: the
    rotating slots' dead rows grew without bound. It rotates from its control thread, off the hot
    loop, whenever the leader's lock is free, and not while a leader holds it."""
    config = WorkerConfig(rotation=RotationConfig(interval=0.1, retry=0.05, worth=0))
    worker = Worker(app, ["q"], config=config)
    thread = threading.Thread(target=worker.run, daemon=True)
    rotations = Rotations(dsn)
    thread.start()
    try:
        wait_for(lambda: rotations.count() >= SLOTS, "a whole turn of rotations by the worker")
        with psycopg.connect(dsn, autocommit=True) as leader:
            wait_for(
                lambda: (
                    leader.execute("SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK_KEY,)).fetchone()
                    == (True,)
                ),
                "the leader's lock",
            )
            held = rotations.count()
            threading.Event().wait(0.5)  # five of the worker's intervals: it must not rotate
            assert rotations.count() == held
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_fastjobs_stats_warns_when_the_leading_leader_cannot_rotate(dsn: str) -> None:
    """`fastjobs stats` reads the leader's slot of the masters on its host: a rotation that cannot
    work, and why, is a warning in its output (and in --json)."""
    with psycopg.connect(dsn) as conn:
        identity = database_identity(conn, dsn)
    cards = Scoreboard.create(1, identity)
    try:
        card = cards[0]
        card.claim(LEADER, 0)
        card["leading"] = 1.0
        card["rotation_problem"] = ROTATION_DEFERRED
        warnings = procs.stats_json(dsn)["warnings"]
        assert any("the rotation cannot do its work (deferred; not rotated yet)" in w for w in warnings), (
            warnings
        )
        card["rotation_problem"] = ROTATION_OK
        assert procs.stats_json(dsn)["warnings"] == []
    finally:
        cards.close(unlink=True)


def test_the_rotation_waits_out_a_fast_batch() -> None:
    """A fast batch's transaction, which locks the slots, ends within BATCH_SECONDS and a guard
    tick (its deadline, then the hand-over of a job still running): the rotation's lock waits
    longer than that, or it would give way to every batch in flight."""
    assert RotationConfig().lock_timeout > BATCH_SECONDS + GUARD_TICK


# The fastest rotation these tests run (RotationConfig(interval=0.1) above).
FASTEST_ROTATION = 0.1


def test_a_loop_trusts_its_sight_of_the_current_slot_for_less_than_three_rotations() -> None:
    """A loop claims in one rotating slot on what its claims saw within SLOT_FRESH (Planner.slots):
    four rotations bring the same slot back, and the first of them comes after the loop's sight,
    so three intervals must not fit in SLOT_FRESH, or the loop could take an old sight for new."""
    assert (SLOTS - 1) * min(RotationConfig().interval, FASTEST_ROTATION) > SLOT_FRESH


# The slowest claim from the front measured: 170 ms walking the dead entries of the rotating slots
# (bench/RESULTS.md, issue 13 session 4), rotated every 2 s, so entries that lived 4 * 2 s at most.
FRONT_WALK = 0.17
FRONT_WALK_LIFE = 8.0


def test_the_front_claims_duty_holds_at_the_rotation_interval() -> None:
    """A claim from the front walks every dead entry its rotating slots hold, and an entry lives
    SLOTS rotation intervals (its slot is emptied SLOTS turns after it became current): the walk
    grows with the interval. The planner waits that walk's time * (1 - duty) / duty before the next
    claim from the front, at most FRONT_CLAIM_MAX_WAIT; a rotation slow enough that the slowest walk
    needs a longer wait makes claims from the front cost more than FRONT_CLAIM_DUTY of the loop.
    Lengthen the interval, and the duty or the cap must be measured again."""
    walk = FRONT_WALK * SLOTS * RotationConfig().interval / FRONT_WALK_LIFE
    assert walk * (1 - FRONT_CLAIM_DUTY) / FRONT_CLAIM_DUTY <= FRONT_CLAIM_MAX_WAIT
