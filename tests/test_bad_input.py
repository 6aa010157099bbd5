"""The bad-input matrix: a clear message, nothing lost, the worker alive or replaced, for each bad input.

Rows a worker reads are written by SQL (bypassing every check enqueue
makes) and run in-process; what kills or hangs a process runs under a real
`fastjobs run` master (tests/procs.py). "Nothing lost" means the job ends in
a visible state (completed, retryable or discarded with its error recorded,
or still queued) and the other jobs of its batch complete.
"""

# The matrix: input -> expected -> test (in this file unless a file is named).
#
# ROWS NO HANDLER CAN RUN
# a kind the enqueuing App does not know (a typo) -> refused at the call, UnknownKind naming
#     the close matches, nothing inserted (app.declare for kinds handled elsewhere); a conn= of
#     another driver, of the other API, closed or in a failed transaction -> TypeError or
#     ValueError, nothing sent: test_enqueue_mistakes
# unknown kind in a batch of good jobs -> retryable (another deploy may know it), error
#     naming the kind, the batch completes: test_worker::test_bad_rows_fail_alone_and_the_
#     batch_completes; odd characters in it, and discarded at its last attempt:
#     test_unknown_kind_is_named_exactly_and_discarded_after_its_last_attempt
# a registered kind with odd characters -> runs: test_a_kind_with_odd_characters_runs
# args not a JSON object (array, string, number, bool, null) -> discarded, "args must be a
#     JSON object, not T", the batch completes: test_args_that_are_not_an_object_discard_
#     that_job_only (list, int: also test_worker); enqueue refuses them:
#     test_enqueue::test_args_that_are_not_a_mapping_raise_type_error
# args jsonb holds but Python cannot decode (1e400; deeper than orjson's limit) ->
#     discarded, "args do not decode: ...", args kept: test_args_that_do_not_decode_...
# '{}', nested args; missing or extra keys -> run as given; a mismatch is retryable with
#     Python's TypeError naming the argument: test_args_that_do_not_match_the_handler_...;
#     enqueue checks them: test_enqueue::test_arguments_are_checked_against_the_handler
#
# CORRUPT ROWS WRITTEN BY HAND
# what the schema refuses at INSERT (empty/long queue or kind, NUL, attempt < 0,
#     max_attempts <= 0, smallint overflow, NULL/invalid/NUL args, unknown state, bad
#     run_at) -> PostgreSQL's error naming the constraint or type:
#     test_the_schema_rejects_impossible_rows
# what it allows (attempt > max_attempts, attempt 32766, max_attempts 32767, priority
#     extremes, run_at -infinity/BC/infinity/294276, scheduled/retryable already due,
#     errors not a list) -> each runs once, in claim order, or waits visibly:
#     test_odd_values_the_schema_allows_run_or_wait_visibly
# a queue name with odd characters -> served: test_a_queue_with_odd_characters_is_served
# attempt 32767 -> runs as its last attempt, the queue goes on:
#     test_an_attempt_at_the_smallint_limit_does_not_stop_the_queue
# 'running' by hand, never attempted -> rescued: test_a_running_row_without_attempt_is_rescued
# run_at -infinity/infinity/BC -> `stats` (no age), `jobs list` (as text) show them:
#     test_stats_shows_rows_with_extreme_run_at, test_jobs_list_shows_rows_with_extreme_run_at
#
# ENORMOUS ARGS
# 10-30 MB by enqueue, enqueue_many and SQL; 40 x 1 MB in one batch -> stored, run
#     intact: test_enormous_args_*, test_many_large_jobs_in_one_batch
#
# HANDLERS
# returns non-None -> completed: test_a_handler_may_return_anything
# a plain def returns a coroutine -> retryable, "declare it `async def`":
#     test_worker::test_plain_def_returning_a_coroutine_fails (inline and with a timeout)
# an exception whose str() raises -> retryable, "<exception str() failed: ...>":
#     test_an_exception_whose_str_raises_fails_that_job_only
# an enormous exception message -> recorded, cut to 10,000 characters:
#     test_an_enormous_exception_message_is_recorded_bounded
# SystemExit, KeyboardInterrupt in-process -> recorded, the batch given back, propagates:
#     test_worker::test_fatal_exception_*; any other BaseException alike:
#     test_another_base_exception_is_recorded_and_stops_the_worker
# sys.exit, KeyboardInterrupt, BaseException under a master -> recorded, worker replaced,
#     the rest run exactly once: test_a_handler_that_ends_its_worker_is_recorded_and_replaced
# os._exit under a master -> worker replaced, the job rescued ("worker ... died"; discarded
#     at its last attempt), the rest run: test_a_handler_that_exits_the_process_is_rescued_...
# a sync handler hung past its timeout -> JobTimeout, retryable:
#     test_worker::test_sync_handler_past_its_timeout_fails_with_job_timeout (async: test_worker::
#     test_async_handler_past_its_timeout_fails_with_job_timeout); under a master the same
#     worker goes on: test_a_hung_handler_with_a_timeout_fails_and_the_worker_goes_on
# hung without a timeout -> the watchdog kills and replaces the worker: test_master::
#     test_the_watchdog_replaces_a_worker_hung_in_c (hung in C); the job is rescued:
#     test_a_hung_handler_without_a_timeout_is_killed_replaced_and_rescued
# a sync job running past the rescue delay on a live worker -> its heartbeat keeps it:
#     test_a_live_worker_running_a_job_longer_than_the_rescue_delay_keeps_it
#
# OPTIONS AND TERMINALS
# `fastjobs run --batch-max` < 1, `--leader-key` outside bigint -> usage error, exit 2, before
#     anything starts: test_fastjobs_run_refuses_a_bad_option_before_anything_starts
# delays over 1,000 years, run_at outside years 1-9999 UTC -> ValueError:
#     test_enqueue::test_bad_options_raise_value_error_*; a `conn=` with any row factory works:
#     test_enqueue::test_transactional_enqueue_*_whatever_the_row_factory
# control characters in kinds, args, errors -> escaped by `jobs show` and `list`:
#     test_jobs_cli::test_show_and_list_escape_control_characters_of_job_input
#
# A WRONG DSN (bad host, bad port, unknown role, no such database, garbage)
# App.enqueue, `fastjobs migrate`, `stats`, `jobs list` -> where it tried (host:port/db) and
#     why, exit 1, no traceback, no password: test_a_wrong_dsn_is_named_without_its_password
#     (port 1 with enqueue_many and enqueue_async: test_dsn::test_unreachable_database_*).
#     Both test servers trust any password: an unknown role stands in for a wrong one.
# `fastjobs run` -> the same, from the master before it forks, the boot error code:
#     test_fastjobs_run_with_a_wrong_dsn_exits_clearly
#
# NO SCHEMA, OR AN OLD ONE
# enqueue (single, bulk, unique, bulk unique, async), Worker.run on a database without the
#     schema -> SchemaMissing, "run `fastjobs migrate`":
#     test_the_api_on_a_database_without_the_schema_says_to_migrate (and app.cancel);
#     `fastjobs run`: test_master::test_a_database_without_the_schema_stops_the_master_with_
#     the_boot_error_code; `fastjobs stats`: test_stats::test_stats_without_the_schema_says_to_
#     migrate; `fastjobs jobs list`: test_jobs_cli::test_a_database_without_the_schema_says_to_migrate
# a schema at 001 only: Worker.run, `fastjobs stats`, `jobs list`, `run` say to migrate:
#     test_an_out_of_date_schema_stops_*; enqueue: test_an_out_of_date_schema_enqueue_says_to_migrate

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from fastjobs import (
    App,
    FastjobsError,
    SchemaMissing,
    Worker,
    WorkerConfig,
    database,
    maintenance,
    schema,
    sql,
)
from fastjobs.children import EXIT_BOOT_ERROR
from fastjobs.cli import main
from fastjobs.cli.command import _parser
from fastjobs.testing import Drained

