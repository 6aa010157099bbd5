"""`fastjobs jobs list|show|retry|cancel|discard`, human and --json, through fastjobs.cli.main."""

from __future__ import annotations

import io
import json
import re
import sys
from typing import Any

import pytest

import fastjobs
from fastjobs import App
from fastjobs.cli import main

from .helpers import drain, query


def jobs_cli(dsn: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `fastjobs --dsn DSN jobs ARGS`; (exit code, stdout, stderr)."""
    code = main(["--dsn", dsn, "jobs", *args])
    out, err = capsys.readouterr()
    return code, out, err


def jobs_json(dsn: str, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code, out, err = jobs_cli(dsn, capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def state(dsn: str, job_id: int) -> str:
    return str(query(dsn, "SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,))[0]["state"])


@pytest.fixture
def seeded(app: App, dsn: str) -> dict[str, int]:
    """Jobs of two kinds over two queues in several states, by name."""
    ids: dict[str, int] = {
        "a1": app.enqueue("alpha", {"n": 1}),
        "a2": app.enqueue("alpha", {"n": 2}, queue="mail"),
        "b1": app.enqueue("beta", {"n": 3}, delay=3600),
        "b2": app.enqueue("beta", {"n": 4}, queue="mail", priority=7),
    }
    query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running', attempt = 1 WHERE id = %s", (ids["a1"],))
    return ids


# --- list ----------------------------------------------------------------------------------------


def test_list_human(dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]) -> None:
    code, out, err = jobs_cli(dsn, capsys, "list")
    assert code == 0 and err == ""
    header, *lines = out.splitlines()
    assert header.split() == ["id", "queue", "kind", "state", "attempt", "run_at"]
    # Newest first: id, queue, kind, state, attempt/max, run_at date and time.
    parsed = [line.split() for line in lines]
    assert [(int(p[0]), p[1], p[2], p[3], p[4]) for p in parsed] == [
        (seeded["b2"], "mail", "beta", "available", "0/25"),
        (seeded["b1"], "default", "beta", "scheduled", "0/25"),
        (seeded["a2"], "mail", "alpha", "available", "0/25"),
        (seeded["a1"], "default", "alpha", "running", "1/25"),
    ]
    assert all(
        re.fullmatch(r"\d{4}-\d\d-\d\d", p[5]) and re.fullmatch(r"\d\d:\d\d:\d\d", p[6]) for p in parsed
    )


def test_list_json(dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]) -> None:
    rows = jobs_json(dsn, capsys, "list")
    assert [r["id"] for r in rows] == sorted(seeded.values(), reverse=True)
    b2 = rows[0]
    assert {k: b2[k] for k in ("queue", "kind", "state", "priority", "attempt", "max_attempts")} == {
        "queue": "mail",
        "kind": "beta",
        "state": "available",
        "priority": 7,
        "attempt": 0,
        "max_attempts": 25,
    }
    assert isinstance(b2["run_at"], str) and isinstance(b2["created_at"], str)


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--queue", "mail"], ["b2", "a2"]),
        (["--state", "available"], ["b2", "a2"]),
        (["--state", "running"], ["a1"]),
        (["--kind", "beta"], ["b2", "b1"]),
        (["--queue", "default", "--kind", "alpha"], ["a1"]),
        (["--queue", "mail", "--state", "scheduled"], []),
        (["--queue", "nope"], []),
        (["--limit", "2"], ["b2", "b1"]),
    ],
)
def test_list_filters(
    dsn: str,
    capsys: pytest.CaptureFixture[str],
    seeded: dict[str, int],
    filters: list[str],
    expected: list[str],
) -> None:
    exit_code = 1 if "nope" in filters else 0  # a queue that names nothing: "not found", empty all the same
    code, out, _ = jobs_cli(dsn, capsys, "list", *filters, "--json")
    assert code == exit_code
    assert [r["id"] for r in json.loads(out)] == [seeded[name] for name in expected]
    code, out, _ = jobs_cli(dsn, capsys, "list", *filters)
    assert code == exit_code
    assert [int(line.split()[0]) for line in out.splitlines()[1:]] == [seeded[name] for name in expected]


def test_list_of_an_unknown_state_is_a_usage_error(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--dsn", dsn, "jobs", "list", "--state", "finished"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'finished'" in capsys.readouterr().err


def test_a_listing_cut_at_its_limit_says_so(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "list", "--limit", "3")
    assert code == 0 and len(out.splitlines()) == 1 + 3
    assert "the newest 3 shown, and there are more: --limit N for more" in err
    assert len(jobs_json(dsn, capsys, "list", "--limit", "3")) == 3
    code, out, err = jobs_cli(dsn, capsys, "list", "--limit", "4")  # all of them: nothing to say
    assert code == 0 and len(out.splitlines()) == 1 + 4 and err == ""


@pytest.mark.parametrize("limit", ["0", "-3", "x"])
def test_a_limit_below_one_is_a_usage_error(dsn: str, capsys: pytest.CaptureFixture[str], limit: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--dsn", dsn, "jobs", "list", "--limit", limit])
    assert exit_info.value.code == 2
    assert "argument --limit" in capsys.readouterr().err


def test_a_short_kind_that_lists_nothing_says_kinds_are_matched_whole(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    app.enqueue("shop.jobs.make_invoice", {"n": 1})
    code, out, err = jobs_cli(dsn, capsys, "list", "--kind", "make_invoice")
    assert code == 1 and out.splitlines()[1:] == []
    assert err == (
        "fastjobs: no kind 'make_invoice': no job has it and no live worker handles it; a kind is"
        " matched whole: 'shop.jobs.make_invoice'?\n"
    )
    code, out, err = jobs_cli(dsn, capsys, "list", "--kind", "shop.jobs.make_invoice")
    assert len(out.splitlines()) == 2 and err == ""


def test_a_typo_in_a_queue_or_kind_filter_says_no_such_name_and_suggests_close_ones(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    # Exit 1, as every "not found" of the CLI (a job id, a periodic job, a statement's name).
    code, out, err = jobs_cli(dsn, capsys, "list", "--queue", "mial")
    assert (code, out.splitlines()[1:]) == (1, [])
    assert (
        err
        == "fastjobs: no queue 'mial': no job is on it and no live worker serves it; did you mean 'mail'?\n"
    )
    code, out, err = jobs_cli(dsn, capsys, "list", "--kind", "betta", "--queue", "mail")
    assert code == 1
    assert (
        err
        == "fastjobs: no kind 'betta': no job has it and no live worker handles it; did you mean 'beta'?\n"
    )
    # A known name that lists nothing is no typo: nothing to say.
    code, out, err = jobs_cli(dsn, capsys, "list", "--queue", "mail", "--state", "scheduled")
    assert (code, err) == (0, "")
    code, out, err = jobs_cli(dsn, capsys, "list", "--kind", "zzz")
    assert (code, err) == (1, "fastjobs: no kind 'zzz': no job has it and no live worker handles it\n")
    # Acting by a filter that names nothing: the same answer, nothing done.
    code, out, err = jobs_cli(dsn, capsys, "retry", "--kind", "betta", "--yes")
    assert code == 1
    assert err.endswith(
        "fastjobs: no kind 'betta': no job has it and no live worker handles it; did you mean 'beta'?\n"
    )


# --- show ----------------------------------------------------------------------------------------


@pytest.fixture
def failed_job(app: App) -> int:
    """A job whose only attempt raised: discarded, with its error and traceback recorded."""

    @app.job("fragile", max_attempts=1)
    def fragile(n: int) -> None:
        if fastjobs.current_job().attempt == 1:  # type: ignore[union-attr]
            raise ValueError(f"boom {n}")

    job_id = app.enqueue("fragile", {"n": 7})
    drain(app)
    return job_id


def test_show_human(dsn: str, capsys: pytest.CaptureFixture[str], failed_job: int) -> None:
    code, out, err = jobs_cli(dsn, capsys, "show", str(failed_job))
    assert code == 0 and err == ""
    fields = dict(line.strip().split(": ", 1) for line in out.split("\n---")[0].splitlines() if ": " in line)
    assert fields["id"] == str(failed_job)
    assert fields["kind"] == "fragile"
    assert fields["state"] == "discarded"
    assert fields["attempt"] == "1"
    assert fields["max_attempts"] == "1"
    assert json.loads(fields["args"]) == {"n": 7}
    assert "--- attempt 1 at " in out
    assert ": ValueError: boom 7" in out
    assert "Traceback (most recent call last)" in out
    assert 'raise ValueError(f"boom {n}")' in out


def test_show_json(dsn: str, capsys: pytest.CaptureFixture[str], failed_job: int) -> None:
    job = jobs_json(dsn, capsys, "show", str(failed_job))
    assert (job["id"], job["kind"], job["state"], job["args"]) == (
        failed_job,
        "fragile",
        "discarded",
        {"n": 7},
    )
    assert (job["attempt"], job["max_attempts"], job["crashes"], job["cancel_requested"]) == (1, 1, 0, False)
    [error] = job["errors"]
    assert error["attempt"] == 1 and error["error"] == "ValueError: boom 7"
    assert "Traceback" in error["traceback"]
    assert job["finalized_at"] is not None


def test_show_of_a_job_without_errors(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    code, out, _ = jobs_cli(dsn, capsys, "show", str(seeded["b2"]))
    assert code == 0
    assert "---" not in out
    assert jobs_json(dsn, capsys, "show", str(seeded["b2"]))["errors"] is None


# --- retry, cancel, discard ----------------------------------------------------------------------


def test_retry_of_a_discarded_job_makes_it_available_and_it_runs(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str], failed_job: int
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "retry", str(failed_job))
    # Its one attempt was spent: the retry raises max_attempts, and says so.
    assert (code, out, err) == (
        0,
        f"job {failed_job}: discarded, now available: runs now as attempt 2 of 2"
        " (max_attempts raised from 1)\n",
        "",
    )
    job = jobs_json(dsn, capsys, "show", str(failed_job))
    assert (job["state"], job["finalized_at"], job["max_attempts"]) == ("available", None, 2)
    drain(app, keep_completed=True)
    job = jobs_json(dsn, capsys, "show", str(failed_job))
    assert (job["state"], job["attempt"]) == ("completed", 2)
    assert len(job["errors"]) == 1  # the history is kept


def test_retry_json_and_of_a_cancelled_job(app: App, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    job_id = app.enqueue("k", delay=3600)
    assert app.cancel(job_id) == "cancelled"
    assert jobs_json(dsn, capsys, "retry", str(job_id)) == {
        "id": job_id,
        "was": "cancelled",
        "state": "available",
        "attempt": 0,
        "max_attempts": 25,
        "max_attempts_before": None,  # attempts to spare: the limit is left as it was
    }
    assert state(dsn, job_id) == "available"


@pytest.mark.parametrize("job_state", ["retryable", "scheduled"])
def test_retry_of_a_waiting_job_runs_it_now_with_its_attempts_as_they_are(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str], job_state: str
) -> None:
    app.job("k")(lambda: None)
    job_id = app.enqueue("k", max_attempts=5)
    attempt = 2 if job_state == "retryable" else 0
    query(
        dsn,
        "UPDATE fastjobs_jobs_all SET state = %s::fastjobs_state, attempt = %s, crashes = 1,"
        " run_at = now() + interval '1 hour'",
        (job_state, attempt),
    )
    code, out, err = jobs_cli(dsn, capsys, "retry", str(job_id))
    assert (code, err) == (0, "")
    assert out == f"job {job_id}: {job_state}, now available: runs now as attempt {attempt + 1} of 5\n"
    [row] = query(
        dsn,
        "SELECT state::text, attempt, max_attempts, crashes, run_at <= now() AS due FROM fastjobs_jobs_all",
    )
    assert row == {"state": "available", "attempt": attempt, "max_attempts": 5, "crashes": 1, "due": True}
    drain(app)
    assert query(dsn, "SELECT count(*) AS n FROM fastjobs_jobs_all") == [{"n": 0}]  # it ran, and completed


def test_retry_leaves_an_available_job_and_refuses_a_running_one(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    available, running = seeded["a2"], seeded["a1"]
    before = query(dsn, "SELECT run_at FROM fastjobs_jobs_all WHERE id = %s", (available,))
    code, out, err = jobs_cli(dsn, capsys, "retry", str(available))
    assert (code, out, err) == (0, f"job {available}: available already, left as it is\n", "")
    # Its place in the queue is kept.
    assert query(dsn, "SELECT run_at FROM fastjobs_jobs_all WHERE id = %s", (available,)) == before
    code, out, err = jobs_cli(dsn, capsys, "retry", str(running))
    assert (code, out) == (1, "")
    assert err == f"fastjobs: job {running} is running: a running job cannot be retried until it ends\n"
    assert state(dsn, running) == "running"


def test_retry_of_several_jobs_says_what_happened_to_each(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    ids = [seeded["b1"], 424242, seeded["a1"], seeded["a2"]]
    code, out, err = jobs_cli(dsn, capsys, "retry", *map(str, ids))
    assert code == 1  # some could not be retried; the others were
    assert out.splitlines() == [
        f"job {seeded['b1']}: scheduled, now available: runs now as attempt 1 of 25",
        f"job {seeded['a2']}: available already, left as it is",
    ]
    assert err.splitlines() == [
        "fastjobs: no job with id 424242",
        f"fastjobs: job {seeded['a1']} is running: a running job cannot be retried until it ends",
    ]
    assert state(dsn, seeded["b1"]) == "available"
    lines = jobs_cli(dsn, capsys, "cancel", str(seeded["b1"]), str(seeded["b2"]), "--json")[1].splitlines()
    assert [json.loads(line) for line in lines] == [
        {"id": seeded["b1"], "state": "cancelled"},
        {"id": seeded["b2"], "state": "cancelled"},
    ]


def test_cancel_of_queued_and_running_jobs(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "cancel", str(seeded["b1"]))
    assert (code, out, err) == (0, f"job {seeded['b1']}: cancelled\n", "")
    assert state(dsn, seeded["b1"]) == "cancelled"
    # A running job is asked to stop: it stays running until its worker acts.
    assert jobs_json(dsn, capsys, "cancel", str(seeded["a1"])) == {"id": seeded["a1"], "state": "cancelling"}
    assert state(dsn, seeded["a1"]) == "running"
    assert jobs_json(dsn, capsys, "show", str(seeded["a1"]))["cancel_requested"] is True
    # A finished job is left alone.
    assert jobs_json(dsn, capsys, "cancel", str(seeded["b1"])) == {"id": seeded["b1"], "state": "cancelled"}


def test_discard_of_a_queued_job(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "discard", str(seeded["a2"]))
    assert (code, out, err) == (0, f"job {seeded['a2']}: discarded\n", "")
    assert jobs_json(dsn, capsys, "discard", str(seeded["b1"])) == {"id": seeded["b1"], "state": "discarded"}
    job = jobs_json(dsn, capsys, "show", str(seeded["b1"]))
    assert job["state"] == "discarded" and job["finalized_at"] is not None


def test_discard_of_a_running_job_fails_clearly(
    dsn: str, capsys: pytest.CaptureFixture[str], seeded: dict[str, int]
) -> None:
    running = seeded["a1"]
    code, out, err = jobs_cli(dsn, capsys, "discard", str(running))
    assert (code, out) == (1, "")
    assert err == f"fastjobs: job {running} is running: running or finished jobs cannot be discarded\n"
    assert state(dsn, running) == "running"
    code, _, err = jobs_cli(dsn, capsys, "discard", str(running), "--json")
    assert code == 1 and "is running" in err


@pytest.mark.parametrize("command", ["show", "retry", "cancel", "discard"])
@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
def test_an_unknown_id_exits_1_with_a_clear_message(
    dsn: str, capsys: pytest.CaptureFixture[str], command: str, as_json: bool
) -> None:
    code, out, err = jobs_cli(dsn, capsys, command, "424242", *(["--json"] if as_json else []))
    assert (code, out, err) == (1, "", "fastjobs: no job with id 424242\n")


def test_a_database_without_the_schema_says_to_migrate(
    empty_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = jobs_cli(empty_dsn, capsys, "list")
    assert (code, out) == (3, "")
    assert "fastjobs migrate" in err


def test_retry_of_a_unique_job_whose_key_is_held_again_names_the_holder(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = app.enqueue("k", {"n": 1}, unique_key="once")
    query(
        dsn, "UPDATE fastjobs_jobs_all SET state = 'discarded', finalized_at = now() WHERE id = %s", (first,)
    )
    holder = app.enqueue("k", {"n": 2}, unique_key="once")
    assert holder != first

    code, out, err = jobs_cli(dsn, capsys, "retry", str(first))
    assert (code, out) == (1, "")
    assert err == (
        f"fastjobs: job {first} cannot be retried: job {holder} (available) holds its unique key 'once';"
        " retry it once that job has finished\n"
    )
    assert state(dsn, first) == "discarded"

    query(dsn, "DELETE FROM fastjobs_jobs_all WHERE id = %s", (holder,))  # the holder completed
    assert jobs_json(dsn, capsys, "retry", str(first))["state"] == "available"


# --- what job input may contain ------------------------------------------------------------------

# An OSC that retitles the terminal, one that clears it, a CSI in its C1 form, a bell, DEL.
_EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x7f"


def test_show_and_list_escape_control_characters_of_job_input(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = app.enqueue(f"kind{_EVIL}", {"text": f"héllo {_EVIL}"}, queue=f"q{_EVIL}")
    error = {
        "at": "now",
        "attempt": 1,
        "error": f"ValueError: {_EVIL}",
        "traceback": f"line 1\n\tline {_EVIL}",
    }
    query(dsn, "UPDATE fastjobs_jobs_all SET errors = jsonb_build_array(%s::jsonb)", (json.dumps(error),))

    for command in (["list"], ["show", str(job_id)]):
        code, out, err = jobs_cli(dsn, capsys, *command)
        assert code == 0 and err == ""
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", out), (command, out)
        assert "kind\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\x7f" in out  # escaped, yet readable
    assert "héllo" in out  # normal text stays as it is
    assert "--- attempt 1 at now: ValueError: \\x1b]0;pwned" in out
    assert "line 1\n\tline \\x1b]0;pwned" in out  # a traceback keeps its lines and indents
    # --json escapes as JSON does, and round-trips.
    job = jobs_json(dsn, capsys, "show", str(job_id))
    assert (job["kind"], job["args"]["text"], job["errors"][0]["error"]) == (
        f"kind{_EVIL}",
        f"héllo {_EVIL}",
        f"ValueError: {_EVIL}",
    )


# --- retry, cancel, discard by filter ------------------------------------------------------------


@pytest.fixture
def failures(app: App, dsn: str) -> dict[str, list[int]]:
    """Discarded jobs of two kinds on two queues, two of them created a day ago; and a pending one."""
    ids: dict[str, list[int]] = {
        "old_alpha": [app.enqueue("alpha", {"n": n}) for n in range(2)],
        "alpha": [app.enqueue("alpha", {"n": n}) for n in range(3)],
        "beta_mail": [app.enqueue("beta", {"n": n}, queue="mail") for n in range(2)],
        "pending": [app.enqueue("alpha", {"n": 99})],
    }
    query(
        dsn, "UPDATE fastjobs_jobs_all SET state = 'discarded', finalized_at = now() WHERE args->>'n' <> '99'"
    )
    query(
        dsn,
        "UPDATE fastjobs_jobs_all SET created_at = now() - interval '1 day' WHERE id = ANY(%s)",
        (ids["old_alpha"],),
    )
    return ids


def states(dsn: str) -> dict[int, str]:
    return {r["id"]: r["state"] for r in query(dsn, "SELECT id, state::text FROM fastjobs_jobs_all")}


def test_retry_by_filter_counts_and_acts_on_the_matching_jobs_only(
    dsn: str, capsys: pytest.CaptureFixture[str], failures: dict[str, list[int]]
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "retry", "--kind", "alpha", "--state", "discarded", "--yes")
    assert (code, out) == (0, "")
    assert err == "fastjobs: retry of 5 jobs: 5 jobs available\n"
    now = states(dsn)
    assert [now[i] for i in failures["old_alpha"] + failures["alpha"]] == ["available"] * 5
    assert [now[i] for i in failures["beta_mail"]] == ["discarded"] * 2
    # Nothing left to match: said so, nothing done.
    code, out, err = jobs_cli(dsn, capsys, "retry", "--kind", "alpha", "--state", "discarded", "--yes")
    assert (code, err) == (0, "fastjobs: no job matches (state discarded, kind alpha): nothing to retry\n")


def test_discard_and_cancel_by_queue_and_age(
    dsn: str, capsys: pytest.CaptureFixture[str], failures: dict[str, list[int]]
) -> None:
    code, out, err = jobs_cli(dsn, capsys, "retry", "--older-than", "2h", "--yes", "--json")
    assert code == 0
    assert [json.loads(line)["id"] for line in out.splitlines()] == failures["old_alpha"]
    code, out, err = jobs_cli(dsn, capsys, "cancel", "--queue", "default", "--yes")
    assert (code, err) == (0, "fastjobs: cancel of 3 jobs: 3 jobs cancelled\n")  # 2 retried + the pending one
    code, out, err = jobs_cli(dsn, capsys, "discard", "--queue", "default", "--state", "cancelled", "--yes")
    assert (code, err) == (0, "fastjobs: discard of 3 jobs: 3 jobs discarded\n")


def test_a_filter_asks_for_confirmation_on_a_terminal_and_for_yes_in_a_script(
    dsn: str,
    capsys: pytest.CaptureFixture[str],
    failures: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    code, _, err = jobs_cli(dsn, capsys, "retry", "--queue", "mail")
    assert (code, err) == (1, "retry 2 jobs (queue mail)? [y/N] fastjobs: nothing done\n")
    assert [states(dsn)[i] for i in failures["beta_mail"]] == ["discarded"] * 2
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    code, _, err = jobs_cli(dsn, capsys, "retry", "--queue", "mail")
    assert (code, err) == (
        0,
        "retry 2 jobs (queue mail)? [y/N] fastjobs: retry of 2 jobs: 2 jobs available\n",
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # a script's stdin
    code, _out, err = jobs_cli(dsn, capsys, "cancel", "--queue", "mail")
    assert (code, err) == (
        1,
        "fastjobs: cancel 2 jobs (queue mail)? Confirm with --yes: stdin is not a terminal\n",
    )
    assert [states(dsn)[i] for i in failures["beta_mail"]] == ["available"] * 2


def test_a_filter_reports_the_jobs_it_could_not_act_on_and_exits_1(
    app: App, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = app.enqueue("alpha", {"n": 1}, unique_key="k")
    other = app.enqueue("alpha", {"n": 2})
    query(dsn, "UPDATE fastjobs_jobs_all SET state = 'discarded' WHERE id IN (%s, %s)", (failed, other))
    holder = app.enqueue("alpha", {"n": 3}, unique_key="k")  # the key is free again, and taken
    code, _out, err = jobs_cli(dsn, capsys, "retry", "--kind", "alpha", "--state", "discarded", "--yes")
    assert code == 1
    assert err.splitlines() == [
        f"fastjobs: job {failed} cannot be retried: job {holder} (available) holds its unique key 'k';"
        " retry it once that job has finished",
        "fastjobs: retry of 2 jobs: 1 job available; 1 job not, each said why above",
    ]
    assert states(dsn) == {failed: "discarded", other: "available", holder: "available"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["retry"],
            "takes job ids or filters (--state, --queue, --kind, --older-than), and was given neither",
        ),
        (["retry", "1", "--queue", "q"], "not both"),
    ],
)
def test_ids_or_filters_not_both_nor_neither(
    dsn: str, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _out, err = jobs_cli(dsn, capsys, *args)
    assert code == 1 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["retry", "--state", "running"], "invalid choice: 'running'"),
        (["discard", "--older-than", "soon"], "'soon' is not an age such as 90s"),
    ],
)
def test_a_bad_filter_is_a_usage_error(
    dsn: str, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--dsn", dsn, "jobs", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
