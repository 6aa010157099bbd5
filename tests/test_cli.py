"""What every `fastjobs` command does with its output: a reader that goes away ends it quietly;
`fastjobs sql show`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastjobs import App, sql
from fastjobs.cli import main

from . import procs

CRON = """
import fastjobs

app = fastjobs.App()


@app.periodic("*/5 * * * *", kind="five")
def five():
    pass
"""


@pytest.mark.parametrize(
    "command",
    [
        ["stats"],
        ["stats", "--json"],
        ["jobs", "list"],
        ["jobs", "list", "--json"],
        ["jobs", "show", "1"],
        ["jobs", "show", "1", "--json"],
        ["jobs", "retry", "1"],
        ["periodic", "list", "fjcron"],
        ["periodic", "list", "fjcron", "--json"],
        ["migrate", "--sql"],
        ["sql", "show"],
        ["sql", "show", "job_finish_claim_many"],
        ["--help"],
        ["jobs", "--help"],
    ],
    ids=" ".join,
)
def test_a_closed_pipe_ends_every_command_quietly(
    app: App, dsn: str, tmp_path: Path, command: list[str]
) -> None:
    """`fastjobs ... | head` when head has gone: exit as SIGPIPE would (141), no traceback."""
    (tmp_path / "fjcron.py").write_text(CRON)
    app.enqueue("k", {"n": 1}, delay=60)  # job 1
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    # stdout buffered, as in a shell (PYTHONUNBUFFERED would make every write fail at once).
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, *command],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=env,
            text=True,
            timeout=procs.DEADLINE,
            check=False,
        )
    finally:
        os.close(write)
    # Only notes about other masters' stats files in /dev/shm (other users', other versions').
    said = [line for line in done.stderr.splitlines() if not line.startswith("fastjobs: skipped /")]
    assert (done.returncode, said) == (128 + signal.SIGPIPE, [])


def test_a_long_listing_into_head(app: App, dsn: str) -> None:
    app.enqueue_many("k", ({"n": n} for n in range(3000)))
    done = subprocess.run(
        [
            "sh",
            "-c",
            f'"{sys.executable}" -m fastjobs.cli --dsn "$DSN" jobs list --limit 3000 | head -n 2',
        ],
        env={**os.environ, "DSN": dsn},
        capture_output=True,
        text=True,
        timeout=procs.DEADLINE,
        check=False,
    )
    assert done.returncode == 0
    assert done.stderr == ""
    header, first = done.stdout.splitlines()
    assert header.split() == ["id", "queue", "kind", "state", "attempt", "run_at"]
    assert first.split()[:4] == ["3000", "default", "k", "available"]


PERIODIC = """
import fastjobs

app = fastjobs.App()


@app.periodic("@daily")
def nightly_report():
    pass


@app.periodic("@hourly")
def nightly_reports():
    pass


@app.periodic("@weekly", kind="billing.invoices.send")
def send():
    pass


@app.periodic("@weekly", kind="mail.send")
def send_mail():
    pass
"""


@pytest.fixture
def periodic_module(dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fjshort.py").write_text(PERIODIC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fjshort", raising=False)
    return "fjshort"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nightly_report", "fjshort.nightly_report"),
        ("fjshort.nightly_report", "fjshort.nightly_report"),
        ("invoices.send", "billing.invoices.send"),
        ("mail.send", "mail.send"),
    ],
)
def test_periodic_run_takes_the_short_name_of_one_periodic_job(
    dsn: str, periodic_module: str, capsys: pytest.CaptureFixture[str], name: str, kind: str
) -> None:
    from fastjobs.cli import main

    assert main(["--dsn", dsn, "periodic", "run", periodic_module, name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == kind


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (
            "send",
            "'send' names several periodic jobs of fjshort: billing.invoices.send, mail.send; give one whole",
        ),
        (
            "nightly_rport",
            "'nightly_rport' is not a periodic job of fjshort; did you mean 'nightly_report' or"
            " 'nightly_reports'? (its periodic jobs: billing.invoices.send, fjshort.nightly_report,"
            " fjshort.nightly_reports, mail.send)",
        ),
    ],
)
def test_periodic_run_of_an_ambiguous_or_unknown_name_says_which_it_could_be(
    dsn: str, periodic_module: str, capsys: pytest.CaptureFixture[str], name: str, error: str
) -> None:
    from fastjobs.cli import main

    assert main(["--dsn", dsn, "periodic", "run", periodic_module, name]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"fastjobs: {error}\n")


def test_sql_show_prints_each_statement_as_it_is_sent_and_lists_them_by_section(monkeypatch, capsys) -> None:
    """`fastjobs sql show NAME`: the statement whole, the text fastjobs prepares (the leading newline of
    its literal aside); with no NAME, each name under its section (a family's variants are one); an
    unknown name exits 1 and says which are close. No database is needed."""
    monkeypatch.setenv("FASTJOBS_DSN", "postgresql://nobody@127.0.0.1:1/nothing")
    for name, text in sql.STATEMENTS.items():
        assert main(["sql", "show", name]) == 0
        assert capsys.readouterr().out == text.lstrip("\n") + "\n", name
    assert main(["sql", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if not line.startswith("  ")] == list(sql.SECTIONS)
    assert [line.strip() for line in lines if line.startswith("  ")] == list(sql.STATEMENTS)
    assert "job_lock_after_context" in sql.SECTIONS["Claims"]
    assert main(["sql", "show", "job_finish_claim_mnay"]) == 1
    assert "did you mean 'job_finish_claim_many'" in capsys.readouterr().err
