"""The README as used: its Python examples run, and every option its command lines name exists."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psycopg
import pytest

from fastjobs.testing import databases

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.S)
# A block whose first line names a file (`# jobs.py`) is a file of the tutorial, run by
# test_the_tutorial_runs_as_written; a block that defines tests is a test module of a user's
# suite, which pytest runs; every other Python block is a script of its own.
FILE_NAME = re.compile(r"# (\w+\.py)\n")
PYTEST = [code for lang, code in BLOCKS if lang == "python" and "\ndef test_" in code]
PYTHON = [
    code for lang, code in BLOCKS if lang == "python" and code not in PYTEST and not FILE_NAME.match(code)
]
TUTORIAL = README.read_text().split("## Your first job in five minutes\n")[1].split("\n## ")[0]
COMMANDS = [
    line.split("#")[0].strip()
    for lang, code in BLOCKS
    if lang == "sh"
    for line in code.splitlines()
    if line.strip().startswith("fastjobs ")
]


def test_the_readme_has_examples():
    assert PYTHON and PYTEST and COMMANDS


@pytest.mark.parametrize("code", PYTHON, ids=[f"python-{i}" for i in range(len(PYTHON))])
def test_a_python_example_runs(dsn, tmp_path, code):
    """Each example runs as its own script against a fresh database (with the `users` table the
    first one writes to), with no DSN but FASTJOBS_DSN, and every job it enqueues is there."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE users (id int PRIMARY KEY, email text)")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FASTJOBS_TEST_DSN")}
    env["FASTJOBS_DSN"] = dsn
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:
        enqueued = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
    calls = len(re.findall(r"\.enqueue\(", code))
    bulk = sum(int(n.replace("_", "")) for n in re.findall(r"in range\(([\d_]+)\)", code))
    assert enqueued == (calls + bulk,)


@pytest.mark.parametrize("code", PYTEST, ids=[f"pytest-{i}" for i in range(len(PYTEST))])
def test_a_pytest_example_passes(tmp_path, code):
    """Each test module example passes in a pytest session of its own, as in a user's project
    (the plugin found through its entry point), on this suite's database server."""
    (tmp_path / "test_example.py").write_text(code)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FASTJOBS_DSN")}
    env["FASTJOBS_TEST_DSN"] = databases.server_dsn()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    tests = len(re.findall(r"^(?:async )?def test_", code, flags=re.M))
    assert done.returncode == 0 and f"{tests} passed" in done.stdout, done.stdout + done.stderr


