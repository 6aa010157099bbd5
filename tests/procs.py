"""Real `fastjobs run` masters for the tests: a jobs module, the subprocess, its children, cleanup.

Each master runs `python -m fastjobs.cli` in a new session (so one killpg
reaches every process it forked), with its stderr in a file the test polls.
A sitecustomize on PYTHONPATH logs every os.fork() of the master, so a test
can count forks ("nothing forked", "no restart loop") instead of guessing.
Tests wait on conditions with `wait_for`, never on a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from fastjobs.scoreboard import shm_dir

T = TypeVar("T")

DEADLINE = 30.0
MODULE = "fjjobs"

# The handlers every master test runs. Each execution inserts one row into
# `runs` of the test database before doing anything else, so "exactly once"
# is a count. The connection is opened lazily in the process that runs the
# handler: the master imports this module before forking and must not share
# a socket with its children.
JOBS = '''
"""Handlers for the master tests: each execution is one row of `runs`."""

import asyncio
import ctypes
import os
import signal
import time

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


@app.job("record")
def record(n, sleep=0.0):
    _record(n)
    if sleep:
        time.sleep(sleep)


@app.job("record_timeout", timeout=120)
def record_timeout(n, sleep=0.0):
    _record(n)
    if sleep:
        time.sleep(sleep)


@app.job("record_async")
async def record_async(n, sleep=0.0):
    _record(n)
    if sleep:
        await asyncio.sleep(sleep)


@app.job("hang")
def hang(n):
    """Hang in C holding the GIL, where no Python code (handler, thread) can run: only SIGKILL ends it."""
    _record(n)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGALRM})
    r, w = os.pipe()  # nobody writes; w stays open so the read never sees EOF
    # Through PyDLL, which keeps the GIL across the call (os.read would release it).
    ctypes.PyDLL(None).read(r, ctypes.create_string_buffer(1), 1)
'''

SITECUSTOMIZE = """
import os

_log = os.environ.get("FJ_TEST_FORK_LOG")
if _log:
    def _forked():
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"%d\\n" % os.getpid())
        os.close(fd)

    os.register_at_fork(after_in_child=_forked)
"""


def wait_for(
    predicate: Callable[[], T | None], what: str, timeout: float = DEADLINE, interval: float = 0.02
) -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def cli(dsn: str, *args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess[str]:
    """Run one short `fastjobs` command to completion."""
    return subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def stats_json(dsn: str, *args: str) -> dict[str, Any]:
    result = cli(dsn, "stats", "--json", *args)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def create_runs_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE runs (n int NOT NULL, pid int NOT NULL, at timestamptz DEFAULT clock_timestamp())"
        )


def title(pid: int) -> str:
    """The process title as `ps` shows it (setproctitle rewrites /proc/<pid>/cmdline)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def children(pid: int) -> list[int]:
    """Live children of `pid`, from every thread's /proc children list."""
    found: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(found)


class Master:
    """One `fastjobs run` subprocess."""

    def __init__(
        self,
        cwd: Path,
        dsn: str,
        args: list[str],
        module: str,
        name: str,
        wrapper: tuple[str, ...] = (),
        options: tuple[str, ...] = (),
    ) -> None:
        self.cwd = cwd
        self.stderr_path = cwd / f"{name}.stderr"
        self.fork_log = cwd / f"{name}.forks"
        env = dict(os.environ)
        env["FJ_TEST_RUNS_DSN"] = dsn
        env["FJ_TEST_FORK_LOG"] = str(self.fork_log)
        hooks = cwd / "hooks"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), env.get("PYTHONPATH")) if p)
        cmd = [*wrapper, sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, *options, "run", *args, module]
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                start_new_session=True,
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_stderr(self, pattern: str, timeout: float = DEADLINE) -> re.Match[str]:
        """Wait until stderr matches the regular expression `pattern`."""
        return wait_for(
            lambda: re.search(pattern, self.stderr()),
            f"{pattern!r} on the master's stderr:\n{self.stderr()}",
            timeout,
        )

    def forks(self) -> list[int]:
        """Pids of every process the master forked so far."""
        if not self.fork_log.exists():
            return []
        return [int(line) for line in self.fork_log.read_text().split()]

    def children(self) -> list[int]:
        return children(self.pid)

    def titled(self, prefix: str) -> list[int]:
        """Live children whose title starts with `prefix`."""
        return [pid for pid in self.children() if title(pid).startswith(prefix)]

    def wait_child(self, prefix: str, exclude: tuple[int, ...] = (), timeout: float = DEADLINE) -> int:
        """The pid of a live child titled `prefix...`, waiting for one not in `exclude`."""
        pids = wait_for(
            lambda: [p for p in self.titled(prefix) if p not in exclude],
            f"a child titled {prefix!r} (besides {exclude}); children: "
            f"{[(p, title(p)) for p in self.children()]}",
            timeout,
        )
        return pids[0]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = DEADLINE) -> int:
        """Wait for the master to exit; its exit code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the master did not exit within {timeout:g}s; stderr:\n{self.stderr()}"
            ) from None

    def stop(self, timeout: float = DEADLINE) -> int:
        """A graceful SIGTERM, then wait for the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the master and everything it forked (its process group), and its stats file.

        The group is signalled only while it is certainly still ours: the
        master not yet reaped, or one of its forks still in the group.
        """
        if self.proc.returncode is None or any(pgrp(pid) == self.pid for pid in self.forks()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # A master killed by SIGKILL cannot remove its shared-memory file.
        for path in [
            *shm_dir().glob(f"fastjobs-{self.pid}-*.stats"),
            shm_dir() / f"fastjobs-{self.pid}.stats",
        ]:
            path.unlink(missing_ok=True)


def pgrp(pid: int) -> int | None:
    """The process group of a live (not zombie) process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[2])


def alive(pid: int) -> bool:
    return pgrp(pid) is not None


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`: what is left of a master's session."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pgrp(int(entry.name)) == pgid:
            found.append(int(entry.name))
    return sorted(found)


class Masters:
    """Starts masters in one directory holding the jobs module; kills all of them on exit."""

    def __init__(self, cwd: Path, dsn: str) -> None:
        self.cwd = cwd
        self.dsn = dsn
        self.started: list[Master] = []
        (cwd / f"{MODULE}.py").write_text(textwrap.dedent(JOBS))
        (cwd / "hooks").mkdir(exist_ok=True)
        (cwd / "hooks" / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def start(
        self,
        *args: str,
        module: str = MODULE,
        dsn: str | None = None,
        wrapper: tuple[str, ...] = (),
        options: tuple[str, ...] = (),
    ) -> Master:
        """`fastjobs OPTIONS run ARGS MODULE`, under `wrapper` (a command that runs the rest) if given."""
        name = f"master{len(self.started)}"
        master = Master(self.cwd, dsn or self.dsn, list(args), module, name, wrapper, options)
        self.started.append(master)
        return master

    def close(self) -> None:
        for master in self.started:
            master.kill()

    def __enter__(self) -> Masters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count(conn: psycopg.Connection[Any], query: str, *params: Any) -> int:
    row = conn.execute(query, params or None).fetchone()
    assert row is not None
    return int(row[0])


def runs(db: psycopg.Connection[Any]) -> Counter[int]:
    """How many times each job (by its `n`) was executed."""
    return Counter({n: c for n, c in db.execute("SELECT n, count(*) FROM runs GROUP BY n")})
