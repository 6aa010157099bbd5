"""The SQL, proven against PostgreSQL: statements prepare, the claim uses its index, NOTIFY is per queue."""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from fastjobs import App, leader, schema, sql, types
from fastjobs.abc import PG_EPOCH
from fastjobs.bench import queries as bench_queries

from .conftest import _create_database, _drop_database
from .helpers import notifications

PREPARABLE = sorted(set(sql.STATEMENTS) - sql.NOT_PREPARABLE)


def test_statements_are_named_and_the_exclusions_exist():
    names = sql.STATEMENTS
    assert {"job_insert", "job_copy", "job_copy_at", "job_claim_many", "job_get"} <= set(names)
    assert set(names) >= sql.NOT_PREPARABLE, "NOT_PREPARABLE names a statement that does not exist"
    assert all(text.strip() for text in names.values())


def test_the_registry_lists_every_statement_under_its_own_name():
    """STATEMENTS (what every statement test iterates) is collected from the module: it must hold each
    module-level statement of fastjobs/sql.py's source under the name it is assigned to, and SECTIONS
    each of them once, in the order of the contents at the top of the module."""
    tree = ast.parse(Path(sql.__file__).read_text(encoding="utf-8"))
    targets = [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    assigned = [t.id for t in targets if isinstance(t, ast.Name) and t.id[0].islower()]
    assert list(sql.STATEMENTS) == assigned
    assert [name for section in sql.SECTIONS.values() for name in section] == assigned
    contents = (sql.__doc__ or "").split("Contents")[1].splitlines()
    titles = [re.split(r"\s{2,}", line.strip())[0] for line in contents if line.startswith("  ")]
    assert [title.removesuffix(" (family)") for title in titles] == [*sql.SECTIONS, "Registry"]
    assert sorted(sql.FINISH) == [(False, False), (False, True), (True, False), (True, True)]
    assert [name for name, text in sql.FINISH.values() if sql.STATEMENTS[name] is not text] == []
    assert sorted(sql.FINISH_CONTEXT) == sorted(sql.FINISH)
    assert [name for name, text in sql.FINISH_CONTEXT.values() if sql.STATEMENTS[name] is not text] == []
    assert {key: name for key, (name, _) in sql.FINISH_CONTEXT.items()} == {
        key: f"{name}_context" for key, (name, _) in sql.FINISH.items()
    }
    for plain, kept in ((sql.FINISH, sql.FINISH_RESULTS), (sql.FINISH_CONTEXT, sql.FINISH_CONTEXT_RESULTS)):
        assert {key: name for key, (name, _) in kept.items()} == {
            key: f"{name}_results" for key, (name, _) in plain.items()
        }
        assert [name for name, text in kept.values() if sql.STATEMENTS[name] is not text] == []
    for plain, complete in ((sql.FINISH, sql.COMPLETE), (sql.FINISH_CONTEXT, sql.COMPLETE_CONTEXT)):
        assert {key: name for key, (name, _) in complete.items() if key[1] != sql.IN_SLOT} == {
            key: name.replace("job_finish_claim", "job_complete_claim") for key, (name, _) in plain.items()
        }
        # Claims in one slot: of the complete and claim-only statements after the mark alone.
        for family in (complete, sql.CLAIM_ONLY, sql.CLAIM_ONLY_CONTEXT):
            assert {key: name for key, (name, _) in family.items() if key[1] == sql.IN_SLOT} == {
                (keep, sql.IN_SLOT): name.replace("_after", "_in_slot")
                for (keep, after), (name, _) in family.items()
                if after is True
            }
        assert [name for name, text in complete.values() if sql.STATEMENTS[name] is not text] == []


def test_every_statement_is_bound_once_and_nothing_derives_one_text_from_another():
    """A statement is a literal, or its family's expansion (a call, an f-string of fragments) bound
    once at import: sql.py substitutes nothing into a text (no .replace(), no %-formatting, no
    str.format), and nothing rebinds a statement's name."""
    tree = ast.parse(Path(sql.__file__).read_text(encoding="utf-8"))
    nodes = list(ast.walk(tree))
    calls = [n.func.attr for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert {"replace", "format", "format_map", "sub"} & set(calls) == set()
    assert [n.lineno for n in nodes if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)] == []
    targets = [t for n in nodes if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in nodes if isinstance(n, (ast.AnnAssign, ast.AugAssign))]
    bound = [t.id for t in targets if isinstance(t, ast.Name)]
    assert [name for name in sql.STATEMENTS if bound.count(name) != 1] == []


def test_a_new_variant_is_one_line(monkeypatch):
    """What the module's docstring promises: one line naming a variant, and it is a statement
    (STATEMENTS, so the test of every statement prepares it and `fastjobs sql show` prints it) of
    its family's section, expanded as its siblings are."""
    source = Path(sql.__file__).read_text(encoding="utf-8")
    before, section, after = source.partition('\n_section("The fast lane")')
    line = (
        "job_finish_claim_again: Final = "
        "_finish_claim(keep=False, choice=_KEYS_AFTER_THE_MARK, context=False)"
    )
    module = ModuleType("fastjobs_sql_with_a_variant")
    module.__package__ = "fastjobs"  # its imports are the catalogue's
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(f"{before}\n{line}\n{section}{after}", "sql.py", "exec"), module.__dict__)
    statements, sections = module.STATEMENTS, module.SECTIONS
    assert set(statements) - set(sql.STATEMENTS) == {"job_finish_claim_again"}
    assert sections["Finishes"][-1] == "job_finish_claim_again"
    assert statements["job_finish_claim_again"] == sql.job_finish_claim_after


@pytest.mark.parametrize("name", PREPARABLE)
def test_statement_prepares(conn, name):
    with psycopg.RawCursor(conn) as cur:
        cur.execute(sql.job_stage_create)  # the staging statements refer to the session's temp table
        cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
        row = cur.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = $1", (name,)).fetchone()
    assert row == (1,)


