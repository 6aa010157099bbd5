"""The install as the documentation says it (docs/getting-started.md, "Install"): a build that
lacks a piece names it, and a regular install from the clone is seen by type checkers.

`.ci/run` runs this module once, apart from the database runs: it builds a wheel, makes a
virtual environment and type-checks in it, and needs no database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

LACKS = "fastjobs cannot be built: it compiles a C extension against libpq, as psycopg[c] does, and"


def _setup(tmp_path: Path, tools: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`setup.py --name` with a PATH holding this interpreter and `tools` (name: script) only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    for name, script in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["PATH"] = str(bin_dir)
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_build_without_compiler_or_libpq_names_both(tmp_path: Path) -> None:
    done = _setup(tmp_path, {})
    assert done.returncode == 1
    assert done.stderr.startswith(LACKS), done.stderr
    assert "a C compiler (`" in done.stderr and "apt-get install build-essential" in done.stderr
    assert "libpq's headers and pg_config (`pg_config` is not on PATH" in done.stderr
    assert "apt-get install libpq-dev" in done.stderr
    # The install page shows this message: the same words.
    assert LACKS.replace(", and", "") in " ".join((ROOT / "docs/getting-started.md").read_text().split())


def test_a_build_whose_pg_config_has_no_headers_says_where_it_looked(tmp_path: Path) -> None:
    headers = tmp_path / "include"
    headers.mkdir()
    done = _setup(tmp_path, {"gcc": "exit 0", "cc": "exit 0", "pg_config": f"echo {headers}"})
    assert done.returncode == 1
    assert f"libpq's headers (no libpq-fe.h in {headers}" in done.stderr, done.stderr
    assert "C compiler" not in done.stderr


# A user's module: typed arguments (a dataclass, an aware datetime), checked at each call site.
SAMPLE = """
import dataclasses
import datetime as dt

import psycopg

import fastjobs

app = fastjobs.App("postgresql://")


@dataclasses.dataclass
class Address:
    street: str
    zip: str


@app.job()
def send(user_id: int, when: dt.datetime, to: Address | None = None, note: str = "") -> None: ...


def calls(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    send.enqueue(user_id=1, when=dt.datetime.now(dt.UTC))
    send.enqueue(1, dt.datetime.now(dt.UTC), Address("1 Main St", "02134"), "positional")
    send.using(conn).enqueue(user_id=1, when=dt.datetime.now(dt.UTC))
    send.options(priority=5).enqueue_many([send.args(user_id=2, when=dt.datetime.now(dt.UTC))])
    send.enqueue(user_id="1", when=dt.datetime.now(dt.UTC))  # error: a wrong type
    send.enqueue(user_id=1)  # error: a missing argument
    send.args(user_id=1, when=dt.datetime.now(dt.UTC), nope=3)  # error: an unknown argument
    send.enqueue(user_id=1, when=dt.datetime.now(dt.UTC), to={"street": "x"})  # error: not an Address
"""


# Neither the wheel's install nor the checks may see this checkout through PYTHONPATH (a developer's
# shell sets it to their tree): pip would take fastjobs for installed already and install nothing.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install ./fastjobs`, as the install page says (a regular install: an editable one hides
    the package from type checkers behind an import hook), into a fresh virtual environment: its
    interpreter. The wheel is built here with `--no-build-isolation`, reusing this checkout's C
    build; the environment takes fastjobs' dependencies (psycopg's types among them) from this one
    through a .pth file, so fastjobs itself is found only where the documented install put it."""
    tmp_path = tmp_path_factory.mktemp("install")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(ROOT)],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    [wheel] = wheels.glob("fastjobs-*.whl")
    installed = subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            env=CLEAN_ENV,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert (site / "fastjobs" / "py.typed").is_file() and (site / "fastjobs" / "_core.pyi").is_file()
    # The Django app's migrations and command are packages of their own (pyproject's list).
    django_app = site / "fastjobs" / "contrib" / "django"
    assert (django_app / "migrations" / "0001_schema.py").is_file()
    assert (django_app / "management" / "commands" / "fastjobs_run.py").is_file()
    (site / "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_mypy_checks_enqueue_calls_against_the_handler_of_an_installed_fastjobs(
    tmp_path: Path, installed: Path
) -> None:
    """`mypy --strict` on a user's module, run against the environment of the documented install."""
    python = installed
    user = tmp_path / "user"
    user.mkdir()
    code = textwrap.dedent(SAMPLE).lstrip()
    (user / "sample.py").write_text(code + "reveal_type(send)\n")
    expected = [str(n) for n, line in enumerate(code.splitlines(), 1) if "# error" in line]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--python-executable",
            str(python),
            "--cache-dir",
            str(tmp_path / "mypy_cache"),
            "sample.py",
        ],
        cwd=user,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    revealed = 'Revealed type is "fastjobs.job.Job[[user_id: int, when: datetime.datetime, to: sample.Address'
    assert revealed in done.stdout, done.stdout + done.stderr  # fastjobs found, its types whole
    errors = sorted(
        line.split(": error: ")[0].rsplit(":", 1)[1]
        for line in done.stdout.splitlines()
        if ": error: " in line
    )
    assert len(expected) == 4
    assert errors == expected, done.stdout + done.stderr
    assert (
        'Argument "user_id" to "enqueue" of "Job" has incompatible type "str"; expected "int"' in done.stdout
    )
    assert 'Missing positional argument "when" in call to "enqueue" of "Job"' in done.stdout
    assert 'Unexpected keyword argument "nope" for "args" of "Job"' in done.stdout
    assert 'Argument "to" to "enqueue" of "Job" has incompatible type "dict[str, str]"' in done.stdout


def test_pyright_checks_enqueue_calls_against_the_handler_of_an_installed_fastjobs(
    tmp_path: Path, installed: Path
) -> None:
    """pyright on the same module, against the same environment: the four mistakes, each on its line."""
    pyright = Path(sys.executable).parent / "pyright"  # the test extra's, which runs its own Node.js
    user = tmp_path / "user"
    user.mkdir()
    code = textwrap.dedent(SAMPLE).lstrip()
    (user / "sample.py").write_text(code + "reveal_type(send)\n")
    expected = [n for n, line in enumerate(code.splitlines(), 1) if "# error" in line]
    done = subprocess.run(
        [str(pyright), "--pythonpath", str(installed), "sample.py"],
        cwd=user,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    revealed = 'Type of "send" is "Job[(user_id: int, when: datetime, to: Address | None = None'
    assert revealed in done.stdout, output  # fastjobs found, its types whole
    errors = sorted({int(line.split(":")[1]) for line in done.stdout.splitlines() if " - error: " in line})
    assert len(expected) == 4
    assert errors == expected, output
    assert '"Literal[\'1\']" is not assignable to "int"' in done.stdout, output
    assert 'Argument missing for parameter "when"' in done.stdout, output
    assert 'No parameter named "nope"' in done.stdout, output
    assert 'Type "dict[str, str]" is not assignable to type "Address | None"' in done.stdout, output
