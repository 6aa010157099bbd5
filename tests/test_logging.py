"""Logging: the library is silent until configured; `fastjobs` logs as text or JSON lines.

Every module logs on its own logger under "fastjobs"; the library adds only a
NullHandler. The CLI alone installs a handler (--log-level, --log-format);
records about one job carry job_id, kind, queue, attempt and worker.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastjobs import App
from fastjobs.cli import main
from fastjobs.logs import duration, plural

from . import procs
from .helpers import drain, jobs, query

# The structured fields of every record about one job.
JOB_FIELDS = ("job_id", "kind", "queue", "attempt", "worker")

FAILING = "fjfailing"
FAILING_JOBS = '''
"""A job that always fails, for the logging tests."""

import fastjobs

app = fastjobs.App()


@app.job("boom", retry=lambda attempt, r: 0.0)
def boom(n):
    raise ValueError(f"boom {n}")


class Abort(BaseException):
    pass


@app.job("abort")
def abort(n):
    raise Abort(f"abort {n}")
'''

# Imports fastjobs, enqueues, and runs a Worker in-process off the main thread
# (which logs a warning about timeouts) on a failing job and a job of an
# unknown kind: every one of them logs, at WARNING or above.
EMBEDDED = """
import logging
import sys
import threading

if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")

import fastjobs

app = fastjobs.App(sys.argv[1])


@app.job(kind="boom", timeout=5)
def boom(n):
    raise ValueError(f"boom {n}")


app.enqueue("boom", {"n": 1}, max_attempts=1)
app.declare("elsewhere")  # its handler runs in another service: this worker fails it
app.enqueue("elsewhere", {})
worker = fastjobs.Worker(app, ["default"], exit_when_empty=True)
thread = threading.Thread(target=worker.run)
thread.start()
thread.join(20)
assert not thread.is_alive(), "the worker did not drain"
# "elsewhere" fails again if its ~1 s backoff ends before the drain does (a busy machine)
assert worker.loop.failed >= 2 and worker.loop.discarded == 1, (worker.loop.failed, worker.loop.discarded)
app.close()
"""


def _embedded(tmp_path: Path, dsn: str, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED)
    return subprocess.run(
        [sys.executable, str(script), dsn, mode], capture_output=True, text=True, timeout=30, check=False
    )


def test_an_application_embedding_fastjobs_sees_nothing_unless_it_configures_logging(
    tmp_path: Path, dsn: str
) -> None:
    quiet = _embedded(tmp_path, dsn, "unconfigured")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert quiet.stdout == ""
    # The same run with logging configured: the records were there all along. On an empty
    # table: the first run's retried job, due again after about a second, would be run too.
    query(dsn, "DELETE FROM fastjobs_jobs_all")
    loud = _embedded(tmp_path, dsn, "configured")
    assert loud.returncode == 0, loud.stderr
    assert "WARNING fastjobs.handlers this worker runs off the main thread" in loud.stderr
    assert re.search(
        r"ERROR fastjobs\.handlers job \d+ \(boom\) attempt 1 failed; discarded: ValueError: boom 1",
        loud.stderr,
    )
    assert re.search(
        r"WARNING fastjobs\.handlers job \d+ \(elsewhere\) attempt 1 failed; retrying in", loud.stderr
    )


def test_failure_records_carry_the_job_its_queue_and_the_worker(
    app: App, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    @app.job(kind="boom")
    def boom(n: int) -> None:
        raise ValueError(f"boom {n}")

    # The job's own queue, not its kind's default: a worker serving two queues tells them apart.
    ids = {
        queue: app.enqueue("boom", {"n": 1}, queue=queue, max_attempts=1) for queue in ("default", "other")
    }
    app.declare("stranger")  # handled elsewhere: this worker fails it
    stranger = app.enqueue("stranger", {}, queue="other")
    worker = drain(app, ["default", "other"], worker_id="test-worker")
    assert worker.loop is not None and worker.loop.failed >= 3

    # The first attempts' (the stranger fails again if its ~1 s backoff ends before the drain does).
    fields = sorted(
        (r.levelname, r.name, *(getattr(r, f) for f in JOB_FIELDS))
        for r in caplog.records
        if getattr(r, "job_id", None) is not None and getattr(r, "attempt", None) == 1
    )
    assert fields == sorted(
        [
            ("ERROR", "fastjobs.handlers", ids["default"], "boom", "default", 1, "test-worker"),
            ("ERROR", "fastjobs.handlers", ids["other"], "boom", "other", 1, "test-worker"),
            ("WARNING", "fastjobs.handlers", stranger, "stranger", "other", 1, "test-worker"),
        ]
    )
    assert [row["state"] for row in jobs(dsn) if row["id"] == stranger] == ["retryable"]


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of `text` as a JSON object (a line that is not one fails the test)."""
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def masters(tmp_path: Path, dsn: str) -> Iterator[procs.Masters]:
    (tmp_path / f"{FAILING}.py").write_text(textwrap.dedent(FAILING_JOBS))
    with procs.Masters(tmp_path, dsn) as m:
        yield m


