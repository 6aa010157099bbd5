"""The master: queue sharding, and `fastjobs run` as a real process tree on a real PostgreSQL.

Every handler execution inserts a row into `runs` (see tests/procs.py), so
"exactly once" is a count; the tests wait on rows, files and /proc, never on
a fixed sleep.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastjobs import App
from fastjobs.children import EXIT_BOOT_ERROR
from fastjobs.errors import ConfigurationError
from fastjobs.master import SAME_STOP_WINDOW, Master
from fastjobs.sharding import DEFAULT_CONCURRENCY, parse_queues, shard, threaded_queues

from . import procs
from .procs import count, runs, wait_for

# --- sharding: the rule shard() documents --------------------------------------------------


@pytest.mark.parametrize(
    ("queues", "processes", "plan"),
    [
        pytest.param(
            {"default": 8, "emails": 2},
            4,
            [{"default": 2, "emails": 1}, {"default": 2, "emails": 1}, {"default": 2}, {"default": 2}],
            id="default:8,emails:2-over-4",
        ),
        pytest.param({"default": 2}, 4, [{"default": 1}, {"default": 1}, {}, {}], id="concurrency<processes"),
        pytest.param(
            {"default": 10},
            4,
            [{"default": 3}, {"default": 3}, {"default": 2}, {"default": 2}],
            id="remainder-to-lowest-indexes",
        ),
        pytest.param({"default": 7}, 1, [{"default": 7}], id="one-process"),
        pytest.param(
            {"a": 1, "b": 1, "c": 1}, 2, [{"a": 1, "c": 1}, {"b": 1}], id="ties-by-name-then-least-loaded"
        ),
        pytest.param(
            {"b": 3, "a": 3}, 2, [{"a": 2, "b": 2}, {"a": 1, "b": 1}], id="equal-concurrency-by-name"
        ),
        pytest.param(
            {"default": 8, "emails": 2, "reports": 1},
            3,
            [{"default": 3, "emails": 1}, {"default": 3, "reports": 1}, {"default": 2, "emails": 1}],
            id="largest-first-onto-least-loaded",
        ),
    ],
)
def test_shard_follows_the_documented_rule(
    queues: dict[str, int], processes: int, plan: list[dict[str, int]]
) -> None:
    assert shard(queues, processes) == plan


def test_shard_invariants_over_many_configurations() -> None:
    names = ["default", "emails", "reports", "zz"]
    for processes in range(1, 7):
        for concurrencies in itertools.product([1, 2, 3, 5, 8, 13], repeat=3):
            queues = dict(zip(names, concurrencies, strict=False))
            plan = shard(queues, processes)
            assert len(plan) == processes
            for queue, concurrency in queues.items():
                shares = [p[queue] for p in plan if queue in p]
                assert sum(shares) == concurrency, (queues, processes, plan)
                assert len(shares) == min(concurrency, processes), (queues, processes, plan)
                assert max(shares) - min(shares) <= 1, (queues, processes, plan)
                assert min(shares) >= 1
            # Every worker serves something as soon as there is enough concurrency for all.
            if sum(queues.values()) >= processes:
                assert all(plan), (queues, processes, plan)


def test_parse_queues() -> None:
    assert parse_queues("default:8,emails:2", [], 4) == {"default": 8, "emails": 2}
    assert parse_queues(" default:8 , emails:2 ", [], 4) == {"default": 8, "emails": 2}
    assert parse_queues("default,emails:2", [], 3) == {"default": 3 * DEFAULT_CONCURRENCY, "emails": 2}
    # No spec: every registered queue (or "default"), DEFAULT_CONCURRENCY per process.
    assert parse_queues(None, ["a", "b"], 2) == {"a": 2 * DEFAULT_CONCURRENCY, "b": 2 * DEFAULT_CONCURRENCY}
    assert parse_queues("", [], 2) == {"default": 2 * DEFAULT_CONCURRENCY}


@pytest.mark.parametrize(
    "spec", ["default:0", "default:-1", "default:x", "default:1.5", ",emails:2", "default:2,", ":3"]
)
def test_parse_queues_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="--queues"):
        parse_queues(spec, [], 2)


def test_parse_queues_says_what_a_bad_concurrency_was() -> None:
    assert parse_queues("emails: 20", ["emails"], 2) == {"emails": 20}  # a space is no mistake
    with pytest.raises(ConfigurationError, match=r"not '20 default' \(queues are separated by commas"):
        parse_queues("emails:20 default", ["emails"], 2)


def test_a_queue_no_job_is_registered_on_is_served_with_a_warning_naming_the_close_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="fastjobs.master"):
        assert parse_queues("email:20,default", ["default", "emails"], 2) == {"email": 20, "default": 20}
    assert [r.getMessage() for r in caplog.records] == [
        "--queues: no job of this App is registered on queue 'email'; did you mean 'emails'?"
        " (its queues: default, emails)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastjobs.master"):
        parse_queues("emails:20,default", ["default", "emails"], 2)
        parse_queues("other", [], 2)  # an App with no jobs: nothing to compare with
    assert caplog.records == []


def test_only_queues_given_a_concurrency_run_sync_jobs_on_threads() -> None:
    assert threaded_queues("default:8, emails ,reports:1") == {"default", "reports"}
    assert threaded_queues(None) == threaded_queues("") == frozenset()


def test_parse_queues_rejects_a_queue_named_twice() -> None:
    with pytest.raises(ConfigurationError, match="--queues"):
        parse_queues("default:8,emails:2,default:1", [], 2)


def test_master_needs_a_process() -> None:
    with pytest.raises(ConfigurationError, match="--processes"):
        Master(App("postgresql://unused"), 0, {"default": 1})


def test_the_worker_timeout_must_exceed_the_beat() -> None:
    with pytest.raises(ConfigurationError, match="--worker-timeout must be at least 2 seconds"):
        Master(App("postgresql://unused"), 1, {"default": 1}, worker_timeout=1.0)


# --- fastjobs run as a process tree ----------------------------------------------------------


def jobs_left(db: psycopg.Connection[Any]) -> list[tuple[int, str, int, str | None]]:
    """(n, state, attempt, attempted_by) of every job still in the table."""
    return db.execute(
        "SELECT (args->>'n')::int, state::text, attempt, attempted_by FROM fastjobs_jobs_all ORDER BY 1"
    ).fetchall()


def test_jobs_enqueued_before_and_during_a_run_all_finish_exactly_once(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    app.enqueue_many("record", ({"n": n} for n in range(300)))
    master = masters.start("--processes", "2")
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") > 0, "the first execution")
    # While it runs: bulk and single enqueues, the latter each its own NOTIFY.
    app.enqueue_many("record", ({"n": n} for n in range(300, 550)))
    for n in range(550, 600):
        app.enqueue("record", {"n": n})
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") >= 600, "600 executions")
    wait_for(lambda: not jobs_left(db), "the table to empty")
    assert master.stop() == 0, master.stderr()
    assert runs(db) == Counter(range(600))
    assert len(master.forks()) == 3  # two workers and the leader, no restarts
    assert "fastjobs: stopped" in master.stderr()


def test_sigterm_mid_drain_loses_nothing_and_runs_nothing_twice(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    total, grace = 2000, 10.0
    app.enqueue_many("record", ({"n": n, "sleep": 0.005} for n in range(total)))
    master = masters.start("--processes", "4", "--grace", str(grace))
    wait_for(lambda: count(db, "SELECT count(*) FROM runs") >= 200, "200 executions")
    master.signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert master.wait(grace) == 0, master.stderr()
    assert time.monotonic() - stopped < grace
    assert "grace period over" not in master.stderr()

    ran = runs(db)
    left = jobs_left(db)
    assert ran and left, "the stop should come mid-drain"
    assert max(ran.values()) == 1, "a job ran twice"
    # Each job either ran once and is gone, or never ran and is available as new.
    assert [row for row in left if row[1:3] != ("available", 0)] == []
    assert {row[0] for row in left}.isdisjoint(ran)
    assert sorted([*ran, *(row[0] for row in left)]) == list(range(total))
    assert count(db, "SELECT count(*) FROM fastjobs_workers") == 0  # clean stops deregister

    again = masters.start("--processes", "6", "--batch-max", "50")
    wait_for(lambda: not jobs_left(db), "the restarted master to drain the rest")
    assert again.stop() == 0, again.stderr()
    assert runs(db) == Counter(range(total))


def test_a_killed_worker_is_replaced_and_the_jobs_keep_draining(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    total = 400
    app.enqueue_many("record", ({"n": n, "sleep": 0.005} for n in range(total)))
    master = masters.start("--processes", "2")
    victim = master.wait_child("fastjobs: worker 1 ")
    wait_for(
        lambda: count(db, "SELECT count(*) FROM runs WHERE pid = %s", victim) > 0, "worker 1 to run jobs"
    )
    os.kill(victim, signal.SIGKILL)

    master.wait_stderr(rf"worker 1 \(pid {victim}\) was killed by signal 9; restarting")
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(victim,))
    # The master's shared memory shows the new process in worker 1's card.
    mine = wait_for(
        lambda: [m for m in procs.stats_json(app.dsn)["masters"] if m["master_pid"] == master.pid],
        "this master in `fastjobs stats --json`",
    )
    cards = {int(p["index"]): p for p in mine[0]["processes"]}
    assert int(cards[0]["pid"]) == heir and cards[0]["role"] == 1

    # The master gives back at once what the victim had claimed and not started (and what it
    # ran but had not recorded yet): everything finishes but the job it was running, which
    # stays 'running' for the rescuer.
    def drained() -> bool:
        left = jobs_left(db)
        return len(left) <= 1 and all(
            state == "running" and f":{victim}:" in (by or "") for _, state, _, by in left
        )

    # Bounded well below the rescuer's 15 s: a master that does not release fails here.
    wait_for(drained, "every job but the one the killed worker was running to finish", timeout=8)
    assert master.stop() == 0, master.stderr()
    stuck = {row[0] for row in jobs_left(db)}
    ran = runs(db)
    by_victim = {n for (n,) in db.execute("SELECT n FROM runs WHERE pid = %s", (victim,))}
    assert max(ran.values()) <= 2
    assert {n for n, times in ran.items() if times > 1} <= by_victim  # at least once: only its jobs again
    assert set(range(total)) - stuck <= set(ran)
    # Two workers, the leader, one replacement, and the releaser of the victim's jobs.
    assert len(master.forks()) == 5


@pytest.mark.parametrize(
    ("module", "source", "message"),
    [
        (
            "brokenjobs",
            "import fastjobs\nraise RuntimeError('boom at import')\n",
            r"cannot import 'brokenjobs'.*boom at import",
        ),
        (
            "missingdep",
            "import fastjobs_no_such_dependency\n",
            r"cannot import 'missingdep'.*fastjobs_no_such_dependency",
        ),
        ("nosuchmodule", None, r"cannot import 'nosuchmodule'"),
        (
            "app/fjjobs.py",
            None,
            r"cannot import 'app/fjjobs\.py'.*name the module, .*: app\.fjjobs, not its file",
        ),
        ("noapp", "import fastjobs\n", r"module 'noapp' holds 0 fastjobs\.App"),
        ("fjjobs:missing", None, r"'fjjobs:missing' is not a fastjobs\.App"),
    ],
)
def test_a_module_that_cannot_load_fails_fast_and_forks_nothing(
    masters: procs.Masters, tmp_path: Path, module: str, source: str | None, message: str
) -> None:
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    master = masters.start("--processes", "2", module=module)
    code = master.wait(15)
    assert code != 0
    assert re.search(message, master.stderr()), master.stderr()
    assert "Traceback" not in master.stderr()
    assert master.forks() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--queues", "default:0"], "--queues"),
        (["--processes", "0"], "--processes"),
        (["--grace", "-1"], "grace period must be at least 0"),
        (["--grace", "nan"], "grace period must be at least 0"),
    ],
)
def test_bad_options_fail_fast_and_fork_nothing(
    masters: procs.Masters, args: list[str], message: str
) -> None:
    master = masters.start(*args)
    assert master.wait(15) != 0
    assert message in master.stderr()
    assert master.forks() == []


def test_a_database_without_the_schema_stops_the_master_with_the_boot_error_code(
    masters: procs.Masters, empty_dsn: str
) -> None:
    master = masters.start("--processes", "2", dsn=empty_dsn)
    assert master.wait(15) == EXIT_BOOT_ERROR, master.stderr()
    err = master.stderr()
    assert "the fastjobs schema is at none" in err and "run `fastjobs migrate`" in err
    assert "fastjobs: stopped" not in err  # nothing had started
    assert "restarting" not in err and "Traceback" not in err
    assert master.forks() == []  # the master checks the schema before forking
    assert procs.children(master.pid) == []


def test_process_titles_and_the_printed_plan(masters: procs.Masters) -> None:
    master = masters.start("--processes", "3", "--queues", "default:4,emails:1")
    # default:4 over 3 workers: 2,1,1; emails:1 goes to the least loaded, lowest index: worker 2.
    master.wait_stderr(r"worker 3: default:1\n")
    err = master.stderr()
    assert "worker 1: default:2\n" in err
    assert "worker 2: default:1, emails:1\n" in err
    assert "sync jobs of default, emails: as many at once per worker as its share, on threads\n" in err
    w1 = master.wait_child("fastjobs: worker 1 [default]")
    w2 = master.wait_child("fastjobs: worker 2 [default,emails]")
    w3 = master.wait_child("fastjobs: worker 3 [default]")
    leader = master.wait_child("fastjobs: leader")
    assert sorted(master.children()) == sorted([w1, w2, w3, leader])
    wait_for(lambda: procs.title(master.pid).startswith("fastjobs: master [3 workers]"), "the master's title")
    # Each worker appends its live rate once a second.
    wait_for(
        lambda: re.fullmatch(r"fastjobs: worker 2 \[default,emails\] [\d,]+ jobs/s", procs.title(w2)),
        "worker 2's rate in its title",
    )
    assert master.stop() == 0, master.stderr()


def test_the_title_of_a_master_of_one_worker_reads_one_worker(masters: procs.Masters) -> None:
    """The quick start's master, as ps and top show it: "[1 worker]", not "[1 workers]"."""
    master = masters.start("--processes", "1")
    wait_for(lambda: procs.title(master.pid).startswith("fastjobs: master [1 worker] "), "the master's title")
    assert master.stop() == 0, master.stderr()


