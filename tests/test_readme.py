"""The README and the documentation as used: their Python examples run, their walk-throughs run as
written, and every option their command lines name exists."""

from __future__ import annotations

import functools
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

ROOT = Path(__file__).resolve().parent.parent
# The README (the front page) and every page of the documentation site, in a fixed order.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks() -> list[tuple[str, str, str]]:
    """(page, language, code) of every fenced block, each code once (the front page repeats an
    example of the site's home page: it runs once)."""
    seen: set[tuple[str, str]] = set()
    blocks = []
    for page in PAGES:
        for lang, code in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), flags=re.S):
            if (lang, code) not in seen:
                seen.add((lang, code))
                blocks.append((str(page.relative_to(ROOT)), lang, code))
    return blocks


def _section(page: str, heading: str) -> str:
    return (ROOT / page).read_text().split(f"{heading}\n")[1].split("\n## ")[0]


BLOCKS = _blocks()
# A block whose first line names a file (`# jobs.py`) is a file of a walk-through (the README's
# quick start, the tutorial), run by its test with the walk-through's shell lines; a block that
# defines tests is a test module of a user's suite, which pytest runs; every other Python block
# is a script of its own. A `py` block is a fragment of a larger program (a Django project's
# settings or views, an excerpt of examples/): shown, highlighted, and run where that program is
# (tests/test_django.py, tests/test_fastapi.py), not here.
FILE_NAME = re.compile(r"# (\w+\.py)\n")
PYTEST = [(page, code) for page, lang, code in BLOCKS if lang == "python" and "\ndef test_" in code]
PYTHON = [
    (page, code)
    for page, lang, code in BLOCKS
    if lang == "python" and "\ndef test_" not in code and not FILE_NAME.match(code)
]
# The quick start is on the front page and on the site's getting-started page: the same steps.
QUICK_STARTS = {page: _section(page, "## Quick start") for page in ("README.md", "docs/getting-started.md")}
TUTORIAL = _section("docs/getting-started.md", "## Your first job in five minutes")
COMMANDS = [
    line.split("#")[0].strip()
    for _, lang, code in BLOCKS
    if lang == "sh"
    for line in code.splitlines()
    if line.strip().startswith("fastjobs ")
]


def _ids(examples: list[tuple[str, str]]) -> list[str]:
    """`page-N`, N counting that page's examples of the kind, so a failure names its page."""
    counts: dict[str, int] = {}
    ids = []
    for page, _ in examples:
        counts[page] = counts.get(page, -1) + 1
        ids.append(f"{page}-{counts[page]}")
    return ids


def test_the_readme_has_examples():
    assert PYTHON and PYTEST and COMMANDS


def test_every_file_block_belongs_to_a_walk_through():
    """A file block anywhere else would be run by nothing."""
    files = [code for _, lang, code in BLOCKS if lang == "python" and FILE_NAME.match(code)]
    walks = [*QUICK_STARTS.values(), TUTORIAL]
    assert files and all(any(code in walk for walk in walks) for code in files)


def test_the_quick_start_is_the_same_on_the_front_page_and_the_site():
    """A reader of either page runs the same commands and files."""
    readme, site = (re.findall(r"```\w*\n.*?```", walk, flags=re.S) for walk in QUICK_STARTS.values())
    assert readme == site


@pytest.mark.parametrize(("page", "code"), PYTHON, ids=_ids(PYTHON))
def test_a_python_example_runs(dsn, tmp_path, page, code):
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
    assert done.returncode == 0, f"{page}: {done.stderr}"
    with psycopg.connect(dsn) as conn:
        enqueued = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
    calls = len(re.findall(r"\.enqueue\(", code))
    bulk = sum(int(n.replace("_", "")) for n in re.findall(r"in range\(([\d_]+)\)", code))
    assert enqueued == (calls + bulk,)


@pytest.mark.parametrize(("page", "code"), PYTEST, ids=_ids(PYTEST))
def test_a_pytest_example_passes(tmp_path, page, code):
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
    assert done.returncode == 0 and f"{tests} passed" in done.stdout, page + done.stdout + done.stderr


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