@pytest.mark.parametrize("name", sorted(bench_queries.STATEMENTS))
def test_bench_statement_prepares(conn, name):
    with psycopg.RawCursor(conn) as cur:
        cur.execute(bench_queries.bench_plain_create)  # what the producers benchmark inserts into
        cur.execute(bench_queries.bench_rows_create)  # what the latency run's handlers write to
        if name in bench_queries.NOT_PREPARABLE:
            cur.execute(bench_queries.STATEMENTS[name])
            return
        cur.execute(f"PREPARE {name} AS {bench_queries.STATEMENTS[name]}")
        row = cur.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = $1", (name,)).fetchone()
    assert row == (1,)


def _parts(text: str) -> tuple[dict[str, str], str]:
    """The CTEs of a `WITH a AS (...), b AS (...) SELECT ...` statement by name, and
    its final query; whitespace normalised (the layout of a statement is free)."""
    text = " ".join(text.split())
    assert text.startswith("WITH "), text[:40]
    ctes: dict[str, str] = {}
    at = len("WITH ")
    while match := re.compile(r"(\w+) AS \(").match(text, at):
        depth, quoted = 0, False
        for end in range(match.end() - 1, len(text)):
            char = text[end]
            if char == "'":
                quoted = not quoted
            elif not quoted and char in "()":
                depth += 1 if char == "(" else -1
                if depth == 0:
                    break
        ctes[match[1]] = text[match.end() : end].strip()
        at = end + 1
        if not text.startswith(", ", at):
            break
        at += 2
    return ctes, text[at:].strip()


def _words(text: str) -> str:
    return " ".join(text.split())


def _mark(priority: str, run_at: str) -> str:
    """The predicate a claim after the mark adds to the claim from the front, its parameters given."""
    return (
        f"AND priority = {priority} AND run_at >= timestamptz '2000-01-01 00:00:00+00'"
        f" + ({run_at}::int8 - {sql.CLAIM_MARK_MARGIN}) * interval '1 microsecond'"
    )


FINISHES = sorted(name for table in (sql.FINISH, sql.FINISH_CONTEXT) for name, _ in table.values())
FINISHES_RESULTS = sorted(
    name for table in (sql.FINISH_RESULTS, sql.FINISH_CONTEXT_RESULTS) for name, _ in table.values()
)
LOCKS = sorted(name for name, _ in sql.LOCK.values())
COMPLETES = sorted(name for table in (sql.COMPLETE, sql.COMPLETE_CONTEXT) for name, _ in table.values())
CLAIMS_ONLY = sorted(
    {name for table in (sql.CLAIM_ONLY, sql.CLAIM_ONLY_CONTEXT) for name, _ in table.values()}
)


@pytest.mark.parametrize("name", FINISHES + FINISHES_RESULTS + COMPLETES + CLAIMS_ONLY + LOCKS)
def test_a_variants_name_says_what_it_is(name):
    """A variant is one line, its name and its family's parameters: each part of the name shows in
    its text, and only then. _after claims after the mark, _keep keeps completed jobs (their
    completion CTEs update instead of deleting), _context returns meta and created_at (after
    keep_result, which every claim returns), _results keeps the outcomes of jobs with keep_result;
    job_complete_claim_ writes completions at a first attempt only (no outcome records), and
    job_claim_only_ claims alone (nothing to finish, whatever the loop keeps)."""
    text = _words(sql.STATEMENTS[name])
    mark = _mark("$3", "$4") if name in LOCKS else _mark("$6", "$7")
    after = "_after" in name or "_in_slot" in name
    assert (text.count(mark), text.count("AND priority = $")) == ((1, 1) if after else (0, 0))
    # _in_slot reads slot 0 and slot $8 alone: its scan, its fair branch and its UPDATE; and every
    # state-lane claim after the mark ends with the slot row (sql._slot_row).
    assert text.count("slot IN (0, $8::smallint)") == (3 if "_in_slot" in name else 0)
    slot_reads = 0 if not after or name in LOCKS else 2 if "_in_slot" in name else 1  # and its WHERE
    assert text.count("pg_sequence_last_value(") == slot_reads
    assert ("run_at, keep_result, meta, created_at" in text) == ("_context" in name)
    assert ("fastjobs_results" in text) == ("_results" in name)
    if name in FINISHES + FINISHES_RESULTS + COMPLETES:
        ctes, _ = _parts(sql.STATEMENTS[name])
        results = ["kept"] if "_results" in name else []
        records = [] if name in COMPLETES else ["completed_later", "failed"]
        assert list(ctes) == ["completed", *records, *results, "claimed"]
        assert ("jsonb_to_recordset($2::jsonb)" in text) == (name not in COMPLETES)
        kept = "UPDATE fastjobs_jobs_all j SET state = 'completed', finalized_at = now() "
        deleted = "DELETE FROM fastjobs_jobs_all j "
        expected = kept if "_keep" in name else deleted
        completions = ["completed", *records[:1]]  # completed_later: a later attempt's completions
        assert [ctes[cte].startswith(expected) for cte in completions] == [True] * len(completions)
    if name in CLAIMS_ONLY:
        ctes, _ = _parts(sql.STATEMENTS[name])
        assert list(ctes) == ["claimed"] and "_keep" not in name
        assert "DELETE" not in text and "jsonb_to_recordset" not in text
        # The claim is the finish statements' own, word for word, the outcomes it counts aside.
        finish = name.replace("job_claim_only_", "job_complete_claim_")
        assert ctes["claimed"] == _parts(sql.STATEMENTS[finish])[0]["claimed"]


@pytest.mark.parametrize(
    "name", ["job_claim_many", *FINISHES, *FINISHES_RESULTS, *COMPLETES, *CLAIMS_ONLY, *LOCKS]
)
def test_every_claim_returns_its_batch_in_claim_order(name):
    """A claim takes its jobs in claim order and returns them in it, the order a loop runs its batch
    in: the claimed CTE's rows sorted (an UPDATE returns its rows by id), or the locked ones, those
    without a key and those fastjobs_take lets it take together (a fair claim's come by key)."""
    text = _words(sql.STATEMENTS[name])
    assert text.count("ORDER BY priority DESC, run_at, id") == 2
    returned = {
        "job_claim_many": text.endswith(" FROM claimed ORDER BY priority DESC, run_at, id"),
        "finish": " FROM claimed ORDER BY priority DESC, run_at, id) UNION ALL " in text,
        "lock": text.endswith(") AS locked ORDER BY priority DESC, run_at, id")
        or (
            "_keyed_" in name
            and text.endswith(" FROM c WHERE limit_key IS NOT NULL) ORDER BY priority DESC, run_at, id")
        ),
    }
    # A claim after the mark ends with the slot row, after its claimed rows.
    after = "_after" in name or "_in_slot" in name
    kind = (
        "job_claim_many"
        if name == "job_claim_many" or (name in CLAIMS_ONLY and not after)
        else "lock"
        if name in LOCKS
        else "finish"
    )
    assert [k for k, holds in returned.items() if holds] == [kind]