def _options(command: str) -> tuple[list[str], list[str]]:
    """The subcommand words (the first of `a|b` alternatives) and every --option of a documented line."""
    subcommand: list[str] = []
    options: list[str] = []
    words = command.replace("[", " ").replace("]", " ").split()[1:]
    for word in words:
        parts = word.split("|")
        options += [part.split("=")[0] for part in parts if part.startswith("--")]
        if len(subcommand) == words.index(word) and re.fullmatch(r"[a-z]+", parts[0]):
            subcommand.append(parts[0])
    return subcommand, options


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_a_documented_command_names_exists(command):
    subcommand, options = _options(command)
    helps = subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", *subcommand, "--help"], capture_output=True, text=True
    )
    assert helps.returncode == 0, helps.stderr
    global_help = subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", "--help"], capture_output=True, text=True
    ).stdout
    for option in options:
        assert option in helps.stdout or option in global_help, f"{command}: {option} is not an option"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_the_tutorial_runs_as_written(dsn, tmp_path):
    """The five-minute tutorial, command by command, as a new user would run it: its files are
    written out, its shell lines run in order (`pip install` aside: CI installed the packages;
    the DSN and the web port are this test's), the two `# terminal` lines in the background,
    and what it says happens does: Ada is welcomed, Bob's job fails, is retried, and the
    commands that watch it show it."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", TUTORIAL, flags=re.S)
    for lang, code in blocks:
        if lang == "python":
            match = FILE_NAME.match(code)
            assert match, f"a tutorial Python block must start with its file name: {code[:40]!r}"
            (tmp_path / match.group(1)).write_text(code)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FASTJOBS_TEST_DSN")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    background: list[subprocess.Popen[str]] = []
    logs: list[IO[str]] = []
    outputs: dict[str, str] = {}

    def run(line: str) -> None:
        command = line.split("  #")[0].strip().replace("5000", str(port))
        if command.startswith("pip install"):
            return
        if command.startswith("export FASTJOBS_DSN="):
            env["FASTJOBS_DSN"] = dsn
            return
        if "# terminal" in line:
            log = (tmp_path / f"terminal-{len(background)}.log").open("w")
            logs.append(log)
            background.append(
                subprocess.Popen(  # exec: the command itself is the process told to stop below
                    f"exec {command}", shell=True, cwd=tmp_path, env=env, stdout=log, stderr=log, text=True
                )
            )
            return
        if command.startswith("curl"):
            _wait(
                lambda: (
                    subprocess.run(["curl", "-s", f"localhost:{port}/"], capture_output=True).returncode == 0
                ),
                "the web application to listen",
            )
        done = subprocess.run(
            command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{command}: {done.stderr}"
        outputs[command.split(" localhost")[0]] = done.stdout

    def db(query: str) -> object:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(query).fetchone()
        return None if row is None else row[0]

    shell = [code for lang, code in blocks if lang == "sh"]
    assert len(shell) == 3, "the tutorial's steps: install, run and sign up, watch"
    try:
        for block in shell[:2]:
            for line in block.splitlines():
                run(line)
        assert '"job":1' in outputs["curl -d email=ada@example.com"]
        assert '"job":2' in outputs["curl -d email=bob@example.invalid"]
        _wait(lambda: db("SELECT welcomed_at FROM users WHERE email = 'ada@example.com'"), "Ada's welcome")
        _wait(
            lambda: db("SELECT attempt >= 2 AND state = 'retryable' FROM fastjobs_jobs_all WHERE id = 2"),
            "Bob's job to fail twice",
        )
        assert db("SELECT welcomed_at FROM users WHERE email = 'bob@example.invalid'") is None
        for line in shell[2].splitlines():
            run(line)
    finally:
        for process in background:  # the command itself (exec), told to stop as systemd would
            process.terminate()
        for process in background:
            process.wait(timeout=30)
        for log in logs:
            log.close()
    assert "emails" in outputs["fastjobs stats"]
    listed = outputs["fastjobs jobs list --state retryable"]
    assert "jobs.send_welcome" in listed and re.search(r"\b2\b", listed)
    assert "cannot deliver to bob@example.invalid" in outputs["fastjobs jobs show 2"]


def test_the_cluster_views_sample_output_is_what_fastjobs_stats_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's `fastjobs stats` cluster sample, printed from the hosts it shows."""
    from fastjobs import cli
    from fastjobs.stats import ClusterHost, ClusterWorker

    [sample] = [code for lang, code in BLOCKS if lang == "text" and code.startswith("cluster: ")]

    def worker(wid: str, rate: float, beat: float, stale: bool = False) -> ClusterWorker:
        return ClusterWorker(
            wid, int(wid.split(":")[1]), ["default", "emails"], 3600.0, beat, stale, rate, {}
        )

    web1 = [
        worker("web-1:4811:9f3c1a2b7d0e4c55", 5790, 0.4),
        worker("web-1:4812:1d0b6e2f8a4c7e90", 5414, 1.1),
    ]
    web2 = [
        worker("web-2:5120:0b7e44c9a1d2f3e6", 0, 7.9, True),
        worker("web-2:5121:c2a95f1e07d34b88", 8377, 0.6),
    ]
    queues = ["default", "emails"]
    cli._print_cluster(
        [
            ClusterHost("web-1", web1, queues, 0, 0.4, 11204, {"completed": 3120455, "failed": 12}, []),
            ClusterHost("web-2", web2, queues, 1, 0.6, 8377, {"completed": 2904118, "failed": 9}, []),
        ]
    )
    assert capsys.readouterr().out.lstrip("\n") == sample