# Once per subcommand and worker process: 49 documented lines name 22 subcommands, and each
# `--help` is an interpreter start importing the CLI (1-2 s on a loaded machine).
@functools.cache
def _help(*subcommand: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", *subcommand, "--help"], capture_output=True, text=True
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_a_documented_command_names_exists(command):
    subcommand, options = _options(command)
    helps = _help(*subcommand)
    assert helps.returncode == 0, helps.stderr
    global_help = _help().stdout
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


class Walk:
    """A walk-through run as a new user would run it: its files written out, its shell lines run in
    order (`pip install` aside: CI installed the packages; the DSN and the web port are this
    test's), each line marked `# terminal` in the background, as a terminal of its own (whose
    output is line-buffered, as a terminal's is)."""

    def __init__(self, section: str, dsn: str, tmp_path: Path) -> None:
        self.blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
        for lang, code in self.blocks:
            if lang == "python":
                match = FILE_NAME.match(code)
                assert match, f"a walk-through's Python block must start with its file name: {code[:40]!r}"
                (tmp_path / match.group(1)).write_text(code)
        self.shell = [code for lang, code in self.blocks if lang == "sh"]
        self.dsn, self.tmp_path, self.port = dsn, tmp_path, _free_port()
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FASTJOBS_TEST_DSN")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.background: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []
        self.outputs: dict[str, str] = {}

    def run(self, block: str) -> None:
        for line in block.splitlines():
            self.line(line)

    def line(self, line: str) -> None:
        command = line.split("  #")[0].strip().replace("5000", str(self.port))
        # The packages are CI's, and the database this test's own (created, named by the DSN).
        if command.startswith(("pip install", "createdb ")):
            return
        if command.startswith("export FASTJOBS_DSN="):
            self.env["FASTJOBS_DSN"] = self.dsn
            return
        if "# terminal" in line:
            log = (self.tmp_path / f"terminal-{len(self.background)}.log").open("w")
            self.logs.append(log)
            self.background.append(
                subprocess.Popen(  # exec: the command itself is the process told to stop below
                    f"exec {command}",
                    shell=True,
                    cwd=self.tmp_path,
                    env=self.env,
                    stdout=log,
                    stderr=log,
                    text=True,
                )
            )
            return
        if command.startswith("curl"):
            _wait(
                lambda: (
                    subprocess.run(["curl", "-s", f"localhost:{self.port}/"], capture_output=True).returncode
                    == 0
                ),
                "the web application to listen",
            )
        done = subprocess.run(
            command, shell=True, cwd=self.tmp_path, env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{command}: {done.stderr}"
        self.outputs[command.split(" localhost")[0]] = done.stdout

    def terminal(self, n: int) -> str:
        return (self.tmp_path / f"terminal-{n}.log").read_text()

    def stop(self) -> None:
        for process in self.background:  # the command itself (exec), told to stop as systemd would
            process.terminate()
        for process in self.background:
            process.wait(timeout=30)
        for log in self.logs:
            log.close()


@pytest.mark.parametrize("page", QUICK_STARTS)
def test_the_quick_start_runs_as_written(dsn, tmp_path, page):
    """The quick start: the schema, the workers in one terminal, an enqueue from another, and the
    worker says hello."""
    walk = Walk(QUICK_STARTS[page], dsn, tmp_path)
    assert len(walk.shell) == 2, "the quick start's steps: install, run and enqueue"
    try:
        for block in walk.shell:
            walk.run(block)
        _wait(lambda: "hello, world" in walk.terminal(0), "the worker to say hello")
    finally:
        walk.stop()


def test_the_tutorial_runs_as_written(dsn, tmp_path):
    """The five-minute tutorial, command by command, as a new user would run it, and what it says
    happens does: Ada is welcomed, Bob's job fails, is retried, and the commands that watch it show
    it."""
    walk = Walk(TUTORIAL, dsn, tmp_path)

    def db(query: str) -> object:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(query).fetchone()
        return None if row is None else row[0]

    assert len(walk.shell) == 3, "the tutorial's steps: install, run and sign up, watch"
    try:
        for block in walk.shell[:2]:
            walk.run(block)
        assert '"job":1' in walk.outputs["curl -d email=ada@example.com"]
        assert '"job":2' in walk.outputs["curl -d email=bob@example.invalid"]
        _wait(lambda: db("SELECT welcomed_at FROM users WHERE email = 'ada@example.com'"), "Ada's welcome")
        _wait(
            lambda: db("SELECT attempt >= 2 AND state = 'retryable' FROM fastjobs_jobs_all WHERE id = 2"),
            "Bob's job to fail twice",
        )
        assert db("SELECT welcomed_at FROM users WHERE email = 'bob@example.invalid'") is None
        walk.run(walk.shell[2])
    finally:
        walk.stop()
    outputs = walk.outputs
    assert "emails" in outputs["fastjobs stats"]
    listed = outputs["fastjobs jobs list --state retryable"]
    assert "jobs.send_welcome" in listed and re.search(r"\b2\b", listed)
    assert "cannot deliver to bob@example.invalid" in outputs["fastjobs jobs show 2"]


def test_the_cluster_views_sample_output_is_what_fastjobs_stats_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The `fastjobs stats` cluster sample, printed from the hosts it shows."""
    from fastjobs.cli import stats as stats_command
    from fastjobs.report import ClusterHost, ClusterWorker

    [sample] = [code for _, lang, code in BLOCKS if lang == "text" and code.startswith("cluster: ")]

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
    stats_command._print_cluster(
        [
            ClusterHost("web-1", web1, queues, 0, 0.4, 11204, {"completed": 3120455, "failed": 12}, []),
            ClusterHost("web-2", web2, queues, 1, 0.6, 8377, {"completed": 2904118, "failed": 9}, []),
        ]
    )
    assert capsys.readouterr().out.lstrip("\n") == sample


def test_the_slow_jobs_sample_output_is_what_fastjobs_stats_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The `fastjobs stats` sample of slow jobs and careful mode, printed from the events it shows."""
    from fastjobs.cli import stats as stats_command
    from fastjobs.report import CarefulWorker, SlowEvents

    [sample] = [code for _, lang, code in BLOCKS if lang == "text" and code.startswith("slow jobs (handed")]
    stats_command._print_events(
        [SlowEvents("web-1", "web-1:4811:9f3c1a2b7d0e4c55", "reports", 3, 1, 12.2, 47.8)],
        [CarefulWorker("web-2", "web-2:5133:5e0c9d2a41b7f806", 20.4, 39.6)],
    )
    assert capsys.readouterr().out.lstrip("\n") == sample