def test_keep_the_mark_and_context_leave_the_outcomes_alone():
    """Every state-lane finish statement writes outcomes with the same CTE; the fast lane's differs only
    in the attempt it ends (the outcome's own, f.attempt: its rows were never claimed), the worker it
    records, and its guard (the row locked at the attempt before this run)."""
    failed = {_parts(sql.STATEMENTS[name])[0]["failed"] for name in FINISHES}
    assert len(failed) == 1
    for name in [*FINISHES_RESULTS, "job_finish_locked_many_results"]:  # the same outcomes, kept too
        kept = _parts(sql.STATEMENTS[name])[0]["failed"].split(" RETURNING ")[0]
        assert (
            kept == _parts(sql.STATEMENTS[name.removesuffix("_results")])[0]["failed"].split(" RETURNING ")[0]
        )
    state_lane = failed.pop()
    fast_lane = _parts(sql.job_finish_locked_many)[0]["failed"]
    assert "'attempt', j.attempt," in state_lane and "'attempt', f.attempt," in fast_lane
    assert "attempt = j.attempt - f.uncount," in state_lane
    assert "attempt = f.attempt - f.uncount, attempted_at = now(), attempted_by = $3," in fast_lane
    guards = [lane.split(" WHERE ")[-1] for lane in (state_lane, fast_lane)]
    returned = " RETURNING j.id, j.queue, j.state"
    assert guards == [
        "f.state <> 'completed' AND j.id = f.id AND j.attempt = f.attempt"
        " AND j.attempted_by = $5 AND j.state::text = 'running'" + returned,
        "f.state <> 'completed' AND j.id = f.id AND least(j.attempt, 32766) + 1 = f.attempt"
        " AND j.state::text = 'available'" + returned,
    ]


@pytest.mark.parametrize("name", [*FINISHES, "job_finish_locked_many"])
def test_an_outcome_is_finalized_by_the_state_it_is_given(name):
    """The failed CTE spells the outcome's new state twice (SET cannot read the new
    value of another column): finalized_at must test the very state that SET writes, and
    a failed last attempt is discarded by the attempt the outcome ends."""
    failed = _parts(sql.STATEMENTS[name])[0]["failed"]
    match = re.search(r"SET state = (CASE .*? END::fastjobs_state),", failed)
    assert match is not None
    attempt = "f.attempt" if name == "job_finish_locked_many" else "j.attempt"
    assert f"AND {attempt} >= j.max_attempts THEN 'discarded'" in match[1]
    assert failed.count(match[1]) == 2
    finalized = f"finalized_at = CASE WHEN {match[1]} IN ('discarded', 'cancelled')"
    finalized += " THEN clock_timestamp() END,"
    assert finalized in failed


@pytest.mark.parametrize("name", ["job_finish_claim_many", "job_finish_claim_many_keep"])
def test_the_finish_statements_claim_as_job_claim_many_does(name):
    """Their claim is job_claim_many's, its parameters $1, $2, $3 moved to $3, $4, $5; a limited
    queue's room, and the count of a key's running jobs, leave out the jobs the statement itself
    ends (its worker, ids and records)."""
    moved = {"1": "3", "2": "4", "3": "5"}
    ctes, returned = _parts(sql.job_claim_many)
    assert list(ctes) == ["claimed"]
    claim = re.sub(r"\$(\d)", lambda m: "$" + moved[m[1]], ctes["claimed"])
    claim = claim.replace("fastjobs_room($3, $4)", "fastjobs_room($3, $4, $5, $1, $2)")
    claim = claim.replace(
        "coalesce(NULL::bigint[], '{}'), coalesce(NULL::jsonb, '[]')",
        "coalesce($1::bigint[], '{}'), coalesce($2::jsonb, '[]')",
    )
    finish_ctes, finish_returned = _parts(sql.STATEMENTS[name])
    assert finish_ctes["claimed"] == claim
    # The claimed rows come first, in claim order, as job_claim_many returns them.
    assert returned.endswith(" FROM claimed ORDER BY priority DESC, run_at, id")
    assert finish_returned.startswith(f"({returned}) UNION ALL ")


@pytest.mark.parametrize("name", [*FINISHES, *FINISHES_RESULTS, *COMPLETES, *CLAIMS_ONLY])
def test_only_the_statements_for_queues_without_keyed_jobs_pass_them_over(name):
    """The job_complete_claim_ and job_claim_only_ statements (a queue never given a keyed job:
    migration 012) take keyless jobs only, in either branch, and read no key, turn or count; the
    finish statements take keyed jobs in their turns, counted."""
    text = _words(sql.STATEMENTS[name])
    keyless = name in COMPLETES + CLAIMS_ONLY
    assert ("fastjobs_take(" in text, "fastjobs_in_turn(" in text) == (not keyless, not keyless)
    assert text.count("AND limit_key IS NULL") == (2 if keyless else 0)
    assert ("limit_concurrency" in text) == (not keyless)


def _channels(text: str) -> set[str]:
    """The channels a statement (or a migration, its comments left out) listens or notifies on."""
    text = re.sub(r"--[^\n]*", "", text)
    found = set(re.findall(r"pg_notify\('([^']*)'", text))
    return found | set(re.findall(r"\b(?:LISTEN|NOTIFY)\s+(\w+)", text))


