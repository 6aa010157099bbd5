"""The README as used: its Python examples run, and every option its command lines name exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from fastjobs.testing import databases

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.S)
# A block that defines tests is a test module of a user's suite: pytest runs it.
PYTHON = [code for lang, code in BLOCKS if lang == "python" and "\ndef test_" not in code]
PYTEST = [code for lang, code in BLOCKS if lang == "python" and "\ndef test_" in code]
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
        enqueued = conn.execute("SELECT count(*) FROM fastjobs_jobs").fetchone()
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
    tests = len(re.findall(r"^def test_", code, flags=re.M))
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