@pytest.mark.parametrize("kind", ["record", "record_timeout", "record_async"])
def test_a_second_signal_stops_now_and_records_the_running_job(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any], kind: str
) -> None:
    job_id = app.enqueue(kind, {"n": 1, "sleep": 30})
    master = masters.start("--processes", "1", "--grace", "60")
    wait_for(lambda: runs(db)[1] == 1, "the 30-second job to start")
    master.signal(signal.SIGTERM)
    master.wait_stderr("stopping \\(grace 60s\\)")
    # The master's window starts when it handles the signal, before it says so: timed from the
    # line, not from the send (a master slow to run its handler would still be in the window).
    signalled = time.monotonic()
    # A second signal within the window is the same stop; after it, a deliberate "stop now".
    wait_for(lambda: time.monotonic() - signalled > SAME_STOP_WINDOW, "the same-stop window to pass")
    master.signal(signal.SIGINT)
    started = time.monotonic()
    master.wait(10)
    assert time.monotonic() - started < 5, master.stderr()
    state, attempt, errors = db.execute(
        "SELECT state::text, attempt, errors FROM fastjobs_jobs_all WHERE id = %s", (job_id,)
    ).fetchone() or (None, None, None)
    assert state in ("available", "retryable"), (state, master.stderr())
    assert attempt == 1 and errors, "the interrupted attempt is recorded"
    assert "stopped now (a second stop signal)" in errors[0]["error"], errors
    # A stop asked for is no crash: one line, no traceback.
    assert "stopping now" in master.stderr() and "stopped now" in master.stderr()
    assert "Traceback" not in master.stderr() and "crashed" not in master.stderr(), master.stderr()