def test_every_channel_a_statement_names_is_a_channel_constant():
    names = {name: _channels(text) for name, text in sql.STATEMENTS.items()}
    names.update({m.label: _channels(m.sql) for m in schema.migrations()})
    wake = {sql.NOTIFY_CHANNEL}
    finish = {sql.NOTIFY_CHANNEL, sql.RESULT_CHANNEL}  # wakes queues, tells the waiters of kept outcomes
    results = {name: finish for name in [*FINISHES_RESULTS, "job_finish_locked_many_results"]}
    assert {name: channels for name, channels in names.items() if channels} == {
        "001_initial": wake,  # the enqueue trigger
        "listen_jobs": wake,
        "listen_ping": {sql.PING_CHANNEL},
        "listen_cancel": {sql.CANCEL_CHANNEL},
        "listen_result": {sql.RESULT_CHANNEL},
        "listener_ping": {sql.PING_CHANNEL},
        "job_finish_claim_many": wake,
        "job_finish_claim_after": wake,
        "job_finish_claim_many_keep": wake,
        "job_finish_claim_after_keep": wake,
        "job_finish_claim_many_context": wake,
        "job_finish_claim_after_context": wake,
        "job_finish_claim_many_keep_context": wake,
        "job_finish_claim_after_keep_context": wake,
        "job_finish_locked_many": wake,
        "queue_wake": wake,
        "queue_resume": wake,
        "job_schedule_many": wake,
        "job_release_unstarted": finish,
        "job_crash_fast": {sql.RESULT_CHANNEL},  # every statement that may end a job tells the waiters
        "job_rescue_many": {sql.RESULT_CHANNEL},
        "job_discard": {sql.RESULT_CHANNEL},
        "job_cancel": {sql.CANCEL_CHANNEL, sql.RESULT_CHANNEL},
        "job_retry": wake,
        "testing_notify_commit": wake,
        **results,
    }
    assert {sql.NOTIFY_CHANNEL, sql.PING_CHANNEL, sql.CANCEL_CHANNEL, sql.RESULT_CHANNEL} == sql.CHANNELS


def test_every_limit_a_statement_carries_is_its_constant():
    assert sql.ATTEMPT_CAP == types.MAX_ATTEMPTS_LIMIT - 1  # smallint's maximum less one
    caps = {
        name: re.findall(r"least\((?:j\.)?attempt, (\d+)\)", text) for name, text in sql.STATEMENTS.items()
    }
    counting = {name: [int(cap) for cap in found] for name, found in caps.items() if found}
    assert set(counting) == {
        "job_claim_many",
        "job_finish_claim_many",
        "job_finish_claim_after",
        "job_finish_claim_many_keep",
        "job_finish_claim_after_keep",
        *(name for name, _ in sql.FINISH_CONTEXT.values()),
        *FINISHES_RESULTS,
        *COMPLETES,
        *CLAIMS_ONLY,
        "job_finish_locked_many_results",
        "job_retry",
        # The fast lane: the attempt its run makes, counted when its outcome (or its crash) is written.
        *LOCKS,
        "job_finish_locked_many",
        "job_crash_fast",
        "job_hand_over",
    }
    assert {cap for found in counting.values() for cap in found} == {sql.ATTEMPT_CAP}
    # No other spelling of the cap (or of the margin) hides elsewhere.
    text = "\n".join(sql.STATEMENTS.values())
    assert text.count(str(sql.ATTEMPT_CAP)) == sum(len(found) for found in counting.values())
    margins = re.findall(r"\$[47]::int8 - (\d+)\)", text)
    # The _after ones, with context or not, with _results or not: eight finish statements, four
    # job_complete_claim_ ones, two job_claim_only_ ones and four fast-lane claims (keyed jobs
    # too or not); and the _in_slot ones: four job_complete_claim_, two job_claim_only_.
    assert [int(m) for m in margins] == [sql.CLAIM_MARK_MARGIN] * 24
    assert text.count(str(sql.CLAIM_MARK_MARGIN)) == 24


def test_every_unique_key_predicate_is_the_unique_index_predicate():
    """The ON CONFLICT clauses name the partial unique index by its predicate, and
    job_get_unique looks the holder up by the same: all spell UNIQUE_STATES."""
    assert f"WHERE unique_key IS NOT NULL AND {sql.UNIQUE_STATES};" in " ".join(
        "\n".join(m.sql for m in schema.migrations()).split()
    )
    spelled = {
        name: text.count(sql.UNIQUE_STATES) for name, text in sql.STATEMENTS.items() if "unique_key" in text
    }
    assert {name: count for name, count in spelled.items() if count} == {
        "job_insert": 1,
        "job_get_unique": 1,
        "job_insert_staged": 1,
    }
    assert [text.count("unique_key IS NOT NULL") for text in sql.STATEMENTS.values()].count(1) == 2


def test_the_leaders_session_keeps_alive_as_its_client_does(app: App) -> None:
    """Both ends of the leader's connection probe with the same figures (leader.KEEPALIVE_*)."""
    conn = leader.Leader(app, leader.LeaderConfig())._connect()
    assert conn is not None
    with conn:
        on_socket = conn.info.host.startswith("/")
        server = conn.execute(
            "SELECT name, setting::int FROM pg_settings WHERE name IN"
            " ('tcp_keepalives_idle', 'tcp_keepalives_interval', 'tcp_keepalives_count')"
        ).fetchall()
        client = conn.info.get_parameters()
    figures = {
        "idle": leader.KEEPALIVE_IDLE,
        "interval": leader.KEEPALIVE_INTERVAL,
        "count": leader.KEEPALIVE_COUNT,
    }
    # Over a Unix socket (the embedded server) there is no TCP to probe: the server reads 0.
    expected = {f"tcp_keepalives_{name}": 0 if on_socket else value for name, value in figures.items()}
    assert dict(server) == expected
    assert {name: int(client[f"keepalives_{name}"]) for name in figures} == figures