def test_fastjobs_run_logs_json_lines_with_the_fields_of_a_failed_job(
    masters: procs.Masters, app: App, dsn: str
) -> None:
    master = masters.start("--processes", "1", module=FAILING, options=("--log-format", "json"))
    master.wait_stderr(r'"leader elected')
    job_id = app.enqueue("boom", {"n": 7}, max_attempts=2)
    master.wait_stderr(rf'"job_id": {job_id}, .*"attempt": 2')
    assert master.stop() == 0, master.stderr()

    records = _json_lines(master.stderr())
    failed = [r for r in records if r.get("job_id") == job_id]
    assert [(r["level"], r["attempt"]) for r in failed] == [("WARNING", 1), ("ERROR", 2)]
    for record in failed:
        assert set(record) >= {"time", "level", "logger", "message", *JOB_FIELDS}
        assert (record["logger"], record["kind"], record["queue"]) == ("fastjobs.handlers", "boom", "default")
        assert re.fullmatch(r"[^:]+:\d+:[0-9a-f]{16}", record["worker"]), record["worker"]
        assert record["message"].startswith(f"job {job_id} (boom) attempt {record['attempt']} failed")
        assert record["message"].endswith(": ValueError: boom 7")
    # Lifecycle records of every process, JSON too: the master, the leader, the CLI's last word.
    messages = [(r["logger"], r["level"], r["message"]) for r in records]
    assert ("fastjobs.master", "INFO", "stopping (grace 30s)") in messages
    assert messages[-1] == ("fastjobs.cli", "INFO", "stopped")
    assert {r["pid"] for r in failed} < set(master.forks())


def test_a_crashed_worker_logs_its_traceback(masters: procs.Masters, app: App) -> None:
    master = masters.start("--processes", "1", module=FAILING, options=("--log-format", "json"))
    job_id = app.enqueue("abort", {"n": 5}, max_attempts=1)
    victim = int(master.wait_stderr(r'"worker 1 \(pid (\d+)\) exited with 1; restarting')[1])
    assert master.stop() == 0, master.stderr()
    records = _json_lines(master.stderr())
    [crash] = [r for r in records if r["message"] == f"worker 1 (pid {victim}) crashed"]
    assert (crash["logger"], crash["level"], crash["pid"]) == ("fastjobs.master", "ERROR", victim)
    assert crash["exc"].startswith("Traceback (most recent call last):")
    assert crash["exc"].endswith("Abort: abort 5")
    [job] = [r for r in records if r.get("job_id") == job_id]
    assert (job["level"], job["kind"], job["attempt"], job["pid"]) == ("ERROR", "abort", 1, victim)
    assert job["message"] == f"job {job_id} (abort) attempt 1 failed; discarded: Abort: abort 5"