from . import procs
from .helpers import OVERLAP, WorkerThread, drain, insert_raw, jobs, query, run_one_batch, wait_for
from .procs import runs

MB = 1 << 20


def rows_by_id(dsn: str) -> dict[int, dict[str, Any]]:
    """Every job row but its args (which Python's json may not load: see the nesting test), by id."""
    rows = query(
        dsn,
        "SELECT id, queue, kind, state::text, attempt, max_attempts, errors, finalized_at"
        " FROM fastjobs_jobs_all ORDER BY id",
    )
    return {r["id"]: r for r in rows}


def insert_row(dsn: str, **columns: Any) -> int:
    """One job row with these column values (parameters PostgreSQL casts to each column's type); its id."""
    names = ", ".join(columns)
    marks = ", ".join(["%s"] * len(columns))
    rows = query(
        dsn, f"INSERT INTO fastjobs_jobs ({names}) VALUES ({marks}) RETURNING id", tuple(columns.values())
    )
    return int(rows[0]["id"])


def only_error(row: dict[str, Any]) -> str:
    [error] = row["errors"]
    return str(error["error"])


# --- rows no handler can run -------------------------------------------------------------------


ODD_KINDS = [
    "billing.charge v2",
    "émail.envoyé ✉",
    "quote\"and'apostrophe",
    "new\nline\ttab",
    "k" * 512,
]


@pytest.mark.parametrize("kind", ODD_KINDS, ids=["space", "unicode", "quotes", "control", "longest"])
def test_unknown_kind_is_named_exactly_and_discarded_after_its_last_attempt(app: App, dsn: str, kind: str):
    seen = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        seen.append(n)

    first = insert_raw(dsn, "ok", '{"n": 1}')
    retried = insert_raw(dsn, kind, "{}")
    last_attempt = insert_row(dsn, kind=kind, args="{}", max_attempts=1)
    last = insert_raw(dsn, "ok", '{"n": 2}')
    assert run_one_batch(app, 4, keep_completed=True) == 4

    rows = rows_by_id(dsn)
    assert seen == [1, 2]
    assert rows[first]["state"] == rows[last]["state"] == "completed"
    # The error says where this worker's handlers come from, and how to add one.
    message = (
        f"no handler registered for job kind {kind!r}: this worker's handlers come from the modules"
        f" {__name__}; register one with @app.job in a module the worker imports (the one `fastjobs"
        " run` names, or one that module imports). "
    )
    retry = "Retried meanwhile: a rolling deploy may bring the handler"
    last_word = (
        "It had no attempts left: discarded (give the kind max_attempts > 1 to ride out a rolling deploy)"
    )
    assert (rows[retried]["state"], only_error(rows[retried])) == ("retryable", message + retry)
    assert (rows[last_attempt]["state"], only_error(rows[last_attempt])) == ("discarded", message + last_word)
    assert rows[last_attempt]["finalized_at"] is not None


def test_a_kind_with_odd_characters_runs(app: App, dsn: str):
    seen = []
    for kind in ODD_KINDS:
        app.job(kind=kind)(lambda n, kind=kind: seen.append((kind, n)))
        insert_raw(dsn, kind, '{"n": 7}')
    assert app.testing().drain() == Drained(completed=len(ODD_KINDS))
    assert sorted(seen) == sorted((kind, 7) for kind in ODD_KINDS)


NOT_OBJECTS = {"[]": "list", '["n", 1]': "list", '"text"': "str", "42": "int", "1.5": "float"}
NOT_OBJECTS |= {"true": "bool", "false": "bool", "null": "NoneType"}