def test_the_workers_session_keeps_alive_as_the_leaders_does(app: App) -> None:
    """A fast-lane batch holds its rows' locks in an open transaction: the server probes a
    worker's connection as the leader's (leader.KEEPALIVE_*), so a vanished worker host frees
    them in seconds. Over a Unix socket (the embedded server) there is no TCP: the server reads 0."""
    with psycopg.connect(app.dsn, autocommit=True) as conn:
        psycopg.RawCursor(conn).execute(sql.worker_session)
        server = conn.execute(
            "SELECT name, setting::int FROM pg_settings WHERE name IN"
            " ('tcp_keepalives_idle', 'tcp_keepalives_interval', 'tcp_keepalives_count')"
        ).fetchall()
        on_socket = conn.info.host.startswith("/")
    figures = {
        "idle": leader.KEEPALIVE_IDLE,
        "interval": leader.KEEPALIVE_INTERVAL,
        "count": leader.KEEPALIVE_COUNT,
    }
    assert dict(server) == {
        f"tcp_keepalives_{name}": 0 if on_socket else value for name, value in figures.items()
    }


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _reads_the_backlog(node: dict[str, Any]) -> bool:
    """Whether the rows `node` returns are read from a jobs table other than under a Limit (the
    claimed CTE is the rows a claim took, under its own; an InitPlan or a CTE's plan is not a
    node's input but a value or a CTE it reads)."""
    if node["Node Type"] == "Limit" or node.get("CTE Name") == "claimed":
        return False
    if node.get("Relation Name", "").startswith("fastjobs_jobs"):
        return True
    inputs = [child for child in node.get("Plans", []) if child["Parent Relationship"] != "InitPlan"]
    return any(_reads_the_backlog(child) for child in inputs)


def _sorts(nodes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """A claim's Sort nodes that put its rows in claim order (their input a batch: the claimed CTE,
    or the locked rows under their LIMIT), and the node types of any other Sort (one of the backlog)."""
    batch, other = [], []
    for node in nodes:
        if node["Node Type"] != "Sort":
            continue
        alias = node["Sort Key"][0].split(".")[0]
        in_claim_order = node["Sort Key"] == [f"{alias}.priority DESC", f"{alias}.run_at", f"{alias}.id"]
        if in_claim_order and not _reads_the_backlog(node):
            batch.append(node)
        else:
            other.append(f"Sort {node['Sort Key']}")
    return batch, other


@pytest.fixture(scope="module")
def seeded(template_db: str) -> Iterator[str]:
    """A database shaped like a busy queue, analyzed: 50,000 available jobs over 4
    queues and 3 priorities, 8,000 running (8 workers), 200,000 completed kept.

    Only EXPLAINed, never changed, so the tests of this module share it.
    """
    name = f"fastjobs_seeded_{os.getpid()}"
    dsn = _create_database(name, template_db)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            """INSERT INTO fastjobs_jobs (queue, kind, priority, run_at)
               SELECT 'q' || (i % 4), 'k', (i % 3), now() - interval '1 hour' + i * interval '1 ms'
                 FROM generate_series(1, 50000) i"""
        )
        conn.execute(
            """INSERT INTO fastjobs_jobs (queue, kind, state, attempt, attempted_at, attempted_by)
               SELECT 'q' || (i % 4), 'k', 'running', 1, now(), 'w-' || (i % 8)
                 FROM generate_series(1, 8000) i"""
        )
        conn.execute(
            """INSERT INTO fastjobs_jobs (queue, kind, state, finalized_at)
               SELECT 'q' || (i % 4), 'k', 'completed', now() FROM generate_series(1, 200000) i"""
        )
        conn.commit()
        conn.execute("ANALYZE fastjobs_jobs")
        conn.commit()
    yield dsn
    _drop_database(name)


def _claim_arguments(name: str, batch: int) -> str:
    """EXECUTE arguments of a claiming statement: finished jobs among the running ones, then the claim."""
    claim = f"'q1', {batch}, 'worker-1'"
    if name == "job_claim_many":
        return claim
    completed = "'{" + ",".join(str(i) for i in range(50_001, 51_001)) + "}'"
    failed = [
        {"id": i, "attempt": 1, "state": "retryable", "delay": 1.0, "uncount": 0, "error": {"error": "boom"}}
        for i in range(51_001, 51_101)
    ] + [{"id": i, "attempt": 2, "state": "completed"} for i in range(51_101, 51_201)]
    if name.startswith("job_complete_claim"):
        failed = []  # its batches hold completions at a first attempt only
    arguments = f"{completed}, '{json.dumps(failed)}', {claim}"
    if "_after" in name:
        arguments += ", 0, 0"  # the mark: priority 0, run_at 2000-01-01
    return arguments


# A worker executes its claim as a prepared statement for its whole life, so
# PostgreSQL may switch to the generic plan: both plans must take the jobs
# from the claim index, for a small batch and a large one, and touch no row
# beyond those the batch names (no Seq Scan of the table, no Sort of the backlog);
# their one Sort is of the claimed rows, into claim order.
CLAIM_PLANS = [
    pytest.param(
        name,
        batch,
        mode,
        id=f"{name}-{batch}-{mode}",
    )
    for name in (
        "job_claim_many",
        "job_finish_claim_many",
        "job_finish_claim_many_keep",
        "job_finish_claim_after",
        "job_finish_claim_after_keep",
        "job_complete_claim_many",
        "job_complete_claim_after",
    )
    for batch in (100, 2000)
    for mode in ("force_custom_plan", "force_generic_plan")
]


@pytest.mark.parametrize(("name", "batch", "plan_cache_mode"), CLAIM_PLANS)
def test_claim_uses_the_partial_claim_index(seeded, name, batch, plan_cache_mode):
    with psycopg.connect(seeded) as conn, psycopg.RawCursor(conn) as cur:
        # As the worker's connection runs it: a rotating slot just truncated is empty when a
        # plan is made and full while it is used; only enable_seqscan off keeps its index scans.
        cur.execute(sql.worker_session)
        cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        row = cur.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({_claim_arguments(name, batch)})").fetchone()
    assert row is not None
    nodes = list(_plan_nodes(row[0][0]["Plan"]))
    scans = [
        (n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == "fastjobs_jobs"
    ]
    assert ("Index Scan", "fastjobs_jobs_claim_idx") in scans, scans
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], scans
    batch, other = _sorts(nodes)
    assert (len(batch), other) == (1, []), scans