def test_the_grace_period_ends_with_sigkill(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    job_id = app.enqueue("record", {"n": 1, "sleep": 30})
    master = masters.start("--processes", "1", "--grace", "1")
    wait_for(lambda: runs(db)[1] == 1, "the 30-second job to start")
    master.signal(signal.SIGTERM)
    started = time.monotonic()
    master.wait(10)
    assert time.monotonic() - started < 5
    assert "grace period over: sending SIGKILL" in master.stderr()
    # Killed mid-job: nothing recorded it, so it waits for the rescuer.
    assert db.execute("SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,)).fetchone() == (
        "running",
    )


def test_the_watchdog_replaces_a_worker_hung_in_c(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    hung_id = app.enqueue("hang", {"n": -1})
    master = masters.start("--processes", "1", "--worker-timeout", "2")
    wait_for(lambda: runs(db)[-1] == 1, "the hanging job to start")
    hung = master.wait_child("fastjobs: worker 1 ")
    master.wait_stderr(
        rf"worker 1 \(pid {hung}\) sent no heartbeat for 2s \(hung or stopped\); killing it", timeout=15
    )
    master.wait_stderr(rf"worker 1 \(pid {hung}\) was killed by signal 9; restarting")
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(hung,))
    app.enqueue_many("record", ({"n": n} for n in range(20)))
    wait_for(
        lambda: count(db, "SELECT count(*) FROM runs WHERE pid = %s", heir) == 20,
        "the new worker to run 20 jobs",
    )
    # The hung job is left to the rescuer, still claimed by the killed process.
    state, by = db.execute(
        "SELECT state::text, attempted_by FROM fastjobs_jobs_all WHERE id = %s", (hung_id,)
    ).fetchone() or (None, None)
    assert state == "running" and f":{hung}:" in (by or "")
    assert master.stop() == 0, master.stderr()
    assert f"(pid {heir}) sent no heartbeat" not in master.stderr()  # an idle worker is not hung


def test_a_long_sync_job_outlasting_the_worker_timeout_runs_once_to_completion(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    """A 10 s job under --worker-timeout 3: its worker's heartbeat thread keeps beating, so it lives."""
    job_id = app.enqueue("record", {"n": 1, "sleep": 10.0})
    master = masters.start("--processes", "1", "--worker-timeout", "3")
    wait_for(lambda: runs(db)[1] == 1, "the long job to start")
    began = time.monotonic()
    wait_for(
        lambda: count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE id = %s", job_id) == 0,
        "the long job to complete",
        timeout=20,
    )
    assert time.monotonic() - began > 8.0  # it really ran its 10 s
    assert runs(db) == Counter({1: 1})
    assert "sent no heartbeat" not in master.stderr()
    assert "restarting" not in master.stderr()
    assert master.stop() == 0, master.stderr()
    assert len(master.forks()) == 2  # one worker and the leader, never replaced


def test_a_stopped_worker_is_killed_and_replaced_within_the_worker_timeout(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
) -> None:
    app.enqueue("record", {"n": -1, "sleep": 30.0})
    master = masters.start("--processes", "1", "--worker-timeout", "3", "--rescue-after", "5")
    wait_for(lambda: runs(db)[-1] == 1, "the long job to start")
    stopped = master.wait_child("fastjobs: worker 1 ")
    os.kill(stopped, signal.SIGSTOP)
    frozen = time.monotonic()
    master.wait_stderr(
        rf"worker 1 \(pid {stopped}\) sent no heartbeat for 3s \(hung or stopped\); killing it"
    )
    # The timeout, plus at most a second of beat and a quarter of a watchdog turn.
    assert time.monotonic() - frozen < 3 + 2.5
    master.wait_stderr(rf"worker 1 \(pid {stopped}\) was killed by signal 9; restarting")
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(stopped,))
    app.enqueue_many("record", ({"n": n} for n in range(10)))
    wait_for(
        lambda: count(db, "SELECT count(*) FROM runs WHERE pid = %s", heir) >= 10,
        "the new worker to run the jobs enqueued after the kill",
    )
    assert master.stop() == 0, master.stderr()


def test_a_killed_leader_is_replaced_and_elected_again(masters: procs.Masters) -> None:
    master = masters.start("--processes", "1")
    leader = master.wait_child("fastjobs: leader")
    master.wait_stderr(rf"leader elected \(pid {leader}\)")
    os.kill(leader, signal.SIGKILL)
    master.wait_stderr(rf"leader \(pid {leader}\) was killed by signal 9; restarting")
    heir = master.wait_child("fastjobs: leader", exclude=(leader,))
    # Its session died with it, so the advisory lock is free for the new one.
    master.wait_stderr(rf"leader elected \(pid {heir}\)")
    assert master.stop() == 0, master.stderr()
    assert len(master.forks()) == 3


# The worker checks its LISTEN connection every LISTENER_CHECK_INTERVAL (30 s)
# of idling; this app module shortens that, so the check happens within a
# second instead of making the test wait half a minute.
FAST_CHECK = """
import fastjobs.worker
from fjjobs import app

fastjobs.worker.LISTENER_CHECK_INTERVAL = 0.2
"""


def test_an_idle_worker_survives_its_listener_health_check(
    masters: procs.Masters, tmp_path: Path, app: App, db: psycopg.Connection[Any]
) -> None:
    (tmp_path / "fastcheck.py").write_text(FAST_CHECK)
    master = masters.start("--processes", "1", module="fastcheck")
    wait_for(
        lambda: count(
            db,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND query LIKE '%pg_notify(''fastjobs_ping''%'",
        ),
        "the worker's first listener health check",
    )
    app.enqueue("record", {"n": 1})
    wait_for(lambda: runs(db)[1] == 1, "the job enqueued after the health check to run", timeout=3)
    assert master.stop(10) == 0, master.stderr()


def test_the_children_of_a_killed_master_exit(masters: procs.Masters) -> None:
    master = masters.start("--processes", "2")
    family = [
        master.wait_child("fastjobs: worker 1 "),
        master.wait_child("fastjobs: worker 2 "),
        master.wait_child("fastjobs: leader"),
    ]
    os.kill(master.pid, signal.SIGKILL)
    master.wait(10)
    # An idle worker turns its loop every second: ample time to see its parent is gone.
    wait_for(lambda: not any(map(procs.alive, family)), "the orphaned children to exit", timeout=3)