@OVERLAP
def test_args_that_are_not_an_object_discard_that_job_only(app: App, dsn: str, overlap: bool):
    seen = []

    @app.job(kind="ok")
    def ok(n: int = 0) -> None:
        seen.append(n)

    good = [insert_raw(dsn, "ok", '{"n": 0}')]
    bad = {}
    for n, (args, shape) in enumerate(NOT_OBJECTS.items(), 1):
        bad[insert_raw(dsn, "ok", args)] = shape
        good.append(insert_raw(dsn, "ok", f'{{"n": {n}}}'))
    size = len(good) + len(bad)
    assert run_one_batch(app, size, overlap=overlap, keep_completed=True) == size

    rows = rows_by_id(dsn)
    assert sorted(seen) == list(range(len(good)))
    assert {rows[i]["state"] for i in good} == {"completed"}
    for job_id, shape in bad.items():
        row = rows[job_id]
        assert (row["state"], row["attempt"]) == ("discarded", 1)
        assert only_error(row) == f"args must be a JSON object, not {shape}"
        assert row["finalized_at"] is not None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ('{"n": 1e400}', "number is infinity"),
        ('{"n": ' + "[" * 1100 + "]" * 1100 + "}", "depth limit"),
    ],
    ids=["beyond-float", "nested-too-deep"],
)
def test_args_that_do_not_decode_discard_that_job_only(app: App, dsn: str, args: str, reason: str):
    """jsonb keeps numbers and depths Python's decoder refuses: that job can never run."""
    seen = []

    @app.job(kind="ok")
    def ok(n: Any = None) -> None:
        seen.append(n)

    before = insert_raw(dsn, "ok", '{"n": 1}')
    bad = insert_raw(dsn, "ok", args)
    after = insert_raw(dsn, "ok", '{"n": 2}')
    assert run_one_batch(app, 3, keep_completed=True) == 3

    rows = rows_by_id(dsn)
    assert seen == [1, 2]
    assert rows[before]["state"] == rows[after]["state"] == "completed"
    assert rows[bad]["state"] == "discarded"
    error = only_error(rows[bad])
    assert error.startswith("args do not decode: ") and reason in error, error
    # The args are still there, for a human to repair and `fastjobs jobs retry`.
    [kept] = query(dsn, "SELECT args = %s::jsonb AS same FROM fastjobs_jobs_all WHERE id = %s", (args, bad))
    assert kept["same"]


@OVERLAP
def test_args_that_do_not_match_the_handler_fail_that_job_only(app: App, dsn: str, overlap: bool):
    got: list[tuple[Any, Any]] = []

    @app.job(kind="greet")
    def greet(name: Any, punctuation: str = "!") -> None:
        got.append((name, punctuation))

    @app.job(kind="defaults")
    def defaults(n: int = 5) -> None:
        got.append(("defaults", n))

    empty = insert_raw(dsn, "defaults", "{}")
    nested = insert_raw(dsn, "greet", '{"name": {"first": ["a", {"b": null, "c": 1.5}]}, "punctuation": "?"}')
    missing = insert_raw(dsn, "greet", '{"punctuation": "?"}')
    extra = insert_raw(dsn, "greet", '{"name": "b", "shout": true}')
    plain = insert_raw(dsn, "greet", '{"name": "c"}')
    assert run_one_batch(app, 5, overlap=overlap, keep_completed=True) == 5

    rows = rows_by_id(dsn)
    assert got == [("defaults", 5), ({"first": ["a", {"b": None, "c": 1.5}]}, "?"), ("c", "!")]
    assert {rows[i]["state"] for i in (empty, nested, plain)} == {"completed"}
    # Retried, not discarded: a deploy of the handler that matches may come.
    for job_id, detail in (
        (missing, "missing 1 required positional argument: 'name'"),
        (extra, "got an unexpected keyword argument 'shout'"),
    ):
        assert rows[job_id]["state"] == "retryable"
        assert only_error(rows[job_id]).startswith("TypeError: ")
        assert ".greet() " in only_error(rows[job_id])
        assert detail in only_error(rows[job_id])


# --- corrupt rows written by hand --------------------------------------------------------------


# (columns of the row, the error PostgreSQL raises, what its message names)
IMPOSSIBLE: list[tuple[dict[str, Any], type[psycopg.Error], str]] = [
    ({"kind": "k", "queue": ""}, psycopg.errors.CheckViolation, "fastjobs_jobs_queue_check"),
    ({"kind": "k", "queue": "q" * 129}, psycopg.errors.CheckViolation, "fastjobs_jobs_queue_check"),
    ({"kind": ""}, psycopg.errors.CheckViolation, "fastjobs_jobs_kind_check"),
    ({"kind": "k" * 513}, psycopg.errors.CheckViolation, "fastjobs_jobs_kind_check"),
    ({"kind": "k", "attempt": -1}, psycopg.errors.CheckViolation, "fastjobs_jobs_attempt_check"),
    ({"kind": "k", "max_attempts": 0}, psycopg.errors.CheckViolation, "fastjobs_jobs_max_attempts_check"),
    ({"kind": "k", "max_attempts": -3}, psycopg.errors.CheckViolation, "fastjobs_jobs_max_attempts_check"),
    ({"kind": "k", "priority": 32768}, psycopg.errors.NumericValueOutOfRange, "smallint out of range"),
    ({"kind": "k", "max_attempts": 40000}, psycopg.errors.NumericValueOutOfRange, "smallint out of range"),
    ({"kind": "k", "args": None}, psycopg.errors.NotNullViolation, '"args"'),
    ({"kind": "k", "args": "{bad"}, psycopg.errors.InvalidTextRepresentation, "type json"),
    ({"kind": "k", "args": '{"a": "\\u0000"}'}, psycopg.errors.UntranslatableCharacter, "\\u0000"),
    ({"kind": "k", "state": "bogus"}, psycopg.errors.InvalidTextRepresentation, "fastjobs_state"),
    ({"kind": "k", "run_at": "tomorrow-ish"}, psycopg.errors.InvalidDatetimeFormat, "timestamp"),
]