# The claims as a worker's connection runs them, against a backlog in a
# rotating slot that was never analyzed (the rotation truncates slots every
# few seconds): the planner guesses one row per partition.
BACKLOG_CLAIMS = [
    pytest.param(name, mode, id=f"{name}-{mode}")
    for name in ("job_claim_many", "job_finish_claim_many", "job_finish_claim_after",
                 "job_complete_claim_many", "job_complete_claim_after", "job_lock_many", "job_lock_after")
    for mode in ("force_custom_plan", "force_generic_plan")
]  # fmt: skip


@pytest.fixture(scope="module")
def backlog(template_db: str) -> Iterator[str]:
    """200,000 available jobs in the current rotating slot, never analyzed. Only EXPLAINed."""
    name = f"fastjobs_backlog_{os.getpid()}"
    dsn = _create_database(name, template_db)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO fastjobs_jobs_all (queue, kind, run_at)"
            " SELECT 'q1', 'k', now() - interval '1 hour' + i * interval '1 ms'"
            "   FROM generate_series(1, 200000) i"
        )
    yield dsn
    _drop_database(name)


@pytest.mark.parametrize(("name", "plan_cache_mode"), BACKLOG_CLAIMS)
def test_a_claim_reads_a_backlog_in_index_order_and_stops_at_its_limit(backlog, name, plan_cache_mode):
    """The slots' claim indexes are read in order (a Merge Append), so a claim stops at
    its limit: an Append + Sort would read and sort the whole backlog for every claim
    (seen without worker_session's enable_seqscan off: 175 ms behind 226,000 jobs). The one
    Sort is of the rows claimed, into claim order."""
    arguments = {
        "job_lock_many": "'q1', 1000",
        "job_lock_after": "'q1', 1000, 0, 0",
    }.get(name) or _claim_arguments(name, 1000)
    with psycopg.connect(backlog) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(sql.worker_session)
        cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        row = cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}({arguments})").fetchone()
        conn.rollback()
    assert row is not None
    nodes = list(_plan_nodes(row[0][0]["Plan"]))
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], [n["Node Type"] for n in nodes]
    [scan] = [n for n in nodes if n.get("Index Name") == "fastjobs_jobs_1_claim_idx"]
    assert scan["Node Type"] == "Index Scan" and scan["Actual Rows"] <= 1000, scan
    batch, other = _sorts(nodes)
    assert (len(batch), other) == (1, []), [n["Node Type"] for n in nodes]
    assert batch[0]["Actual Rows"] == 1000


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", ["job_finish_claim_after", "job_complete_claim_after", "job_lock_after"])
def test_the_claim_after_the_mark_starts_its_index_scan_there(seeded, plan_cache_mode, name):
    arguments = "'q1', 100, 0, 0" if name == "job_lock_after" else _claim_arguments(name, 100)
    with psycopg.connect(seeded) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(f"PREPARE claim AS {sql.STATEMENTS[name]}")
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        row = cur.execute(f"EXPLAIN (FORMAT JSON) EXECUTE claim({arguments})").fetchone()
    assert row is not None
    [scan] = [n for n in _plan_nodes(row[0][0]["Plan"]) if n.get("Index Name") == "fastjobs_jobs_claim_idx"]
    assert "priority = " in scan["Index Cond"] and "run_at >= " in scan["Index Cond"], scan["Index Cond"]


def test_the_claim_after_the_mark_skips_the_dead_entries_a_held_snapshot_keeps(dsn):
    """While a long transaction pins the horizon, the entries of claimed jobs stay in the
    claim index and a claim from the front visits each of them; one from the mark does not."""
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
        conn.execute(
            "INSERT INTO fastjobs_jobs (kind, run_at)"
            " SELECT 'k', now() - interval '1 hour' + i * interval '10 ms' FROM generate_series(1, 90300) i"
        )
        conn.execute("VACUUM ANALYZE fastjobs_jobs")
        with psycopg.connect(dsn) as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM fastjobs_workers")  # the snapshot, held until the end
            claimed = [r for r in cur.execute(sql.job_claim_many, ("default", 90_000, "w"))]
            cur.execute(bench_queries.bench_raw_complete, ([r[0] for r in claimed],))
            priority, run_at = claimed[-1][5], max(r[6] for r in claimed)
            micros = (run_at - PG_EPOCH) // dt.timedelta(microseconds=1)

            def buffers(name: str, *extra: object) -> int:
                cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
                if name.startswith("job_lock_"):  # the fast lane's claim: queue, limit (, mark)
                    args: tuple[str, ...] = ("'default'", "100", *map(str, extra))
                else:
                    args = ("'{}'", "'[]'", "'default'", "100", "'w'", *map(str, extra))
                explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE"
                row = cur.execute(f"{explain} {name}({', '.join(args)})").fetchone()
                assert row is not None
                conn.execute("UPDATE fastjobs_jobs_all SET state = 'available' WHERE state = 'running'")
                [scan] = [
                    n
                    for n in _plan_nodes(row[0][0]["Plan"])
                    if n.get("Index Name") == "fastjobs_jobs_claim_idx"
                ]
                assert scan["Actual Rows"] == 100
                blocks: int = scan["Shared Hit Blocks"] + scan["Shared Read Blocks"]
                return blocks

            from_front = buffers("job_finish_claim_many")
            from_mark = buffers("job_finish_claim_after", priority, micros)
            fast_from_front = buffers("job_lock_many")
            fast_from_mark = buffers("job_lock_after", priority, micros)
            holder.rollback()
    # The scan of the claim index: past 90,000 dead entries, or from about the 10th before the mark.
    assert from_mark * 5 < from_front, (from_mark, from_front)
    assert fast_from_mark * 5 < fast_from_front, (fast_from_mark, fast_from_front)


