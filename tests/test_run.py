"""`fastjobs run MODULE` as a process: it runs jobs, stops cleanly on SIGTERM, says why it cannot start."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .helpers import jobs, query

REPO = Path(__file__).resolve().parent.parent

JOBS_MODULE = """
import time

from fastjobs import App

app = App()


@app.job(kind="echo")
def echo(n: int, pause: float = 0.0) -> None:
    print(n, flush=True)  # the test reads which jobs ran from stdout
    if pause:
        time.sleep(pause)
"""


def _module(tmp_path: Path, name: str, source: str) -> None:
    (tmp_path / name).with_suffix(".py").write_text(textwrap.dedent(source))


def _start(tmp_path: Path, dsn: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    env.pop("FASTJOBS_DSN", None)
    env.pop("DATABASE_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "run", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, so teardown can kill master and children
    )


class Lines:
    """The stdout of a process, line by line, each wait bounded (select on the raw pipe)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.pending = b""
        self.lines: list[str] = []

    def read(self, count: int, timeout: float = 20.0) -> list[str]:
        """Wait for `count` more lines (fewer if the timeout passes or the pipe closes)."""
        want = len(self.lines) + count
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while len(self.lines) < want:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    break
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    break
                *complete, self.pending = (self.pending + chunk).split(b"\n")
                self.lines.extend(line.decode() for line in complete)
        return self.lines[want - count :]

    def rest(self, out: bytes) -> list[str]:
        """Every line read so far plus `out`, what communicate() returned at exit."""
        return self.lines + (self.pending + out).decode().split()


def _finish(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> tuple[int, bytes, str]:
    """Wait for the exit; (code, the rest of stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"fastjobs run did not exit within {timeout}s; stderr:\n{err.decode()}")
    return proc.returncode, out, err.decode()


@pytest.fixture
def run(tmp_path, dsn):
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        proc = _start(tmp_path, dsn, *args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever a failed test left running
        proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_processes_jobs_and_stops_on_signal(tmp_path, app, dsn, run, sig):
    _module(tmp_path, "jobsmod", JOBS_MODULE)
    app.enqueue_many("echo", ({"n": n} for n in range(100)))

    proc = run("jobsmod")
    lines = Lines(proc)
    assert sorted(map(int, lines.read(100))) == list(range(100))
    proc.send_signal(sig)
    code, out, err = _finish(proc)

    assert code == 0, err
    assert lines.rest(out) == lines.lines  # every job ran exactly once
    assert "Traceback" not in err
    assert jobs(dsn) == []
    assert not query(dsn, "SELECT * FROM fastjobs_workers")


def test_sigterm_mid_drain_finishes_the_running_job_and_records_every_job(tmp_path, app, dsn, run):
    _module(tmp_path, "jobsmod", JOBS_MODULE)
    app.enqueue_many("echo", ({"n": n, "pause": 0.01} for n in range(500)))

    proc = run("jobsmod", "--keep-completed")
    lines = Lines(proc)
    assert lines.read(1), "no job ran"
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)

    assert code == 0, err
    ran = sorted(int(n) for n in lines.rest(out))
    rows = jobs(dsn)
    states = {r["state"] for r in rows}
    assert states <= {"completed", "available"}, f"left behind: {states}"
    completed = sorted(r["args"]["n"] for r in rows if r["state"] == "completed")
    assert completed == ran  # each job that ran is recorded, and only those
    assert 1 <= len(completed) < 500  # stopped mid-drain
    available = [r for r in rows if r["state"] == "available"]
    assert len(available) == 500 - len(completed)
    assert {(r["attempt"], r["errors"]) for r in available} == {(0, None)}
    assert not query(dsn, "SELECT * FROM fastjobs_workers")


def test_a_module_that_fails_to_import_is_named(tmp_path, run):
    _module(tmp_path, "brokenmod", 'raise RuntimeError("no config file")\n')
    code, _, err = _finish(run("brokenmod"))
    assert code != 0
    assert "brokenmod" in err
    assert "RuntimeError: no config file" in err


def test_a_missing_module_is_named(tmp_path, run):
    code, _, err = _finish(run("no_such_module_here"))
    assert code != 0
    assert "no_such_module_here" in err


def test_a_module_without_an_app_says_so(tmp_path, run):
    _module(tmp_path, "plainmod", "VALUE = 1\n")
    code, _, err = _finish(run("plainmod"))
    assert code != 0
    assert "plainmod" in err
    assert "fastjobs.App" in err
    assert "Traceback" not in err


def test_an_attribute_that_is_not_an_app_says_so(tmp_path, run):
    _module(tmp_path, "jobsmod", JOBS_MODULE)
    code, _, err = _finish(run("jobsmod:time"))
    assert code != 0
    assert "'jobsmod:time' is not a fastjobs.App" in err


def test_module_colon_attribute_picks_the_app(tmp_path, app, run):
    _module(tmp_path, "twoapps", JOBS_MODULE + "\nother = App()\n")
    app.enqueue("echo", {"n": 7})

    code, _, err = _finish(run("twoapps"))
    assert code != 0
    assert "2 fastjobs.App" in err

    proc = run("twoapps:app")
    assert Lines(proc).read(1) == ["7"]
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc)[0] == 0