def test_fastjobs_run_logs_text_as_before(masters: procs.Masters, app: App) -> None:
    master = masters.start("--processes", "1", module=FAILING)
    master.wait_stderr(r"fastjobs: leader elected \(pid \d+\)\n")
    job_id = app.enqueue("boom", {"n": 3}, max_attempts=2)
    master.wait_stderr(rf"fastjobs: job {job_id} \(boom\) attempt 2 failed; discarded: ValueError: boom 3\n")
    assert master.stop() == 0, master.stderr()
    err = master.stderr()
    assert re.search(
        rf"^fastjobs: job {job_id} \(boom\) attempt 1 failed; retrying in 0s: ValueError: boom 3$", err, re.M
    )
    assert re.search(
        r"^fastjobs: master pid \d+, 1 worker \+ leader, 2 job kinds, \w+ implementation$", err, re.M
    )
    assert "fastjobs:   worker 1: default:10\n" in err
    assert err.endswith("fastjobs: stopping (grace 30s)\nfastjobs: stopped\n")
    assert all(line.startswith("fastjobs: ") for line in err.splitlines()), err


def test_log_level_warning_keeps_only_the_trouble(masters: procs.Masters, app: App) -> None:
    master = masters.start("--processes", "1", module=FAILING, options=("--log-level", "warning"))
    job_id = app.enqueue("boom", {"n": 4}, max_attempts=2)
    master.wait_stderr(rf"fastjobs: job {job_id} \(boom\) attempt 2 failed; discarded")
    assert master.stop() == 0, master.stderr()
    err = master.stderr()
    assert f"fastjobs: job {job_id} (boom) attempt 1 failed; retrying" in err
    for info in ("master pid", "worker 1: default", "leader elected", "stopping (grace", "stopped"):
        assert info not in err, err


def test_main_in_process_logs_through_its_own_handler_and_leaves_logging_as_it_was(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("fastjobs")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert main(["--dsn", dsn, "--log-format", "json", "jobs", "show", "424242"]) == 1
    out, err = capsys.readouterr()
    [record] = _json_lines(err)
    assert (out, record["level"], record["logger"], record["message"]) == (
        "",
        "ERROR",
        "fastjobs.cli",
        "no job with id 424242",
    )
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    assert main(["--dsn", dsn, "jobs", "show", "424242"]) == 1
    assert capsys.readouterr().err == "fastjobs: no job with id 424242\n"


def test_a_bad_log_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for option in (["--log-level", "chatty"], ["--log-format", "xml"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*option, "stats"])
        assert exit_info.value.code == 2
        assert f"argument {option[0]}: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.35, "350ms"),
        (1.09701, "1.1s"),
        (2.0, "2s"),
        (15.2, "15s"),
        (59.6, "1m"),
        (125, "2m 5s"),
        (3600, "1h"),
        (12_000, "3h 20m"),
        (187_000, "2d 3h"),
    ],
)
def test_delays_read_as_people_write_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_counts_agree_with_their_nouns() -> None:
    assert [plural(n, "job kind") for n in (0, 1, 2, 1000)] == [
        "0 job kinds",
        "1 job kind",
        "2 job kinds",
        "1,000 job kinds",
    ]
    assert plural(1, "process", "processes") == "1 process"
    assert plural(3, "process", "processes") == "3 processes"


def test_the_cluster_view_of_one_host_says_one_host(capsys: pytest.CaptureFixture[str]) -> None:
    """The tutorial's `fastjobs stats` on one machine: "1 host", not "1 host(s)"."""
    from fastjobs.cli import stats as stats_command
    from fastjobs.report import ClusterHost, ClusterWorker

    worker = ClusterWorker("vm:4811:9f3c1a2b7d0e4c55", 4811, ["emails"], 60.0, 0.4, False, 1.0, {})
    host = ClusterHost("vm", [worker], ["emails"], 0, 0.4, 1, {"completed": 1, "failed": 0}, [])
    stats_command._print_cluster([host])
    assert "\ncluster: 1 host with workers registered in this database\n" in capsys.readouterr().out