@pytest.mark.parametrize(
    "name", ["job_finish_claim_many", "job_finish_claim_many_keep", "job_complete_claim_many"]
)
@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_outcomes_find_their_jobs_by_primary_key_whatever_the_statistics(dsn, name, plan_cache_mode):
    """Statistics taken while the queue was empty must not send the completion
    through the partial index of running jobs (a scan of every running job per batch)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE fastjobs_jobs")  # statistics of an empty table
        conn.execute(
            "INSERT INTO fastjobs_jobs (kind, state, attempted_by)"
            " SELECT 'k', 'running', 'worker-1' FROM generate_series(1, 20000)"
        )
    with psycopg.connect(dsn) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(sql.worker_session)  # as the worker's connection runs it
        cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        row = cur.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({_claim_arguments(name, 100)})").fetchone()
    assert row is not None
    nodes = list(_plan_nodes(row[0][0]["Plan"]))
    used = {n.get("Index Name") for n in nodes if n.get("Relation Name") == "fastjobs_jobs"}
    assert "fastjobs_jobs_running_idx" not in used, used
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], used


def test_notify_trigger_is_statement_level(conn):
    row = conn.execute("SELECT tgtype FROM pg_trigger WHERE tgname = 'fastjobs_jobs_notify'").fetchone()
    assert row is not None
    assert row[0] & 1 == 0, "a FOR EACH ROW trigger would notify once per inserted row"


def test_bulk_enqueue_notifies_once_per_queue(app: App, dsn, listener):
    for queue in ("alpha", "beta"):
        count = app.enqueue_many("k", ({"n": i} for i in range(10_000)), queue=queue)
        assert count == 10_000
    assert notifications(listener, dsn) == {"alpha": 1, "beta": 1}


def test_one_insert_statement_into_two_queues_notifies_once_per_queue(conn, dsn, listener):
    conn.execute(
        """INSERT INTO fastjobs_jobs (queue, kind)
           SELECT CASE WHEN i % 2 = 0 THEN 'alpha' ELSE 'beta' END, 'k' FROM generate_series(1, 10000) i"""
    )
    conn.commit()
    assert notifications(listener, dsn) == {"alpha": 1, "beta": 1}


def test_single_enqueue_notifies_once(app: App, dsn, listener):
    app.enqueue("k", {"n": 1}, queue="gamma")
    assert notifications(listener, dsn) == {"gamma": 1}


def test_scheduled_jobs_do_not_notify(app: App, dsn, listener):
    future = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    app.enqueue("k", {"n": 1}, queue="later", delay=3600)
    app.enqueue("k", {"n": 2}, queue="later", run_at=future)
    assert app.enqueue_many("k", [{"n": i} for i in range(100)], queue="later", delay=3600) == 100
    assert app.enqueue_many("k", [{"n": i} for i in range(100)], queue="later", run_at=future) == 100
    assert notifications(listener, dsn) == {}


def test_rolled_back_enqueue_does_not_notify(app: App, dsn, listener):
    with psycopg.connect(dsn) as conn:
        app.enqueue_many("k", [{"n": i} for i in range(100)], conn=conn, queue="never")
        conn.rollback()
    assert notifications(listener, dsn) == {}


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_search_for_stale_outcomes_runs_only_when_an_outcome_did_not_apply(dsn, plan_cache_mode):
    """Every outcome applied (the usual batch): the branches that list stale outcomes stop at
    their one-time filter. One stale outcome of each kind: they run, and report just those."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO fastjobs_jobs (kind, state, attempt, attempted_by)"
            " SELECT 'k', 'running', CASE WHEN i > 200 THEN 2 ELSE 1 END, 'worker-1'"
            "   FROM generate_series(1, 400) i"
        )
    name = "job_finish_claim_many"
    ids = "'{" + ",".join(str(i) for i in range(1, 101)) + "}'"
    outcomes = [
        {"id": i, "attempt": 1, "state": "retryable", "delay": 1.0, "uncount": 0} for i in range(101, 111)
    ]
    outcomes += [{"id": i, "attempt": 2, "state": "completed"} for i in range(201, 211)]
    arguments = f"{ids}, '{json.dumps(outcomes)}', 'q1', 0, 'worker-1'"

    def execute() -> tuple[list[Any], list[dict[str, Any]]]:
        with psycopg.connect(dsn) as conn, psycopg.RawCursor(conn) as cur:
            cur.execute(sql.worker_session)
            cur.execute(f"PREPARE {name} AS {sql.STATEMENTS[name]}")
            cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
            row = cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}({arguments})").fetchone()
            assert row is not None
            conn.rollback()
            rows = cur.execute(f"EXECUTE {name}({arguments})").fetchall()
            conn.rollback()
        nodes = [n for n in _plan_nodes(row[0][0]["Plan"]) if n["Node Type"] == "Function Scan"]
        # The fair claim's branch never runs for a queue never given a keyed job.
        assert [n["Actual Loops"] for n in nodes if n["Function Name"] == "fastjobs_fair"] == [0]
        return rows, [n for n in nodes if n["Function Name"] != "fastjobs_fair"]

    rows, scans = execute()
    assert rows == []
    # The outcome records for the completions and the failures, and again
    # for the stale ones (never run), and the ids for the stale ones (never run).
    assert sorted(n["Actual Loops"] for n in scans) == [0, 0, 1, 1], scans
    query = "UPDATE fastjobs_jobs_all SET attempt = attempt + 1 WHERE id IN (7, 107, 207)"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query)
    rows, scans = execute()
    assert sorted((r[0], r[1], r[2], r[3]) for r in rows) == [
        (7, None, "completed", 1),
        (107, None, "retryable", 1),
        (207, None, "completed", 2),
    ]
    assert sorted(n["Actual Loops"] for n in scans) == [1, 1, 1, 1], scans


# The test every statement that reports a job's state makes (sql._IN_FLIGHT), whitespace aside.
IN_FLIGHT = """state = 'available' AND xmax <> '0'::xid
    AND (xmax = ANY(ARRAY(SELECT xid(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x))
         OR (xmax::text::bigint + 4294967296
             - (SELECT xid(pg_snapshot_xmax(pg_current_snapshot()))::text::bigint)) % 4294967296
            < 1048576)"""
REPORTS_STATE = [
    "job_state",
    "job_get",
    "job_list",
    "job_stats_by_queue",
    "testing_jobs_in_states",
    "job_status",
    "job_page",
]


def test_every_report_of_a_state_tests_for_a_job_in_flight_alike():
    """Written out in each statement, the test is the same text in each: a fix to one is made to all."""
    expected = " ".join(IN_FLIGHT.split())
    assert {
        name: " ".join(sql.STATEMENTS[name].split()).count(expected) for name in REPORTS_STATE
    } == dict.fromkeys(REPORTS_STATE, 1)
    others = set(sql.STATEMENTS) - set(REPORTS_STATE)
    assert [name for name in sorted(others) if "pg_snapshot_xip" in sql.STATEMENTS[name]] == []