def test_the_schema_rejects_impossible_rows(dsn: str):
    for columns, error, message in IMPOSSIBLE:
        with pytest.raises(error) as excinfo:
            insert_row(dsn, **columns)
        assert message in str(excinfo.value), columns
    with pytest.raises(psycopg.DataError, match="NUL"):  # refused by psycopg before it is sent
        insert_raw(dsn, "bad\x00kind", "{}")
    assert jobs(dsn) == []


def test_odd_values_the_schema_allows_run_or_wait_visibly(app: App, dsn: str):
    order = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        order.append(n)

    @app.job(kind="fails")
    def fails(n: int) -> None:
        order.append(n)
        raise ValueError(f"fails {n}")

    def row(n: int, kind: str = "ok", **columns: Any) -> int:
        return insert_row(dsn, kind=kind, args=json.dumps({"n": n}), **columns)

    past_max_ok = row(1, attempt=9, max_attempts=2)
    past_max_fails = row(2, "fails", attempt=5, max_attempts=3)
    highest = row(3, priority=32767)
    lowest = row(4, priority=-32768)
    minus_infinity = row(5, run_at="-infinity")
    before_christ = row(6, run_at="0044-03-15 BC")
    infinity = row(7, run_at="infinity")
    last_year = row(8, run_at="294276-12-31 00:00:00+00")
    scheduled_due = row(9, state="scheduled", run_at="2000-01-01T00:00:00Z")
    retryable_due = row(10, state="retryable", run_at="2000-01-01T00:00:00Z")
    errors_not_a_list = row(11, "fails", errors='"corrupt"', max_attempts=1)
    most_attempts = row(12, max_attempts=32767)
    scheduled_never = row(13, state="scheduled", run_at="infinity")
    next_to_last = row(14, attempt=32766, max_attempts=32767)
    drain(app, batch_max=1, keep_completed=True)

    # Each due job ran once: highest priority first; then by run_at (-infinity
    # before 44 BC before now), then id; the lowest priority after every other
    # available job. The scheduled and retryable ones run once promoted (when
    # the worker's scheduler finds a claim empty), in their order.
    assert [n for n in order if n not in (9, 10)] == [3, 5, 6, 1, 2, 11, 12, 14, 4]
    assert sorted(order) == [1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 14] and order.index(9) < order.index(10)
    rows = rows_by_id(dsn)
    for job_id in (
        highest,
        lowest,
        minus_infinity,
        before_christ,
        scheduled_due,
        retryable_due,
        most_attempts,
    ):
        assert (rows[job_id]["state"], rows[job_id]["attempt"]) == ("completed", 1)
    # Past its max_attempts: one more run; a failure discards it at once.
    assert (rows[past_max_ok]["state"], rows[past_max_ok]["attempt"]) == ("completed", 10)
    assert (rows[next_to_last]["state"], rows[next_to_last]["attempt"]) == ("completed", 32767)
    assert (rows[past_max_fails]["state"], rows[past_max_fails]["attempt"]) == ("discarded", 6)
    assert only_error(rows[past_max_fails]) == "ValueError: fails 2"
    # An errors value that is not a list keeps it, with the new record after it.
    corrupt, record = rows[errors_not_a_list]["errors"]
    assert (rows[errors_not_a_list]["state"], corrupt, record["error"]) == (
        "discarded",
        "corrupt",
        "ValueError: fails 11",
    )
    # Due never (or in the year 294276): waiting, untouched, not blocking the rest.
    for job_id, state in ((infinity, "available"), (last_year, "available"), (scheduled_never, "scheduled")):
        assert (rows[job_id]["state"], rows[job_id]["attempt"], rows[job_id]["errors"]) == (state, 0, None)


def test_an_attempt_at_the_smallint_limit_does_not_stop_the_queue(app: App, dsn: str):
    seen = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        seen.append(n)

    poison = insert_row(dsn, kind="ok", args='{"n": 1}', attempt=32767)  # the schema allows it
    good = insert_raw(dsn, "ok", '{"n": 2}')
    drain(app, keep_completed=True)

    rows = rows_by_id(dsn)
    assert seen == [1, 2]
    assert (rows[good]["state"], rows[good]["attempt"]) == ("completed", 1)
    assert (rows[poison]["state"], rows[poison]["attempt"]) == ("completed", 32767)


def test_a_running_row_without_attempt_is_rescued(dsn: str):
    stuck = insert_row(dsn, kind="ok", state="running")  # the schema allows it: attempt 0, no worker
    with psycopg.connect(dsn, autocommit=True) as conn:
        [now] = conn.execute("SELECT now() + interval '1 hour'").fetchone() or [None]
        maintenance.rescue_once(conn, now=now)
    assert rows_by_id(dsn)[stuck]["state"] == "retryable"


def test_a_queue_with_odd_characters_is_served(app: App, dsn: str):
    queue = "émails, 2:urgent/ü " + "q" * 100
    seen = []
    app.job(kind="ok", queue=queue)(lambda n: seen.append(n))
    for n in range(3):
        insert_raw(dsn, "ok", f'{{"n": {n}}}', queue=queue)
    assert app.testing().drain(queue=queue) == Drained(completed=3)
    assert sorted(seen) == [0, 1, 2]


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


EXTREME_RUN_AT = ["-infinity", "infinity", "0044-03-15 BC"]


def test_stats_shows_rows_with_extreme_run_at(dsn: str, capsys: pytest.CaptureFixture[str]):
    for n, at in enumerate(EXTREME_RUN_AT):
        insert_row(dsn, kind=f"k{n}", run_at=at)
    assert main(["--dsn", dsn, "stats"]) == 0
    assert "available" in capsys.readouterr().out
    assert main(["--dsn", dsn, "stats", "--json"]) == 0
    [depth] = strict_json(capsys.readouterr().out)["queues"]
    assert (depth["queue"], depth["state"], depth["count"]) == ("default", "available", 3)