def test_a_row_a_live_transaction_locks_reads_running_in_every_report(dsn):
    """Whichever way its locker's xid stands to the reader's snapshot: listed in progress (a later
    transaction completed before the snapshot), or at or after its xmax (taken after the snapshot).
    A row locked by a transaction that ended, and a locked row in another state, keep their state."""
    with psycopg.connect(dsn, autocommit=True) as setup:
        ids = {
            row[1]: row[0]
            for row in setup.execute(
                """INSERT INTO fastjobs_jobs_all (queue, kind, state, run_at, attempt, attempted_at)
                   VALUES ('a', 'listed', 'available', now() - interval '1 hour', 0, NULL),
                          ('b', 'after', 'available', now() - interval '1 hour', 0, NULL),
                          ('a', 'claimed', 'running', now() - interval '3 hours', 1,
                           now() - interval '2 hours'),
                          ('d', 'ended', 'available', now() - interval '1 hour', 0, NULL),
                          ('e', 'later', 'scheduled', now() + interval '1 hour', 0, NULL)
                   RETURNING id, kind"""
            ).fetchall()
        }
        with setup.transaction():
            setup.execute("SELECT id FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (ids["ended"],))
    listed, after, claimed, ended, later = (ids[k] for k in ("listed", "after", "claimed", "ended", "later"))
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as other,
        psycopg.connect(dsn) as reader,
    ):
        first.execute("SELECT id FROM fastjobs_jobs_all WHERE id = ANY(%s) FOR UPDATE", ([listed, later],))
        other.execute("SELECT pg_current_xact_id()")  # a later xid completes: the first's is listed
        reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        reader.execute("SELECT 1")  # its snapshot, before the second takes its xid
        second.execute("SELECT id FROM fastjobs_jobs_all WHERE id = %s FOR UPDATE", (after,))
        cur = psycopg.RawCursor(reader)
        xids = cur.execute(
            """SELECT id, xmax::text::bigint,
                      xmax = ANY(ARRAY(SELECT xid(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x)),
                      xmax::text::bigint >= xid(pg_snapshot_xmax(pg_current_snapshot()))::text::bigint
                 FROM fastjobs_jobs_all WHERE id = ANY($1)""",
            ([listed, after],),
        ).fetchall()
        assert sorted((row[0], row[2], row[3]) for row in xids) == [
            (listed, True, False),
            (after, False, True),
        ]
        running = {listed: "running", after: "running", claimed: "running"}
        assert {i: cur.execute(sql.job_state, (i,)).fetchone()[0] for i in ids.values()} == {  # type: ignore[index]
            **running,
            ended: "available",
            later: "scheduled",
        }
        assert {i: cur.execute(sql.job_get, (i,)).fetchone()[5] for i in ids.values()} == {  # type: ignore[index]
            **running,
            ended: "available",
            later: "scheduled",
        }
        assert {i: cur.execute(sql.job_status, (i,)).fetchone()[3] for i in ids.values()} == {  # type: ignore[index]
            **running,
            ended: "available",
            later: "scheduled",
        }
        assert {row[0]: row[3] for row in cur.execute(sql.job_list, (None, "running", None, 10))} == running
        assert [row[0] for row in cur.execute(sql.job_list, (None, "available", None, 10))] == [ended]
        assert [row[0] for row in cur.execute(sql.job_list, ("b", None, None, 10))] == [after]
        assert {row[0] for row in cur.execute(sql.testing_jobs_in_states, (["running"],))} == set(running)
        pending = cur.execute(sql.testing_jobs_in_states, (["available", "scheduled", "retryable"],))
        assert [row[0] for row in pending] == [ended, later]
        depths = {(row[0], row[1]): (row[2], row[3]) for row in cur.execute(sql.job_stats_by_queue)}
        assert sorted(depths) == [("a", "running"), ("b", "running"), ("d", "available"), ("e", "scheduled")]
        # Queue a: the state-lane job claimed 2 hours ago is the oldest; b's only job began now.
        assert depths["a", "running"][0] == 2 and 7000 < depths["a", "running"][1] < 7400
        assert depths["b", "running"][0] == 1 and 0 <= depths["b", "running"][1] < 60
        assert depths["d", "available"][0] == 1 and depths["d", "available"][1] > 3000
        reader.rollback()
        first.rollback()
        second.commit()
        assert {i: cur.execute(sql.job_state, (i,)).fetchone()[0] for i in (listed, after)} == {  # type: ignore[index]
            listed: "available",
            after: "available",
        }
        counts = {(row[0], row[1]): row[2] for row in cur.execute(sql.job_stats_by_queue)}
        assert counts == {
            ("a", "available"): 1,
            ("a", "running"): 1,
            ("b", "available"): 1,
            ("d", "available"): 1,
            ("e", "scheduled"): 1,
        }


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_stats_test_each_row_once_and_keep_their_parallel_scan(seeded, plan_cache_mode):
    """The test for a job in flight is a key of job_stats_by_queue's first grouping: one array of
    the snapshot's xids, one snapshot xmax, each evaluated at most once (when a row needs it), and
    the scan stays parallel."""
    with psycopg.connect(seeded) as conn, psycopg.RawCursor(conn) as cur:
        cur.execute(f"PREPARE job_stats_by_queue AS {sql.job_stats_by_queue}")
        cur.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        # Parallel plans made cheap: one comes unless a function of the statement forbids it.
        cur.execute("SET parallel_setup_cost = 0")
        cur.execute("SET parallel_tuple_cost = 0")
        cur.execute("SET min_parallel_table_scan_size = 0")
        row = cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE job_stats_by_queue").fetchone()
    assert row is not None
    nodes = list(_plan_nodes(row[0][0]["Plan"]))
    init_plans = [n for n in nodes if n.get("Parent Relationship") == "InitPlan"]
    assert len(init_plans) == 2 and all(n["Actual Loops"] <= 1 for n in init_plans), init_plans
    assert [n for n in nodes if n["Node Type"] == "Gather" or n["Node Type"] == "Gather Merge"], nodes