@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
def test_jobs_list_shows_rows_with_extreme_run_at(
    dsn: str, capsys: pytest.CaptureFixture[str], as_json: bool
):
    ids = [insert_row(dsn, kind=f"k{n}", run_at=at) for n, at in enumerate(EXTREME_RUN_AT)]
    assert main(["--dsn", dsn, "jobs", "list", *(["--json"] if as_json else [])]) == 0
    out, _ = capsys.readouterr()
    if as_json:
        assert sorted(job["id"] for job in json.loads(out)) == ids
    else:
        assert all(f"k{n}" in out for n in range(len(EXTREME_RUN_AT)))


# --- enormous args -----------------------------------------------------------------------------


def blob_kind(app: App) -> dict[str, tuple[int, str]]:
    """Register kind "blob": records the size and digest of its `blob` argument by `n`."""
    seen: dict[str, tuple[int, str]] = {}

    @app.job(kind="blob")
    def blob(n: str, blob: str) -> None:
        seen[n] = (len(blob), hashlib.sha256(blob.encode()).hexdigest())

    return seen


def digest(text: str) -> tuple[int, str]:
    return len(text), hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("how", ["enqueue", "enqueue_many"])
def test_enormous_args_by_enqueue_run_intact(app: App, dsn: str, how: str):
    seen = blob_kind(app)
    blobs = {"a": "é" * (8 * MB), "b": "x" * (10 * MB)}  # 16 MB and 10 MB of UTF-8
    if how == "enqueue":
        for n, blob in blobs.items():
            app.enqueue("blob", {"n": n, "blob": blob})
    else:
        assert app.enqueue_many("blob", ({"n": n, "blob": blob} for n, blob in blobs.items())) == 2
    sizes = query(dsn, "SELECT octet_length(args->>'blob') AS size FROM fastjobs_jobs_all ORDER BY id")
    assert [r["size"] for r in sizes] == [16 * MB, 10 * MB]
    drain(app)
    assert seen == {n: digest(blob) for n, blob in blobs.items()}
    assert jobs(dsn) == []


def test_enormous_args_written_by_sql_run_intact(app: App, dsn: str):
    seen = blob_kind(app)
    query(
        dsn,
        "INSERT INTO fastjobs_jobs (kind, args) VALUES"
        " ('blob', jsonb_build_object('n', 'sql', 'blob', repeat('xyz', %s)))",
        (30 * MB // 3,),
    )
    drain(app)
    assert seen == {"sql": digest("xyz" * (30 * MB // 3))}
    assert jobs(dsn) == []


def test_many_large_jobs_in_one_batch(app: App, dsn: str):
    seen = blob_kind(app)
    blobs = {str(n): f"{n:02d}" * (MB // 2) for n in range(40)}
    app.enqueue_many("blob", ({"n": n, "blob": blob} for n, blob in blobs.items()))
    assert run_one_batch(app, 40) == 40
    assert seen == {n: digest(blob) for n, blob in blobs.items()}
    assert jobs(dsn) == []


# --- handlers that misbehave, in-process --------------------------------------------------------


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


class Abort(BaseException):
    """Not an Exception: like gevent's GreenletExit, or a test framework's outcome."""


RETURNS: dict[str, Callable[[], Any]] = {
    "int": lambda: 42,
    "dict": lambda: {"a": [1, 2]},
    "object": lambda: object(),
    "generator": lambda: (n for n in range(3)),
    "exception": lambda: ValueError("returned, not raised"),
}


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["inline", "with-timeout"])
def test_a_handler_may_return_anything(app: App, dsn: str, timeout: float | None):
    for name, make in RETURNS.items():
        app.job(kind=name, timeout=timeout)(make)
        insert_raw(dsn, name, "{}")
    assert run_one_batch(app, len(RETURNS), keep_completed=True) == len(RETURNS)
    assert {(r["kind"], r["state"], r["errors"]) for r in jobs(dsn)} == {
        (name, "completed", None) for name in RETURNS
    }


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["inline", "with-timeout"])
def test_an_exception_whose_str_raises_fails_that_job_only(app: App, dsn: str, timeout: float | None):
    seen = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        seen.append(n)

    @app.job(kind="bad", timeout=timeout)
    def bad() -> None:
        raise StrRaises

    before = insert_raw(dsn, "ok", '{"n": 1}')
    failing = insert_raw(dsn, "bad", "{}")
    after = insert_raw(dsn, "ok", '{"n": 2}')
    assert run_one_batch(app, 3, keep_completed=True) == 3  # one run each (a drain: ~1 s backoff)

    rows = rows_by_id(dsn)
    assert seen == [1, 2]
    assert rows[before]["state"] == rows[after]["state"] == "completed"
    assert rows[failing]["state"] == "retryable"
    assert only_error(rows[failing]).startswith("StrRaises")
    assert "StrRaises" in rows[failing]["errors"][0]["traceback"]


def test_an_enormous_exception_message_is_recorded_bounded(app: App, dsn: str):
    seen = []

    @app.job(kind="ok")
    def ok(n: int) -> None:
        seen.append(n)

    @app.job(kind="loud")
    def loud() -> None:
        raise ValueError("spam " * (2 * MB))

    before = insert_raw(dsn, "ok", '{"n": 1}')
    failing = insert_raw(dsn, "loud", "{}")
    after = insert_raw(dsn, "ok", '{"n": 2}')
    assert run_one_batch(app, 3, keep_completed=True) == 3

    rows = rows_by_id(dsn)
    assert seen == [1, 2]
    assert rows[before]["state"] == rows[after]["state"] == "completed"
    assert rows[failing]["state"] == "retryable"
    assert only_error(rows[failing]).startswith("ValueError: spam spam")
    [size] = query(
        dsn, "SELECT octet_length(errors::text) AS n FROM fastjobs_jobs_all WHERE id = %s", (failing,)
    )
    assert size["n"] < MB


@OVERLAP
@pytest.mark.parametrize("timeout", [None, 5.0], ids=["inline", "with-timeout"])
def test_another_base_exception_is_recorded_and_stops_the_worker(
    app: App, dsn: str, overlap: bool, timeout: float | None
):
    """Like SystemExit (test_worker): recorded, the rest given back, then it stops the worker."""
    ran = []

    @app.job(kind="step", timeout=timeout)
    def step(n: int) -> None:
        ran.append(n)
        if n == 3:
            raise Abort(f"abort at {n}")

    app.enqueue_many("step", ({"n": n} for n in range(10)))
    with pytest.raises(Abort):
        drain(app, overlap=overlap, keep_completed=True)

    rows = {r["args"]["n"]: r for r in jobs(dsn)}
    assert ran == [0, 1, 2, 3]
    assert {rows[n]["state"] for n in (0, 1, 2)} == {"completed"}
    assert (rows[3]["state"], only_error(rows[3])) == ("retryable", "Abort: abort at 3")
    assert {(rows[n]["state"], rows[n]["attempt"]) for n in range(4, 10)} == {("available", 0)}


# --- handlers that end or hang their process, under a real master ------------------------------


BAD_MODULE = "fjbad"

# Each execution inserts a row into `runs` before misbehaving (as procs.JOBS does).
BAD_JOBS = '''
"""Handlers that end or hang the process running them."""

import ctypes
import os
import sys
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


class Abort(BaseException):
    pass


@app.job("good")
def good(n):
    _record(n)


@app.job("os_exit")
def os_exit(n):
    _record(n)
    os._exit(7)


@app.job("sys_exit")
def sys_exit(n):
    _record(n)
    sys.exit(3)


@app.job("interrupt")
def interrupt(n):
    _record(n)
    raise KeyboardInterrupt


@app.job("abort")
def abort(n):
    _record(n)
    raise Abort("abort from a handler")


@app.job("hang")
def hang(n):
    """Hangs in C holding the GIL, with no timeout: only the master's watchdog ends it."""
    _record(n)
    r, w = os.pipe()  # nobody writes; w stays open so the read never sees EOF
    ctypes.PyDLL(None).read(r, ctypes.create_string_buffer(1), 1)  # PyDLL keeps the GIL


@app.job("hang_timeout", timeout=1)
def hang_timeout(n):
    _record(n)
    time.sleep(3600)
'''


@pytest.fixture
def masters(tmp_path: Path, dsn: str) -> Iterator[procs.Masters]:
    procs.create_runs_table(dsn)
    (tmp_path / f"{BAD_MODULE}.py").write_text(textwrap.dedent(BAD_JOBS))
    with procs.Masters(tmp_path, dsn) as m:
        yield m


def job_row(db: psycopg.Connection[Any], job_id: int) -> tuple[str, int, list[Any]] | None:
    row = db.execute(
        "SELECT state::text, attempt, coalesce(errors, '[]') FROM fastjobs_jobs_all WHERE id = %s", (job_id,)
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def goods_left(db: psycopg.Connection[Any]) -> int:
    return procs.count(db, "SELECT count(*) FROM fastjobs_jobs_all WHERE kind = 'good'")


GOOD = 30

# How long after its worker died `fastjobs run --rescue-after 5` rescues a job:
# its last heartbeat (every 2 s) goes stale within 5 s, the rescuer looks every
# 5/3 s; the rest is slack for a loaded machine. Below the default delay (15 s),
# so a master that ignored --rescue-after fails.
RESCUE = 10.0


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("sys_exit", "SystemExit: 3"),
        ("interrupt", "KeyboardInterrupt: "),
        ("abort", "Abort: abort from a handler"),
    ],
)
def test_a_handler_that_ends_its_worker_is_recorded_and_replaced(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any], kind: str, error: str
):
    app.enqueue_many("good", ({"n": n} for n in range(GOOD // 2)))
    bad = app.enqueue(kind, {"n": -1}, max_attempts=1)
    app.enqueue_many("good", ({"n": n} for n in range(GOOD // 2, GOOD)))
    master = masters.start("--processes", "1", module=BAD_MODULE)

    victim = master.wait_stderr(r"worker 1 \(pid (\d+)\) exited with 1; restarting")[1]
    procs.wait_for(lambda: goods_left(db) == 0, "every good job to finish")
    # Recorded by the worker it ended, at its last attempt: discarded with the exception.
    state, attempt, errors = job_row(db, bad) or ("gone", 0, [])
    assert (state, attempt, [e["error"] for e in errors]) == ("discarded", 1, [error])
    assert runs(db) == Counter({n: 1 for n in [-1, *range(GOOD)]})  # nothing twice, nothing lost
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(int(victim),))
    assert procs.alive(heir)
    assert master.stop() == 0, master.stderr()


def test_a_handler_that_exits_the_process_is_rescued_and_its_worker_replaced(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
):
    app.enqueue_many("good", ({"n": n} for n in range(GOOD // 2)))
    bad = app.enqueue("os_exit", {"n": -1}, max_attempts=1)
    app.enqueue_many("good", ({"n": n} for n in range(GOOD // 2, GOOD)))
    master = masters.start("--processes", "1", "--rescue-after", "5", module=BAD_MODULE)

    victim = master.wait_stderr(r"worker 1 \(pid (\d+)\) exited with 7; restarting")[1]
    # Nothing recorded the job when its process vanished: the rescuer does, at
    # its last attempt by discarding it; the good jobs of its batch run again.
    # Within --rescue-after (5 s) and a rescuer's round (5/3 s), well before the default 15 s.
    procs.wait_for(
        lambda: (job_row(db, bad) or ("",))[0] == "discarded",
        "the rescuer to discard the job",
        timeout=RESCUE,
    )
    procs.wait_for(lambda: goods_left(db) == 0, "every good job to finish")
    _, _, errors = job_row(db, bad) or ("", 0, [])
    [error] = [e["error"] for e in errors]
    assert re.fullmatch(rf"worker \S+:{victim}:\w+ died while running the job \(crash 1\)", error), error
    ran = runs(db)
    assert ran[-1] == 1 and set(ran) == {-1, *range(GOOD)}  # the good ones at least once
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(int(victim),))
    assert procs.alive(heir)
    assert master.stop() == 0, master.stderr()


def test_a_live_worker_running_a_job_longer_than_the_rescue_delay_keeps_it(app: App, dsn: str):
    """The worker's control thread heartbeats while the main thread runs a long job: a rescuer
    with a 3 s delay, run again and again past those 3 s, leaves the job to its worker."""
    started = threading.Event()
    release = threading.Event()

    @app.job(kind="long")
    def long() -> None:
        started.set()
        release.wait(10)

    app.enqueue("long")
    config = maintenance.RescuerConfig(stale_after=3.0)
    rescued: list[dict[str, int]] = []
    with (
        WorkerThread(Worker(app, config=WorkerConfig(poll_interval=60.0))),
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        assert started.wait(10)
        began = time.monotonic()
        tick = threading.Event()
        while (running := time.monotonic() - began) < 4.2:
            if running > 3.2:  # the job has run past the delay (its worker registered before it)
                rescued.append(maintenance.rescue_once(conn, config=config))
            tick.wait(0.1)
        release.set()
        assert wait_for(lambda: jobs(dsn) == [])
    assert rescued and all(counts == {} for counts in rescued), rescued


def test_a_hung_handler_with_a_timeout_fails_and_the_worker_goes_on(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
):
    bad = app.enqueue("hang_timeout", {"n": -1}, max_attempts=1)
    app.enqueue_many("good", ({"n": n} for n in range(GOOD)))
    master = masters.start("--processes", "1", module=BAD_MODULE)

    procs.wait_for(lambda: goods_left(db) == 0, "every good job to finish")
    state, attempt, errors = job_row(db, bad) or ("gone", 0, [])
    assert (state, attempt, [e["error"] for e in errors]) == (
        "discarded",
        1,
        ["JobTimeout: job ran longer than its timeout of 1s"],
    )
    # One worker ran everything: it was never replaced.
    pids = {pid for (pid,) in db.execute("SELECT DISTINCT pid FROM runs")}
    assert len(pids) == 1 and procs.alive(pids.pop())
    assert "restarting" not in master.stderr()
    assert master.stop() == 0, master.stderr()


def test_a_hung_handler_without_a_timeout_is_killed_replaced_and_rescued(
    masters: procs.Masters, app: App, db: psycopg.Connection[Any]
):
    bad = app.enqueue("hang", {"n": -1}, max_attempts=1)
    master = masters.start(
        "--processes", "1", "--worker-timeout", "2", "--rescue-after", "5", module=BAD_MODULE
    )
    procs.wait_for(lambda: runs(db)[-1] == 1, "the hanging job to start")
    hung = master.wait_child("fastjobs: worker 1 ")
    master.wait_stderr(
        rf"worker 1 \(pid {hung}\) sent no heartbeat for 2s \(hung or stopped\); killing it", timeout=15
    )
    killed = time.monotonic()
    heir = master.wait_child("fastjobs: worker 1 ", exclude=(hung,))
    app.enqueue_many("good", ({"n": n} for n in range(GOOD)))
    procs.wait_for(lambda: goods_left(db) == 0, "the new worker to run the good jobs")
    procs.wait_for(
        lambda: (job_row(db, bad) or ("",))[0] == "discarded",
        "the rescuer to discard the job",
        timeout=max(killed + RESCUE - time.monotonic(), 0.1),
    )
    _, _, errors = job_row(db, bad) or ("", 0, [])
    [error] = [e["error"] for e in errors]
    assert re.fullmatch(rf"worker \S+:{hung}:\w+ died while running the job \(crash 1\)", error), error
    assert runs(db)[-1] == 1
    assert procs.alive(heir)
    assert master.stop() == 0, master.stderr()


# --- a wrong DSN ----------------------------------------------------------------------------------


PASSWORD = "Pw-7f3c9e-secret"


def wrong_dsn(case: str, good: str) -> str:
    """A DSN of the kind `case` names, with PASSWORD in it; `good` is the test server's."""
    if case == "bad-host":
        return f"postgresql://fastjobs:{PASSWORD}@fastjobs-no-such-host.invalid:5432/db?connect_timeout=5"
    if case == "bad-port":
        return f"postgresql://fastjobs:{PASSWORD}@127.0.0.1:1/db"
    if case == "unknown-role":
        return make_conninfo(good, user="fastjobs_no_such_role", password=PASSWORD)
    if case == "no-such-database":
        return make_conninfo(good, dbname="fastjobs_no_such_database", password=PASSWORD)
    assert case == "garbage"
    return f"not a connection string, password={PASSWORD}"


WRONG = ["bad-host", "bad-port", "unknown-role", "no-such-database", "garbage"]


def expected_message(case: str, bad: str) -> list[str]:
    """What the error must say: where it tried (host:port/dbname) and what went wrong."""
    if case == "garbage":
        return ["does not parse", "expected a URL such as postgresql://USER:PASSWORD@HOST:5432/DBNAME"]
    where = f"cannot connect to PostgreSQL at {database.describe(bad)}"
    reason = {
        "bad-host": "fastjobs-no-such-host.invalid",
        "bad-port": "refused",
        "unknown-role": 'role "fastjobs_no_such_role" does not exist',
        "no-such-database": 'database "fastjobs_no_such_database" does not exist',
    }[case]
    return [where, reason]


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_dsn_is_named_without_its_password(dsn: str, capsys: pytest.CaptureFixture[str], case: str):
    bad = wrong_dsn(case, dsn)
    app = App(bad)
    try:
        with pytest.raises(FastjobsError) as excinfo:
            app.enqueue("k", {"a": 1})
    finally:
        app.close()
    message = str(excinfo.value)
    for part in expected_message(case, bad):
        assert part in message
    assert PASSWORD not in message and PASSWORD not in repr(excinfo.value)
    assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__

    for command in (["migrate"], ["stats"], ["stats", "--json"], ["jobs", "list"]):
        # In-process: an exception main() did not turn into a message would fail the test here.
        assert main(["--dsn", bad, *command]) == 3, command
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("fastjobs: ")
        for part in expected_message(case, bad):
            assert part in err
        assert PASSWORD not in err


@pytest.mark.parametrize("case", WRONG)
def test_fastjobs_run_with_a_wrong_dsn_exits_clearly(masters: procs.Masters, dsn: str, case: str):
    bad = wrong_dsn(case, dsn)
    master = masters.start("--processes", "1", module=BAD_MODULE, dsn=bad)
    procs.wait_for(
        lambda: master.proc.poll() is not None or "restarting" in master.stderr(),
        "the master to exit (or restart a worker)",
        15,
    )
    err = master.stderr()
    assert master.proc.poll() == EXIT_BOOT_ERROR, err
    assert master.forks() == []  # found out before forking
    for part in expected_message(case, bad):
        assert part in err
    assert "Traceback" not in err
    assert "restarting" not in err
    assert PASSWORD not in err


# --- a database without the schema, or with an old one -------------------------------------------


def _enqueue_async(app: App) -> Any:
    return asyncio.run(app.enqueue_async("k", {"a": 1}))


API_CALLS: dict[str, Callable[[App], Any]] = {
    "enqueue": lambda app: app.enqueue("k", {"a": 1}),
    "enqueue_many": lambda app: app.enqueue_many("k", [{"a": 1}, {"a": 2}]),
    "enqueue_unique": lambda app: app.enqueue("k", {"a": 1}, unique_key="u"),
    "enqueue_many_unique": lambda app: app.enqueue_many("unique", [{"a": 1}]),
    "enqueue_async": _enqueue_async,
    "worker": lambda app: Worker(app, exit_when_empty=True).run(),
    "cancel": lambda app: app.cancel(1),
}


@pytest.mark.parametrize("call", API_CALLS)
def test_the_api_on_a_database_without_the_schema_says_to_migrate(empty_dsn: str, call: str):
    app = App(empty_dsn)
    app.job(kind="unique", unique=True)(lambda a: None)  # its bulk enqueue is staged: another path
    app.declare("k")  # enqueued by name beside it (handled elsewhere)
    try:
        with pytest.raises(SchemaMissing, match="run `fastjobs migrate`"):
            API_CALLS[call](app)
    finally:
        app.close()


@pytest.fixture
def old_dsn(empty_dsn: str) -> str:
    """A database at migration 001 only, as an older fastjobs left it."""
    first = schema.migrations()[0]
    with psycopg.connect(empty_dsn) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(sql.migration_table_create)
        cur.execute(first.sql.encode())
        cur.execute(sql.migration_record, (first.version, first.name))
    return empty_dsn


def test_an_out_of_date_schema_enqueue_says_to_migrate(old_dsn: str):
    app = App(old_dsn)
    try:
        with pytest.raises(SchemaMissing, match="run `fastjobs migrate`"):
            app.enqueue("k", {"a": 1})
    finally:
        app.close()


def test_an_out_of_date_schema_stops_the_worker_and_the_cli(old_dsn: str, capsys: pytest.CaptureFixture[str]):
    app = App(old_dsn)
    try:
        with pytest.raises(SchemaMissing, match=r"at 001.*run `fastjobs migrate`"):
            Worker(app, exit_when_empty=True).run()
    finally:
        app.close()
    for command in (["stats"], ["jobs", "list"]):
        assert main(["--dsn", old_dsn, *command]) == 3
        out, err = capsys.readouterr()
        assert out == "" and "run `fastjobs migrate`" in err


def test_an_out_of_date_schema_stops_fastjobs_run(tmp_path: Path, old_dsn: str):
    (tmp_path / f"{BAD_MODULE}.py").write_text(textwrap.dedent(BAD_JOBS))
    with procs.Masters(tmp_path, old_dsn) as masters:
        master = masters.start("--processes", "1", module=BAD_MODULE)
        assert master.wait(15) == EXIT_BOOT_ERROR, master.stderr()
        err = master.stderr()
    assert "at 001" in err and "run `fastjobs migrate`" in err
    assert "Traceback" not in err and "restarting" not in err
    assert query(old_dsn, "SELECT count(*) AS n FROM fastjobs_jobs") == [
        {"n": 0}
    ]  # 001: no fastjobs_jobs_all


# --- options of `fastjobs run` --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--batch-max", "0", "must be at least 1, not 0"),
        ("--batch-max", "-5", "must be at least 1, not -5"),
        ("--batch-max", "many", "'many' is not an integer"),
        ("--leader-key", str(2**63), f"must be between {-(2**63)} and {2**63 - 1} (a bigint), not {2**63}"),
        (
            "--leader-key",
            str(-(2**63) - 1),
            f"must be between {-(2**63)} and {2**63 - 1} (a bigint), not {-(2**63) - 1}",
        ),
    ],
)
def test_fastjobs_run_refuses_a_bad_option_before_anything_starts(
    capsys: pytest.CaptureFixture[str], option: str, value: str, reason: str
):
    """A usage error (exit 2) at parse time: no module imported, no process forked, where workers
    used to stop after one job or crash-loop, and the leader to crash-loop."""
    with pytest.raises(SystemExit) as exited:
        main(["run", f"{option}={value}", "fastjobs_no_such_module"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"fastjobs run: error: argument {option}: {reason}" in err
    assert "fastjobs_no_such_module" not in err


def test_fastjobs_run_takes_the_extreme_leader_keys() -> None:
    for key in (2**63 - 1, -(2**63)):
        assert _parser().parse_args(["run", f"--leader-key={key}", "m"]).leader_key == key
