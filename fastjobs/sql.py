"""Every SQL statement fastjobs runs, named, with its purpose.

A statement is a module-level string whose name starts with a lowercase
letter: the name is its prepared statement's name and its test id, and
STATEMENTS lists them all (collected from this module, so writing one lists
it; tests/test_sql.py prepares each). `fastjobs sql show NAME` prints one as
it is sent. Placeholders are PostgreSQL's own `$n`: the statements run
unchanged through psycopg's RawCursor and through libpq in the Cython hot
loop. FINISH, COMPLETE, CLAIM_ONLY (and their _CONTEXT, _RESULTS) and LOCK pick the hot loops'
statements.

Most statements are written out whole, as one literal. A family of statements
that differ in a part has one source instead: a function whose keyword-only
parameters name what varies, returning the statement (or the part its
members share) as an f-string of SQL and fragments (River's sqlc templates
are the model). Each member is bound once, at import, by a line that calls
the family or embeds its fragment: nothing is composed at run time, and no
statement is derived from another by substitution. A rule a family shares,
such as the state an outcome ends in, is written once. The families: inserts (`_columns`, the
columns each path writes; `_SKIP_TAKEN_KEYS`), claims (`_Choice`, the
jobs every claim, lock and finish takes), finishes (`_outcomes`, a batch's
outcomes on either lane), state reports (`_IN_FLIGHT`), crashes charged
(`_crashed`) and the rotation's moves (`_to_slot_0`).

A schema of fastjobs' own (App(schema=...)) has a catalogue of its own,
`of(schema)`: this module's source evaluated once more for that schema (see
SCHEMA), every name of fastjobs' objects qualified and quoted through `_S`,
its channels and leader key its own. `fastjobs sql show NAME --schema S`
prints one of its statements; the code takes its statements from the App's
catalogue (`app.sql`, the `sql=` parameter of the functions that send them).

Adding a variant is one edit: the line that names it. A family grows a
dimension in one place: the claims' variants are `_Choice`s, which every
claim, lock and finish reads, so flow control's limit, say, is a field of
`_Choice` and its predicate in `_Choice.where`; then a finish statement that
claims under it is

    job_finish_claim_limited: Final = _finish_claim(keep=False, choice=_Choice(limited=True), context=False)

and it is in STATEMENTS, prepared by the test of every statement and printed
by `fastjobs sql show job_finish_claim_limited`, with nothing else to edit.

Contents (each section opens with `_section`; SECTIONS lists them and their
statements, as `fastjobs sql show` does):

  Listening and migrations   listen_*, migration_*, schema_* (and SCHEMA, of: a schema's catalogue)
  Inserts (family)           job_insert*, job_copy*, the staging table
  Claims (family)            job_claim_many, job_lock_*
  Finishes (family)          job_finish_claim_*, job_complete_claim_*, job_claim_only_*, job_finish_locked_*
  The fast lane              its transaction, hand-over, wake-up, crash
  Leader                     the leader's lock and keepalives, the scheduler
  Workers                    a worker's session, registration, heartbeat, sleep
  Maintenance                rescuer, releaser, cleaners (results too), periodic jobs
  Operators                  cancel, retry, discard, delete; queues paused, resumed, limited
  State reports (family)     job_state, job_get, job_list, job_stats_by_queue, testing_jobs_*, job_status
  Vacuum and rotation        slot 0's VACUUM, the rotating slots
  Monitoring                 MVCC horizon, table health, NOTIFY queue
  Dashboard                  the leader's samples, the dashboard's bounded reads (fastjobs.web)
  Testing kit                fastjobs.testing's own statements
  Registry                   STATEMENTS, NOT_PREPARABLE, SECTIONS, FINISH*, COMPLETE*, CLAIM_ONLY*, LOCK
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Final

from .abc import CLAIMED_COLUMNS, CONTEXT_COLUMNS
from .errors import ConfigurationError

# Where each section of the catalogue starts: its title and how many module
# names were defined before it (a module's namespace keeps definition order).
_SECTION_STARTS: list[tuple[str, int]] = []


def _section(title: str) -> None:
    """Open a section of the catalogue: the statements defined after this call, up to the next, are its."""
    _SECTION_STARTS.append((title, len(globals())))


def _indent(text: str, spaces: int) -> str:
    """A fragment of several lines, laid out to sit `spaces` in (its first line where it is put)."""
    return ("\n" + " " * spaces).join(text.split("\n"))


# The schema of fastjobs' tables this catalogue names: None (this module) names them
# unqualified, found on each session's search_path, as fastjobs always has. `of(schema)` is
# the catalogue of another schema (App(schema=...), FASTJOBS_SCHEMA): this module's source
# evaluated once more with SCHEMA given, so every statement of it is written here once, and
# names fastjobs' tables, types and sequences in that schema, quoted ({_S}), its own
# notification channels and its leader's lock key. A statement sent on a caller's connection
# (enqueue with conn=) then leaves their search_path alone, and no session setting is needed.
SCHEMA: Final[str | None] = globals().get("SCHEMA")

# The longest schema name: a channel is named after its schema, and the longest,
# `fastjobs_result.` and the name, must fit an identifier (63 bytes; pg_notify fails past it).
SCHEMA_MAX: Final = 47
_SCHEMA_NAME_FORM: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def schema_name(value: object) -> str:
    """`value` if fastjobs can keep its tables in a schema of that name; else ConfigurationError."""
    if (
        not isinstance(value, str)
        or not _SCHEMA_NAME_FORM.fullmatch(value)
        or len(value) > SCHEMA_MAX
        or value.startswith("pg_")
    ):
        raise ConfigurationError(
            f"{value!r} is not a schema name fastjobs takes: 1 to {SCHEMA_MAX} letters (a-z, A-Z), digits,"
            " '_' or '-', starting with a letter or '_', and not 'pg_...' (PostgreSQL's own). It is used"
            " as written, quoted: 'Jobs' and 'jobs' are two schemas"
        )
    return value


def of(schema: str | None) -> ModuleType:
    """The catalogue of `schema` (checked by schema_name): this module for None, else a copy of it
    built on first use (see SCHEMA). Its statements, constants and helpers have this module's names."""
    base = sys.modules[__name__]
    return base if schema is None else base._catalogue(schema_name(schema))


@functools.cache
def _catalogue(schema: str) -> ModuleType:
    spec = importlib.util.find_spec(__name__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__dict__["SCHEMA"] = schema
    spec.loader.exec_module(module)
    return module


def relation(name: str) -> tuple[str, ...]:
    """Table or index `name` as psycopg.sql.Identifier's parts: in this catalogue's schema, if any."""
    return (name,) if SCHEMA is None else (SCHEMA, name)


# What goes before each name of fastjobs' objects in a statement: the schema, quoted.
_S: Final = "" if SCHEMA is None else f'"{SCHEMA}".'
# The schema mvcc_tables reports on.
_SCHEMA_NAME: Final = "current_schema()" if SCHEMA is None else f"'{SCHEMA}'"
# A schema's channels are named after it: a wake-up, a cancel (its payload a job id) or a
# result of one never reaches another's workers. Those of `public` are the unqualified
# catalogue's, since that is where its tables usually are: App() and App(schema="public")
# on one database are one installation.
_SUFFIX: Final = "" if SCHEMA in (None, "public") else f".{SCHEMA}"


# What a schema's database_identity ends with.
_IDENTITY: Final = f" || '{_SUFFIX}'" if _SUFFIX else ""


def _channel(name: str) -> str:
    """A channel as LISTEN and NOTIFY name it: quoted when it carries a schema's name."""
    return f'"{name}"' if _SUFFIX else name


def _key(purpose: str) -> int:
    """An advisory lock key of this catalogue's schema for `purpose`: a signed 64-bit hash."""
    digest = hashlib.blake2b(f"fastjobs {purpose} {SCHEMA}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


# Key of the session-level advisory lock `fastjobs migrate` holds, so two
# concurrent migrations apply each file once. ("fastjobs" in ASCII, truncated.)
# One for every schema: migrations of two schemas of a database take turns (an
# index build CONCURRENTLY waits for every older transaction, another migration's too).
MIGRATION_LOCK_KEY: Final = 0x66_61_73_74_6A_6F_62

# Default key of the session-level advisory lock the leader holds; the
# application can choose another so it cannot collide with its own locks. A
# schema's leader has a key of its own: each schema has a leader.
LEADER_LOCK_KEY: Final = 0x66_6A_6C_65_61_64 if not _SUFFIX else _key("leader")  # "fjlead"

# The literals below are written into the statements (and the migrations)
# as they are: a LISTEN or a statement's pg_notify cannot take its channel as
# a parameter without an extra parameter per batch. tests/test_sql.py checks
# that every literal of every statement and migration is one of these.

# Channel every wake-up is sent on; the payload is the queue name.
NOTIFY_CHANNEL: Final = f"fastjobs{_SUFFIX}"
# Channel of the listeners' health checks; the payload is the pinging listener's id.
PING_CHANNEL: Final = f"fastjobs_ping{_SUFFIX}"
# Channel of cancellation requests for running jobs; the payload is the job id.
CANCEL_CHANNEL: Final = f"fastjobs_cancel{_SUFFIX}"
# Channel of kept outcomes written (fastjobs_results): one notification per
# statement, its payload the ids, comma-separated, or '' (look again) when
# they would not fit a notification (RESULT_PAYLOAD_MAX).
RESULT_CHANNEL: Final = f"fastjobs_result{_SUFFIX}"
CHANNELS: Final = frozenset({NOTIFY_CHANNEL, PING_CHANNEL, CANCEL_CHANNEL, RESULT_CHANNEL})
# The longest payload of a RESULT_CHANNEL notification (PostgreSQL takes < 8000 bytes).
RESULT_PAYLOAD_MAX: Final = 7900

# The highest attempt a claim or a retry counts from (`least(attempt, 32766) + 1`):
# smallint's maximum less one, so the count never overflows the column.
ATTEMPT_CAP: Final = 32766

# How far before the last claim's run_at a claim after the mark starts, in
# microseconds ($7::int8 - 100000): room for transactions that committed late.
CLAIM_MARK_MARGIN: Final = 100_000


def _next_attempt(row: str) -> str:
    """The attempt a run of `row` ("j", or "" for the statement's only table) makes: its count stops
    at ATTEMPT_CAP + 1, smallint's maximum, so a row already there (written by hand) runs as its last
    attempt instead of failing the statement (max_attempts is a smallint too)."""
    column = f"{row}.attempt" if row else "attempt"
    return f"least({column}, {ATTEMPT_CAP}) + 1"


_section("Listening and migrations")

# listen_jobs, listen_ping, listen_cancel: subscribe a connection to a channel.
listen_jobs: Final = f"LISTEN {_channel(NOTIFY_CHANNEL)}"
listen_ping: Final = f"LISTEN {_channel(PING_CHANNEL)}"
listen_cancel: Final = f"LISTEN {_channel(CANCEL_CHANNEL)}"
listen_result: Final = f"LISTEN {_channel(RESULT_CHANNEL)}"
# unlisten_result: a waiter (fastjobs.results) is done with its connection, which goes back to the pool.
unlisten_result: Final = f"UNLISTEN {_channel(RESULT_CHANNEL)}"

# listener_ping: a listener's health check, answered on its own connection.
listener_ping: Final = f"SELECT pg_notify('{PING_CHANNEL}', $1)"

# schema_create: the schema of an App(schema=...), created by `fastjobs migrate --schema` ({schema}:
# its name, composed with psycopg.sql.Identifier as migration_index_drop's index is).
schema_create: Final = "CREATE SCHEMA IF NOT EXISTS {schema}"

# migration_search_path: the migrating session's search_path becomes $1 (a schema's
# migrations name its objects unqualified: fastjobs.schema); returns the one it replaces.
migration_search_path: Final = "SELECT current_setting('search_path'), set_config('search_path', $1, false)"

# migration_table_create: the table recording applied migrations.
migration_table_create: Final = f"""
CREATE TABLE IF NOT EXISTS {_S}fastjobs_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""

# migration_lock: serialise migrators (session level: the steps are transactions of their own).
# Tried, never waited for inside a statement: a CREATE INDEX CONCURRENTLY of
# the holder waits for every transaction older than it, a waiting
# migrator's included, which would deadlock.
migration_lock: Final = "SELECT pg_try_advisory_lock($1)"

# migration_unlock: let the next migrator in.
migration_unlock: Final = "SELECT pg_advisory_unlock($1)"

# migration_lock_timeout: how long a migration's transaction step waits for a lock (this transaction only).
migration_lock_timeout: Final = "SELECT set_config('lock_timeout', $1, true)"

# migration_index_invalid: whether index $1 exists but is invalid (a CONCURRENTLY build that failed).
migration_index_invalid: Final = """
SELECT NOT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass($1)"""

# migration_index_drop: drop what a failed CONCURRENTLY build left, before building it again.
migration_index_drop: Final = "DROP INDEX CONCURRENTLY IF EXISTS {index}"

# migration_blockers: the sessions the migrating backend $1 waits on, oldest transaction first.
migration_blockers: Final = """
SELECT a.pid, a.application_name, a.state,
       coalesce(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8,
       left(regexp_replace(a.query, '[[:space:]]+', ' ', 'g'), 200)
  FROM pg_stat_activity a
 WHERE a.pid = ANY (pg_blocking_pids($1))
 ORDER BY a.xact_start"""

# migration_applied_list: versions already applied.
migration_applied_list: Final = f"SELECT version FROM {_S}fastjobs_migrations ORDER BY version"

# migration_record: mark one migration applied.
migration_record: Final = f"INSERT INTO {_S}fastjobs_migrations (version, name) VALUES ($1, $2)"

# schema_exists: whether the migrations table exists (schema_version would fail without it).
schema_exists: Final = f"SELECT to_regclass('{_S}fastjobs_migrations') IS NOT NULL"

# schema_version: the newest applied migration.
schema_version: Final = f"SELECT max(version) FROM {_S}fastjobs_migrations"


_section("Inserts")

# The states in which a unique key is taken are the partial unique index's
# predicate (migrations/002_maintenance.sql): job_insert, job_get_unique and
# job_insert_staged spell it as UNIQUE_STATES (tests/test_sql.py checks the index).
UNIQUE_STATES: Final = "state IN ('available', 'scheduled', 'running', 'retryable')"

# Jobs live in fastjobs_jobs_all, partitioned on `slot`
# (migrations/005_rotation.sql). Every statement that reads, claims or
# finishes names the parent. Inserts name their partition's table only where
# a job must stay durable: unique-key jobs (their unique index is
# fastjobs_jobs's: a partitioned table's would have to include the slot)
# and scheduled ones go into fastjobs_jobs, slot 0, directly; jobs due now
# without a key go through the parent into the current rotating slot.


def _columns(*, at: bool, key: bool, fair: bool = False) -> str:
    """The columns an insert writes, in the order of its values (and of encode_copy_rows's COPY rows):
    a job due now takes the table's defaults for the rest; one due at a time of its own has its state
    and run_at; a keyed one its unique key too; one with a fairness key (`fair`) that key, last."""
    scheduled = ", state, run_at" if at else ""
    keyed = ", unique_key" if key else ""
    limited = f", {_LIMIT_COLUMNS}" if key else ""
    fair_key = ", fair_key" if fair else ""
    return (
        f"queue, kind, args, priority, max_attempts{scheduled}{keyed}, keep_result, meta{limited}{fair_key}"
    )


# A job's limits per key (migrations/009_keys.sql): its key and the limits its kind declared. Written
# by the inserts that take a unique key (job_insert, the staged ones), which every keyed job takes.
_LIMIT_COLUMNS: Final = "limit_key, limit_concurrency, limit_rate"


def _copy(*, into: str, at: bool, key: bool, fair: bool = False) -> str:
    """A binary COPY of jobs into `into`; rows are encoded by fastjobs._core.encode_copy_rows (and
    fastjobs.enqueue, which appends each row's fairness key with `fair`)."""
    return f"COPY {into} ({_columns(at=at, key=key, fair=fair)}) FROM STDIN (FORMAT BINARY)"


# A key already taken inserts nothing: the conflict names the partial unique index by its predicate.
_SKIP_TAKEN_KEYS: Final = f"""ON CONFLICT (unique_key)
   WHERE unique_key IS NOT NULL AND {UNIQUE_STATES}
   DO NOTHING"""

# job_insert: one job, into slot 0 (fastjobs_jobs); scheduled when its run_at
# ($6, or now + $7 seconds) is in the future; $9 its meta (enqueue
# middleware's, or NULL), $10 its keep_result (seconds, or NULL), $11 to $13
# its limit key, concurrency and rate (_LIMIT_COLUMNS, or NULL), $14 its
# fairness key (or NULL). With a unique key ($8) already taken, nothing is
# inserted and no row returned (job_get_unique then finds the holder).
job_insert: Final = f"""
INSERT INTO {_S}fastjobs_jobs ({_columns(at=True, key=True, fair=True)})
SELECT $1, $2, $3::jsonb, $4, $5,
       CASE WHEN t.run_at > now() THEN 'scheduled' ELSE 'available' END::{_S}fastjobs_state,
       t.run_at, $8, $10::int4, $9::jsonb, $11, $12::int4, $13::float8, $14::text
  FROM (SELECT coalesce($6::timestamptz,
                        now() + make_interval(secs => coalesce($7::float8, 0)))) AS t(run_at)
{_SKIP_TAKEN_KEYS}
RETURNING id"""

# job_insert_now: one job due now, without a unique key: what most enqueues
# are. A plain INSERT ... VALUES: job_insert's INSERT ... SELECT with its ON
# CONFLICT arbiter costs the server about twice as much per row (measured
# 120-140 us against 55-65 us a statement, one session, PostgreSQL 15).
# Through the parent: into the current rotating slot (the slot's default),
# with its meta ($6, or NULL) and keep_result ($7, or NULL): an app with enqueue middleware (tracing) puts
# meta on every job, which must not all go to slot 0, back onto VACUUM.
job_insert_now: Final = f"""
INSERT INTO {_S}fastjobs_jobs_all ({_columns(at=False, key=False)})
VALUES ($1, $2, $3::jsonb, $4, $5, $7::int4, $6::jsonb)
RETURNING id"""

# job_insert_now_fair: job_insert_now's job with a fairness key ($8).
job_insert_now_fair: Final = f"""
INSERT INTO {_S}fastjobs_jobs_all ({_columns(at=False, key=False, fair=True)})
VALUES ($1, $2, $3::jsonb, $4, $5, $7::int4, $6::jsonb, $8)
RETURNING id"""

# job_get_unique: the pending or running job holding unique key $1 (only slot 0 holds keys).
job_get_unique: Final = f"""
SELECT id FROM {_S}fastjobs_jobs
 WHERE unique_key = $1 AND {UNIQUE_STATES}"""

# The session's staging table (a temporary one): a schema's is its own, since its
# state column is of the schema's type and one session may enqueue into two schemas.
_STAGED: Final = "fastjobs_staged" if SCHEMA is None else f'pg_temp."fastjobs_staged_{SCHEMA}"'

# job_copy_staged: bulk unique jobs go through a temporary table, since COPY cannot skip conflicts.
job_copy_staged: Final = _copy(into=_STAGED, at=True, key=True, fair=True)

# job_stage_create: the session's staging table for bulk unique enqueues, emptied at commit.
job_stage_create: Final = f"""
CREATE TEMP TABLE IF NOT EXISTS {_STAGED} (
    queue text, kind text, args jsonb, priority smallint, max_attempts smallint,
    state {_S}fastjobs_state, run_at timestamptz, unique_key text, keep_result integer, meta jsonb,
    limit_key text, limit_concurrency integer, limit_rate float8, fair_key text
) ON COMMIT DELETE ROWS"""

# job_insert_staged: move staged jobs in, skipping keys already taken; one statement, one notification.
job_insert_staged: Final = f"""
INSERT INTO {_S}fastjobs_jobs ({_columns(at=True, key=True, fair=True)})
SELECT queue, kind, args, priority, max_attempts,
       coalesce(state, 'available'), coalesce(run_at, now()), unique_key, keep_result, meta,
       {_LIMIT_COLUMNS}, fair_key
  FROM {_STAGED}
{_SKIP_TAKEN_KEYS}"""

# job_stage_clear: empty the staging table (a caller's transaction may stage again before commit).
job_stage_clear: Final = f"DELETE FROM {_STAGED}"

# job_copy: bulk insert of jobs due now into the current rotating slot.
job_copy: Final = _copy(into=f"{_S}fastjobs_jobs_all", at=False, key=False)

# job_copy_at: bulk insert of jobs that all share one run_at (and state), into slot 0.
job_copy_at: Final = _copy(into=f"{_S}fastjobs_jobs", at=True, key=False)
# job_copy_fair, job_copy_at_fair: the same two for jobs with a fairness key, each row's last.
job_copy_fair: Final = _copy(into=f"{_S}fastjobs_jobs_all", at=False, key=False, fair=True)
job_copy_at_fair: Final = _copy(into=f"{_S}fastjobs_jobs", at=True, key=False, fair=True)


_section("Claims")

# Every claim takes available jobs of one queue in claim order, skipping rows
# other workers hold: the state lane's claim (job_claim_many, and the claimed
# part of every job_finish_claim_*) and the fast lane's (job_lock_*).
#
# A claim after the mark starts where the last claim ended (its priority, and
# its run_at in microseconds since 2000-01-01, the binary timestamptz the
# claim returned, less CLAIM_MARK_MARGIN for transactions that committed
# late). Claimed jobs leave dead entries at the front of the claim index until
# VACUUM removes them, and a scan from the front wades through all of them: a
# million after a minute at 30k jobs/s, or whenever a long transaction holds
# the horizon back (measured: 17 ms against 2.5 ms per claim of 1,000 behind
# 900,000 dead; a fast-lane claim from the front after a held snapshot spent
# 42 ms walking a slot of only dead entries, 3,600 index pages). The hot loop
# claims from the front only as often as that costs it 2% of its time
# (fastjobs.abc.FRONT_CLAIM_DUTY), which is nearly always when the index is
# clean; jobs behind the mark (promoted, retried, of another priority) wait
# for that claim.

# What a claim returns of each job, in the order the hot loops decode it (fastjobs.abc.COL_*); with
# context (the app has middleware, which fills each JobContext) its meta and
# created_at too. keep_result (NULL for most jobs) tells the loops which jobs'
# return values to send with their outcomes. Any other worker claims without, so a job pays for neither.
_CLAIMED: Final = CLAIMED_COLUMNS
_CONTEXT: Final = CONTEXT_COLUMNS

# Claim order: which jobs a claim takes, and the order a batch runs in (DESIGN: higher priority
# first, FIFO by run_at, id inside one). The candidates are read in that order, but an UPDATE
# returns its rows as it finds them by id, and a fair claim's as its keys take turns: every claim
# sorts what it returns (_in_claim_order), at most a batch of rows in memory.
_CLAIM_ORDER: Final = "priority DESC, run_at, id"


def _returned(*, context: bool, row: str = "", attempt: str = "") -> str:
    """The claimed columns, of table alias `row` if given; `attempt` in place of the attempt column."""
    columns = _CLAIMED + _CONTEXT if context else _CLAIMED
    prefix = f"{row}." if row else ""
    return ", ".join(attempt if column == "attempt" and attempt else prefix + column for column in columns)


# Whether the claim holds the turn of the group of a keyed job's key (migration 011): the
# groups its transaction holds and those it passed over are bits of a setting, read here, so
# fastjobs_in_turn (PL/pgSQL, which tries the group's lock) is called once per group, not per job.
# The group's two bits (held: 1 << g; passed over: 1 << (16 + g)) are shifted down and read by a
# simple CASE, so the setting and the key's hash are computed once a job: the claim's scan of 1,000
# keyed candidates took 20 ms with each computed twice (a searched CASE), 10 ms so.
_GROUPS_SEEN: Final = "coalesce(nullif(current_setting('fastjobs.key_groups', true), ''), '0')::int4"
_IN_TURN: Final = f"""CASE ({_GROUPS_SEEN} >> {_S}fastjobs_key_group(kind, limit_key)) & 65537
             WHEN 0 THEN {_S}fastjobs_in_turn(kind, limit_key, limit_concurrency)
             WHEN 65536 THEN false ELSE true END"""


@dataclass(frozen=True)
class _Choice:
    """Which available jobs a claim takes: the claims' variants. Every family that claims (the
    state lane's claim, the fast lane's lock, the finish statements) takes one and reads its `where`,
    so a new kind of claim is a field here and its predicate in `where`. A choice's parameters are
    numbered after the statement's own."""

    after: bool = False  # from the mark on: the priority and run_at where the last claim ended
    # After the mark, in slot 0 and the rotating slot given (the current one) alone: the partitions
    # pruned at the executor's start-up (see _IN_SLOT); a third parameter after the mark's two.
    slot: bool = False
    # Keyed jobs too (in their groups' turns, counted by fastjobs_take: _claim, _lock); without,
    # the claim takes none and costs nothing more: the state lane's for a queue never given a
    # keyed job (migration 012 marks one), the fast lane's for a loop whose app limits no kind.
    keys: bool = False

    def where(self, *, queue: str, limit: str, first: int, fast: bool = False, ending: str = "") -> str:
        """Up to `limit` available jobs of `queue` due now, in claim order, skipping rows others hold;
        none while the queue is paused, or is marked fair and has keyed jobs available (then
        select's fastjobs_fair takes them); with a concurrency or rate limit, none on the fast lane
        (`fast`: a job in flight there is not counted as running), and on the state lane `limit` is
        select's room. Each test is one lookup per statement (a one-time filter: its parameter is
        the statement's). This choice's parameters are $`first` and on."""
        after = ""
        if self.after:
            after = (
                f" AND priority = ${first}\n   AND run_at >= timestamptz '2000-01-01 00:00:00+00'"
                f" + (${first + 1}::int8 - {CLAIM_MARK_MARGIN}) * interval '1 microsecond'"
            )
        if self.slot:
            after += f"\n   AND {self.slots(first)}"
        stopped = _stopped(fast=fast)
        # A claim takes a keyed job only in the turn of its key's group (_IN_TURN), which it holds
        # to its transaction's end: on the fast lane (with `keys`), to the batch's commit, so no
        # other claim counts the group's keys while its jobs are in flight there unseen (not
        # `running` in the table). The test of a job without a key stops at its first operand.
        keyless = f"\n   AND (limit_key IS NULL OR {_IN_TURN})" if self.keys else "\n   AND limit_key IS NULL"
        fair = f"fair AND {_S}fastjobs_fair_keyed(name)"  # of the row: asked only when it is marked
        return f""" WHERE state = 'available' AND queue = {queue} AND run_at <= now(){after}{keyless}
   AND NOT EXISTS (SELECT FROM {_S}fastjobs_queues WHERE name = {queue} AND ({stopped} OR {fair}))
 ORDER BY {_CLAIM_ORDER}
 LIMIT {limit}
   FOR UPDATE SKIP LOCKED"""

    def slots(self, first: int, row: str = "") -> str:
        """With `slot`: the partitions the claim reads, slot 0 and slot $`first` + 2 (`row`: the alias)."""
        prefix = f"{row}." if row else ""
        return f"{prefix}slot IN (0, ${first + 2}::smallint)"

    def select(
        self, columns: str, *, queue: str, limit: str, first: int, fast: bool = False, ending: str = ""
    ) -> str:
        """The `columns` of the jobs `where` takes (`where`'s parameters), or, while the queue has
        jobs with a fairness key available, of those fastjobs_fair takes instead: round-robin across
        keys, the mark aside (a fair claim starts at each key's front). Which, the queue's row says
        (each branch's one-time filter, the lookup of the paused test): a queue never given a keyed
        job (queue_fair marks it) claims as before; one marked asks fastjobs_fair_keyed too, a probe
        of the index of keyed jobs, planned once per session (a function).

        On the state lane both branches take the room, how many of `limit` the queue's limits let
        start: fastjobs_room under a concurrency or rate limit, whose count leaves out the jobs a
        finish statement ends (`ending`: its worker, completed ids and outcome records, which the
        count cannot see: they are this statement's own writes). It is asked once, in the CTE
        `room`, which both read: the queue-order branch's LIMIT is computed even when its one-time
        filter is off, and a second call would take a rate-limited queue's tokens twice."""
        if not fast:
            room = _room(queue=queue, limit=limit, ending=ending)
            return f"""WITH room AS MATERIALIZED (
  SELECT {_indent(room, 9)} AS n
)
{self._either(columns, queue=queue, limit="(SELECT n FROM room)", first=first, fast=fast)}"""
        return self._either(columns, queue=queue, limit=limit, first=first, fast=fast)

    def _either(self, columns: str, *, queue: str, limit: str, first: int, fast: bool) -> str:
        """select's two branches, each taking up to `limit`."""
        plain = self.where(queue=queue, limit=limit, first=first, fast=fast)
        stopped = _stopped(fast=fast)
        # A fair claim's keyed jobs are not filtered by their groups' turns (fastjobs_take drops
        # those of groups it does not hold): on the fast lane they would stay locked to its
        # batch's commit, so it takes only the keyless, as a claim without `keys` does.
        filters = "\n   AND limit_key IS NULL" if fast or not self.keys else ""
        # A claim in one slot takes the fair jobs of its slots only: its UPDATE reads no other. (A
        # loop sends none for a queue it was told is fair: Planner.fair.)
        filters += f"\n   AND {self.slots(first)}" if self.slot else ""
        return f"""SELECT * FROM (
  SELECT {columns} FROM {_S}fastjobs_jobs_all
  {_indent(plain, 2)}) AS queued
UNION ALL
SELECT {columns} FROM {_S}fastjobs_fair({queue}, {limit})
 WHERE EXISTS (SELECT FROM {_S}fastjobs_queues
                WHERE name = {queue} AND fair AND NOT {stopped} AND {_S}fastjobs_fair_keyed(name)){filters}"""


def _stopped(*, fast: bool) -> str:
    """What stops every claim of a queue, a condition on its fastjobs_queues row: its pause, and on
    the fast lane any limit too (see _Choice.where)."""
    if fast:
        return "(paused_at IS NOT NULL OR concurrency IS NOT NULL OR rate IS NOT NULL)"
    return "paused_at IS NOT NULL"


def _room(*, queue: str, limit: str, ending: str) -> str:
    """How many of `limit` a state-lane claim of `queue` may take: `limit`, or fastjobs_room's
    figure under a concurrency or rate limit (see _Choice.select)."""
    limits = "concurrency IS NOT NULL OR rate IS NOT NULL"
    limited = f"SELECT FROM {_S}fastjobs_queues WHERE name = {queue} AND ({limits})"
    room = f"{_S}fastjobs_room({queue}, {limit}{ending})"
    return f"CASE WHEN EXISTS ({limited})\n     THEN {room} ELSE {limit} END"


_FROM_THE_FRONT: Final = _Choice()
_AFTER_THE_MARK: Final = _Choice(after=True)
_KEYS_FROM_THE_FRONT: Final = _Choice(keys=True)
_KEYS_AFTER_THE_MARK: Final = _Choice(after=True, keys=True)
# A claim after the mark that reads slot 0 and the current rotating slot alone, which a loop sends
# when no other slot can hold an available job at or after its mark (fastjobs.planner.Planner.slots:
# a row inserted into a rotating slot has a run_at from before that slot stopped being current).
# Three partitions fewer to start up, in its scan and in its UPDATE: a claim on an idle queue took
# 0.118 ms against 0.131 ms over the five (bench/RESULTS.md, issue 22 §5, eighth sitting). Rows
# whose run_at is written after their slot stopped being current (a Retry(0), a promoted retry in
# a slot no longer current) are found by the claims from the front, as rows behind the mark are.
_IN_SLOT: Final = _Choice(after=True, slot=True)


def _in_claim_order(rows: str, *, context: bool) -> str:
    """The claimed columns of `rows` (the claimed CTE, or the locked rows as a subquery), in claim order."""
    return f"SELECT {_returned(context=context)} FROM {rows}\n ORDER BY {_CLAIM_ORDER}"


def _claim(
    *,
    queue: str,
    limit: str,
    worker: str,
    choice: _Choice,
    first: int,
    context: bool,
    ending: str = "",
    ended: tuple[str, str] = ("NULL", "NULL"),
) -> str:
    """The state lane's claim: the jobs `choice` takes become running for `worker`, their attempt
    counted; an UPDATE, the CTE `claimed` of a statement that returns it _in_claim_order. The ids
    go through ARRAY(...): joined as a subquery instead, a large batch makes the planner hash-join
    it against a Seq Scan of the whole table. Without the choice's `keys`, the candidates' ids."""
    update = f"""UPDATE {_S}fastjobs_jobs_all j
   SET state = 'running', attempt = {_next_attempt("j")},
       attempted_at = now(), attempted_by = {worker}"""
    # The UPDATE reads only the partitions its candidates come from (each partition it may write
    # costs its start-up, indexes and all, as each the candidates' scan reads does).
    pruned = f"{choice.slots(first, 'j')} AND " if choice.slot else ""
    if not choice.keys:
        candidates = choice.select("id", queue=queue, limit=limit, first=first, ending=ending)
        return f"""{update}
 WHERE {pruned}j.id = ANY(ARRAY(
           {_indent(candidates, 11)}))
RETURNING {_returned(context=context, row="j")}"""
    candidates = choice.select(
        f"id, kind, {_LIMIT_COLUMNS}", queue=queue, limit=limit, first=first, ending=ending
    )
    return f"""{update}
 WHERE {pruned}j.id = ANY(ARRAY(
           WITH c AS (
               {_indent(candidates, 15)})
           SELECT id FROM c WHERE limit_key IS NULL
           UNION ALL
           {_indent(_keyed(worker=worker, ended=ended), 11)}))
RETURNING {_returned(context=context, row="j")}"""


def _keyed(*, worker: str, ended: tuple[str, str]) -> str:
    """Of the candidates `c` with a limit key, those fastjobs_take lets the claim take (none: not
    called when there are none, its arrays NULL); `ended`, of a finish statement, its completed ids
    and outcome records: the jobs it ends, which its count of running jobs leaves out."""
    done, outcomes = ended
    arrays = ", ".join(f"array_agg({column})" for column in ("id", "kind", *_LIMIT_COLUMNS.split(", ")))
    return f"""SELECT unnest({_S}fastjobs_take(
           {arrays},
           {worker}::text, coalesce({done}::bigint[], '{{}}'), coalesce({outcomes}::jsonb, '[]')))
  FROM c WHERE limit_key IS NOT NULL"""


def _lock(*, choice: _Choice, context: bool) -> str:
    """The fast lane's claim: lock up to $2 available jobs of queue $1 (the choice's parameters from
    $3), in claim order; nothing is written. The attempt returned is the one this run makes (counted
    when its outcome is written). With the choice's `keys`, of the keyed candidates it returns
    those fastjobs_take lets it take, as the state lane's claim does (_keyed, a hashed subplan run
    only if a candidate has a key: `id = ANY` of its array searched the array once per candidate,
    10 ms of a claim of 1,000); the rest stay locked to the batch's commit, in groups no other
    claim can take meanwhile. Without, it takes no keyed job (the CTE would cost a lock of 1,000
    jobs without keys 13%, 16.0 against 14.1 ms at the median of 100, alternating)."""
    columns = _returned(context=context, attempt=f"({_next_attempt('')})::smallint AS attempt")
    if not choice.keys:
        locked = choice.select(columns, queue="$1", limit="$2", first=3, fast=True)
        return "\n" + _in_claim_order(f"(\n  {_indent(locked, 2)}) AS locked", context=context)
    locked = choice.select(f"{columns}, {_LIMIT_COLUMNS}", queue="$1", limit="$2", first=3, fast=True)
    returned = _returned(context=context)
    keyed = _keyed(worker="''", ended=("NULL", "NULL"))
    return f"""
WITH c AS (
  {_indent(locked, 2)}
)
SELECT {returned} FROM c
 WHERE limit_key IS NULL OR id IN ({_indent(keyed, 34)})
 ORDER BY {_CLAIM_ORDER}"""


# job_claim_many: take up to $2 available jobs of queue $1 for worker $3, in
# claim order, skipping rows other workers hold; the attempt is counted here.
# Priority and run_at come back so the hot loop knows where the claim ended.
_CLAIM_MANY: Final = _claim(
    queue="$1", limit="$2", worker="$3", choice=_KEYS_FROM_THE_FRONT, first=4, context=False
)
job_claim_many: Final = f"""
WITH claimed AS (
    {_indent(_CLAIM_MANY, 4)}
)
{_in_claim_order("claimed", context=False)}"""

# job_lock_many, job_lock_after (after the mark), and their _context variants:
# the fast lane's claim (see its section).
job_lock_many: Final = _lock(choice=_FROM_THE_FRONT, context=False)
job_lock_after: Final = _lock(choice=_AFTER_THE_MARK, context=False)
job_lock_many_context: Final = _lock(choice=_FROM_THE_FRONT, context=True)
job_lock_after_context: Final = _lock(choice=_AFTER_THE_MARK, context=True)
# job_lock_keyed_*: the same, keyed jobs too, for a worker whose app has kinds limited per key
# (fastjobs.planner.takes_keys).
job_lock_keyed_many: Final = _lock(choice=_KEYS_FROM_THE_FRONT, context=False)
job_lock_keyed_after: Final = _lock(choice=_KEYS_AFTER_THE_MARK, context=False)
job_lock_keyed_many_context: Final = _lock(choice=_KEYS_FROM_THE_FRONT, context=True)
job_lock_keyed_after_context: Final = _lock(choice=_KEYS_AFTER_THE_MARK, context=True)


_section("Finishes")

# The hot loop's one statement per batch, one round trip: a job_finish_claim_*
# statement writes the outcomes of one batch and claims the next (from the
# front, or _after the mark: $6 priority, $7 run_at); a _keep one keeps
# completed jobs as 'completed' rows for the cleaner to remove after the
# retention period instead of deleting them; a _context one returns meta and
# created_at too. The fast lane's job_finish_locked_many writes the outcomes
# of a batch it locked, in the batch's transaction. Both lanes write the
# outcomes alike (_outcomes), in three CTEs:
# completed: the ids of jobs completed at their first attempt ($1, an int8
#   array: the usual case, found by the primary key in one index scan);
# completed_later: the same for the 'completed' outcomes of $2 (jobs
#   completed at an attempt other than the first);
# failed: the other outcomes of $2 recorded. $2 is a JSON array of the
#   records fastjobs.outcomes writes (fastjobs.types.Outcome: id, attempt,
#   state, delay in seconds or null to keep run_at, uncount 1 to give the
#   attempt back, error to append or null); the state a record ends its job
#   in is _outcome_state's. Its times (run_at, so a delay counts from then;
#   finalized_at; the 'at' of a cancel's note) are clock_timestamp(), when
#   the statement writes it: in the fast lane's transaction now() is its
#   start, before the handlers ran, and a Snooze(5) raised after a 3 s run
#   would come back 2 s later.
# An outcome applies only to the attempt that produced it. On the state lane
# the row must still be running that attempt for this worker ($5), or it was
# taken meanwhile (the rescuer, an operator) and the outcome is stale. On the
# fast lane the row is still available at the attempt before this run, which
# holds while the batch's transaction keeps it locked, and the attempt is
# counted (attempt - uncount) with worker $3 as attempted_by.
# The state lane's guards read `state::text = 'running'` so no plan can
# answer them from the partial index of running jobs: a queue table's
# statistics are often those of a moment it was empty, and then the generic
# plan scanned every running job per batch, filtering each against the id
# array (a drain at 0.55 x the raw limit instead of 1.2 x, measured). Finding
# the rows by id is the only plan left.

# An outcome that would run its job again, of a job whose cancellation was requested.
_CANCELS: Final = "j.cancel_requested AND f.state IN ('available', 'scheduled', 'retryable')"


def _outcome_state(attempt: str) -> str:
    """The state an outcome record ends its job in, `attempt` being the attempt it ends. A job whose
    cancellation was requested ends cancelled instead of running again (released, snoozed, retried),
    and a failed attempt (an error, the attempt counted) that was the last is discarded whatever the
    record says (the fallback record of a poison outcome does not know max_attempts)."""
    return f"""CASE WHEN {_CANCELS}
     THEN 'cancelled'
     WHEN f.error IS NOT NULL AND f.uncount = 0 AND f.state IN ('available', 'retryable')
          AND {attempt} >= j.max_attempts THEN 'discarded'
     ELSE f.state END::{_S}fastjobs_state"""


# Results (migrations/006_results.sql). A job enqueued with keep_result
# (seconds) keeps its outcome in fastjobs_results: the value its handler
# returned (sent as the `result` of its outcome record, never as a bare id),
# or the errors it was discarded or cancelled with. The statement that writes
# the outcome copies the row there, and the statement notifies the waiters
# (App.result) once, on RESULT_CHANNEL. A job without keep_result takes
# neither branch: an empty CTE scan per statement.
_RESULT_COLUMNS: Final = (
    ("id", "queue", "kind", "args", "priority", "state", "value", "errors", "attempt", "max_attempts"),
    ("created_at", "attempted_at", "finalized_at", "expires_at"),
)


def _result_columns(*, prefix: str = "", skip: str = "") -> str:
    """_RESULT_COLUMNS, each after `prefix`, without `skip`, on two lines (the second 4 in)."""
    lines = (", ".join(prefix + c for c in line if c != skip) for line in _RESULT_COLUMNS)
    return ",\n    ".join(lines)


def _keep(*, completed: str | None, ended: str) -> str:
    """The INSERT of kept outcomes: of rows `completed` returned (with their `result`), if given, and
    of rows `ended` returned that were discarded or cancelled; a row there already (a job retried
    since) is replaced. It returns the ids kept."""
    expires = "clock_timestamp() + make_interval(secs => keep_result)"
    values = ""
    if completed is not None:
        values = f"""SELECT id, queue, kind, args, priority, 'completed', result, errors, attempt,
       max_attempts, created_at, attempted_at, clock_timestamp(), {expires}
  FROM {completed} WHERE keep_result IS NOT NULL
UNION ALL
"""
    return f"""INSERT INTO {_S}fastjobs_results ({_result_columns()})
{values}SELECT id, queue, kind, args, priority, state, NULL, errors, attempt,
       max_attempts, created_at, attempted_at, clock_timestamp(), {expires}
  FROM {ended} WHERE keep_result IS NOT NULL AND state IN ('discarded', 'cancelled')
ON CONFLICT (id) DO UPDATE
   SET ({_indent(_result_columns(skip="id"), 4)})
     = ({_indent(_result_columns(prefix="excluded.", skip="id"), 4)})
RETURNING id"""


# What a statement that may end jobs returns of each for _keep to copy (its table aliased j).
_ENDED: Final = """j.id, j.queue, j.state, j.keep_result, j.kind, j.args, j.priority, j.attempt,
j.max_attempts, j.created_at, j.attempted_at, j.errors"""


def _ending(*, update: str, returned: str) -> str:
    """An UPDATE that may discard or cancel jobs (`update`, aliased j, without RETURNING) as a
    statement that keeps their outcome (_keep) and notifies; it returns `returned` (of the updated
    rows, as `ended`) as the UPDATE alone did."""
    return f"""
WITH ended AS (
    {_indent(update.strip(), 4)}
    RETURNING {_indent(_ENDED, 14)}
), kept AS (
    {_indent(_keep(completed=None, ended="ended"), 4)}
)
SELECT {returned} FROM ended
UNION ALL
SELECT {", ".join(["NULL"] * (returned.count(",") + 1))}
{_NOTIFY_KEPT}"""


# The one notification of the outcomes kept (a statement that kept none
# sends none: the HAVING leaves no row for the WHERE to evaluate).
_NOTIFY_KEPT: Final = f"""  FROM (SELECT string_agg(id::text, ',') AS ids FROM kept HAVING count(*) > 0) AS k
 WHERE pg_notify('{RESULT_CHANNEL}',
                 CASE WHEN length(k.ids) <= {RESULT_PAYLOAD_MAX} THEN k.ids ELSE '' END)::text IS NULL"""


def _outcomes(*, keep: bool, fast: bool, results: bool, records: bool = True) -> str:
    """The CTEs completed, completed_later and failed of a finish statement, and with `results`
    kept (the outcomes of jobs with keep_result); the last one left open. Without `records`,
    completed alone: the outcome records ($2) are none, and each data-modifying CTE costs its
    statement the start-up of a plan over every partition, used or not."""
    if fast:  # the row is locked, not claimed: the outcome's attempt is the run's, counted now
        attempt, runner = "f.attempt", "\n           attempted_at = now(), attempted_by = $3,"
        attempted = "now()"
        first = "j.attempt = 0 AND j.state::text = 'available'"
        record = f"{_next_attempt('j')} = f.attempt\n       AND j.state::text = 'available'"
    else:
        attempt, runner = "j.attempt", ""
        attempted = "j.attempted_at"
        first = "j.attempt = 1\n       AND j.attempted_by = $5 AND j.state::text = 'running'"
        record = "j.attempt = f.attempt\n       AND j.attempted_by = $5 AND j.state::text = 'running'"
    complete, joined = f"DELETE FROM {_S}fastjobs_jobs_all j", " USING"
    if keep:  # kept as 'completed' rows, which the cleaner removes after the retention period
        complete = f"UPDATE {_S}fastjobs_jobs_all j SET state = 'completed', finalized_at = now()"
        joined = "  FROM"
    state = _outcome_state(attempt)
    later, later_returned, failed_returned, kept = "", "j.id", "j.id, j.queue, j.state", ""
    if results:
        later = ",\n                                              result jsonb"
        later_returned = (
            f"j.id, j.keep_result, f.result, j.queue, j.kind, j.args, j.priority, {attempt} AS attempt,"
            f"\n              j.max_attempts, j.created_at, {attempted} AS attempted_at, j.errors"
        )
        failed_returned = _indent(_ENDED, 14)
        kept = f"""
), kept AS (
    {_indent(_keep(completed="completed_later", ended="failed"), 4)}"""
    completed = f"""WITH completed AS (
    {complete}
     WHERE j.id = ANY($1::bigint[]) AND {first}
    RETURNING j.id"""
    if not records:
        return completed
    return f"""{completed}
), completed_later AS (
    {complete}
    {joined} jsonb_to_recordset($2::jsonb) AS f(id bigint, attempt smallint, state {_S}fastjobs_state{later})
     WHERE f.state = 'completed' AND j.id = f.id AND {record}
    RETURNING {later_returned}
), failed AS (
    UPDATE {_S}fastjobs_jobs_all j
       SET state = {_indent(state, 19)},
           run_at = CASE WHEN f.delay IS NULL THEN j.run_at
                         ELSE clock_timestamp() + make_interval(secs => f.delay) END,
           attempt = {attempt} - f.uncount,{runner}
           finalized_at = CASE
               WHEN {_indent(state, 20)} IN ('discarded', 'cancelled')
               THEN clock_timestamp() END,
           errors = CASE WHEN f.error IS NOT NULL
                         THEN coalesce(j.errors, '[]'::jsonb) || jsonb_build_array(f.error)
                         WHEN {_CANCELS}
                         THEN coalesce(j.errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                              'at', clock_timestamp(), 'attempt', {attempt}, 'traceback', NULL,
                              'error', 'Cancel: cancellation requested before it could run again'))
                         ELSE j.errors END
      FROM jsonb_to_recordset($2::jsonb) AS f(id bigint, attempt smallint, state {_S}fastjobs_state,
                                              delay float8, uncount smallint, error jsonb)
     WHERE f.state <> 'completed' AND j.id = f.id AND {record}
    RETURNING {failed_returned}{kept}"""


# The wake-up of each queue an outcome made available at once (Retry(0),
# Snooze(0), a release): pg_notify returns void, so its branch yields no row.
_WAKE: Final = f"""  FROM (SELECT DISTINCT queue FROM failed WHERE state = 'available') AS woken
 WHERE pg_notify('{NOTIFY_CHANNEL}', woken.queue)::text IS NULL"""


def _slot_row(*, choice: _Choice, first: int, context: bool) -> str:
    """The row a claim after the mark ends with, for the loop's Planner.slots: the current rotating
    slot as its attempt and the time it was read as its run_at, the rest NULL (its args NULL sets it
    apart from a stale outcome's row). The time is read after the slot (a target list is evaluated
    in order), so it is at or after the moment that slot became current. A claim in one slot (the
    choice's parameters from $`first`) returns it only when another slot is current, so that none
    says its slot still is: the row cost a claim 0.012 ms, as much as the three partitions its
    slot saves, the one-time filter 0.004 ms (bench/RESULTS.md, issue 22 §5, eighth sitting)."""
    slot = f"pg_sequence_last_value('{_S}fastjobs_slot')::smallint"
    values = ["NULL"] * (len(_CLAIMED) + (len(_CONTEXT) if context else 0))
    values[_CLAIMED.index("attempt")] = slot
    values[_CLAIMED.index("run_at")] = "clock_timestamp()"
    moved = f"\n WHERE {slot} <> ${first + 2}::smallint" if choice.slot else ""  # the choice's slot
    return f"SELECT {', '.join(values)}{moved}"


def _finish_claim(
    *,
    keep: bool,
    choice: _Choice,
    context: bool,
    results: bool = False,
    records: bool = True,
    outcomes: bool = True,
) -> str:
    """Finish a batch and claim the next: the outcomes, then job_claim_many's claim of up to $4 jobs of
    queue $3 for worker $5 (LIMIT 0: none), the choice's parameters from $6. It returns the claimed
    rows, and after them one row per outcome that did not apply (stale), kind NULL, the outcome's
    state in args; each of those branches runs only when its count of applied rows falls short (a
    one-time filter: nothing to do in the usual batch). Claimed rows come first, in claim order: an
    Append runs its branches in order. Without `records` (the job_complete_claim_ variants), the
    batch's outcomes are completions at a first attempt only ($1; $2 is '[]'): a third of the
    statement's start-up less, which a shallow queue pays once per job. Without `outcomes` (the
    job_claim_only_ variants), nothing to finish ($1 '{}', $2 '[]'): the claim alone, without the
    DELETE over every partition that a loop woken from its sleep would start up for no row. A claim
    after the mark returns _slot_row last."""
    claim = _claim(
        queue="$3",
        limit="$4",
        worker="$5",
        choice=choice,
        first=6,
        context=context,
        ending=", $5, $1, $2",
        ended=("$1", "$2"),
    )
    slot = f"\nUNION ALL\n{_slot_row(choice=choice, first=6, context=context)}" if choice.after else ""
    if not outcomes:
        if not slot:
            return f"""
WITH claimed AS (
    {_indent(claim, 4)}
)
{_in_claim_order("claimed", context=context)}"""
        return f"""
WITH claimed AS (
    {_indent(claim, 4)}
)
({_in_claim_order("claimed", context=context)}){slot}"""
    width = len(_CLAIMED) + (len(_CONTEXT) if context else 0)
    rest = ", NULL" * (width - 4)  # the columns after id, kind, args and attempt
    notify = f"\nUNION ALL\nSELECT {', '.join(['NULL'] * width)}\n{_NOTIFY_KEPT}" if results else ""
    stale_completed = f"""SELECT c.id, NULL, to_jsonb('completed'::text), 1::smallint{rest}
  FROM unnest($1::bigint[]) AS c(id)
 WHERE (SELECT count(*) FROM completed) < cardinality($1::bigint[])
   AND c.id NOT IN (SELECT id FROM completed)"""
    head = f"""
{_outcomes(keep=keep, fast=False, results=results, records=records)}
), claimed AS (
    {_indent(claim, 4)}
)
({_in_claim_order("claimed", context=context)})
UNION ALL
{stale_completed}"""
    if not records:
        return head + slot
    return f"""{head}
UNION ALL
SELECT f.id, NULL, to_jsonb(f.state), f.attempt{rest}
  FROM jsonb_to_recordset($2::jsonb) AS f(id bigint, attempt smallint, state text)
 WHERE (SELECT count(*) FROM failed) + (SELECT count(*) FROM completed_later)
       < jsonb_array_length($2::jsonb)
   AND f.id NOT IN (SELECT id FROM failed UNION ALL SELECT id FROM completed_later)
UNION ALL
SELECT {", ".join(["NULL"] * width)}
{_WAKE}{notify}{slot}"""


# job_finish_claim_many: finish a batch (completed jobs deleted) and claim the next from the front.
job_finish_claim_many: Final = _finish_claim(keep=False, choice=_KEYS_FROM_THE_FRONT, context=False)
# job_finish_claim_after: the same, claiming after the mark ($6, $7).
job_finish_claim_after: Final = _finish_claim(keep=False, choice=_KEYS_AFTER_THE_MARK, context=False)
# job_finish_claim_many_keep, job_finish_claim_after_keep: the same two, keeping completed jobs.
job_finish_claim_many_keep: Final = _finish_claim(keep=True, choice=_KEYS_FROM_THE_FRONT, context=False)
job_finish_claim_after_keep: Final = _finish_claim(keep=True, choice=_KEYS_AFTER_THE_MARK, context=False)
# The four above, returning meta and created_at too (FINISH_CONTEXT).
job_finish_claim_many_context: Final = _finish_claim(keep=False, choice=_KEYS_FROM_THE_FRONT, context=True)
job_finish_claim_after_context: Final = _finish_claim(keep=False, choice=_KEYS_AFTER_THE_MARK, context=True)
job_finish_claim_many_keep_context: Final = _finish_claim(
    keep=True, choice=_KEYS_FROM_THE_FRONT, context=True
)
job_finish_claim_after_keep_context: Final = _finish_claim(
    keep=True, choice=_KEYS_AFTER_THE_MARK, context=True
)
# job_complete_claim_many, _after, _many_keep, _after_keep and their _context variants: the eight
# above for a batch whose outcomes are all completions at a first attempt ($2 is '[]'; COMPLETE),
# claiming in a queue never given a keyed job (migration 012's mark): keyless jobs only, so no
# key, turn or count is read. A keyed queue's outcomes and claims go by the eight above.
job_complete_claim_many: Final = _finish_claim(
    keep=False, choice=_FROM_THE_FRONT, context=False, records=False
)
job_complete_claim_after: Final = _finish_claim(
    keep=False, choice=_AFTER_THE_MARK, context=False, records=False
)
job_complete_claim_many_keep: Final = _finish_claim(
    keep=True, choice=_FROM_THE_FRONT, context=False, records=False
)
job_complete_claim_after_keep: Final = _finish_claim(
    keep=True, choice=_AFTER_THE_MARK, context=False, records=False
)
job_complete_claim_many_context: Final = _finish_claim(
    keep=False, choice=_FROM_THE_FRONT, context=True, records=False
)
job_complete_claim_after_context: Final = _finish_claim(
    keep=False, choice=_AFTER_THE_MARK, context=True, records=False
)
job_complete_claim_many_keep_context: Final = _finish_claim(
    keep=True, choice=_FROM_THE_FRONT, context=True, records=False
)
job_complete_claim_after_keep_context: Final = _finish_claim(
    keep=True, choice=_AFTER_THE_MARK, context=True, records=False
)
# job_complete_claim_in_slot, _in_slot_keep and their _context variants: the _after ones reading
# slot 0 and slot $8 alone (_IN_SLOT), which a loop sends when its Planner says no other slot can
# hold a job after the mark.
job_complete_claim_in_slot: Final = _finish_claim(keep=False, choice=_IN_SLOT, context=False, records=False)
job_complete_claim_in_slot_keep: Final = _finish_claim(
    keep=True, choice=_IN_SLOT, context=False, records=False
)
job_complete_claim_in_slot_context: Final = _finish_claim(
    keep=False, choice=_IN_SLOT, context=True, records=False
)
job_complete_claim_in_slot_keep_context: Final = _finish_claim(
    keep=True, choice=_IN_SLOT, context=True, records=False
)
# job_claim_only_many, _after and their _context variants: the claim of a loop with nothing to
# finish ($1 '{}', $2 '[]'; CLAIM_ONLY), as from its sleep, in a queue never given a keyed job.
job_claim_only_many: Final = _finish_claim(keep=False, choice=_FROM_THE_FRONT, context=False, outcomes=False)
job_claim_only_after: Final = _finish_claim(keep=False, choice=_AFTER_THE_MARK, context=False, outcomes=False)
job_claim_only_many_context: Final = _finish_claim(
    keep=False, choice=_FROM_THE_FRONT, context=True, outcomes=False
)
job_claim_only_after_context: Final = _finish_claim(
    keep=False, choice=_AFTER_THE_MARK, context=True, outcomes=False
)
# job_claim_only_in_slot, job_claim_only_in_slot_context: the same in slot 0 and slot $8 alone.
job_claim_only_in_slot: Final = _finish_claim(keep=False, choice=_IN_SLOT, context=False, outcomes=False)
job_claim_only_in_slot_context: Final = _finish_claim(
    keep=False, choice=_IN_SLOT, context=True, outcomes=False
)
# The eight finish statements with the outcomes of jobs that keep their result (keep_result): the _results
# variants (FINISH_RESULTS, FINISH_CONTEXT_RESULTS), which a loop sends only for outcomes of a
# batch that held such a job, so a batch without one sends the statement it sent before results.
job_finish_claim_many_results: Final = _finish_claim(
    keep=False, choice=_KEYS_FROM_THE_FRONT, context=False, results=True
)
job_finish_claim_after_results: Final = _finish_claim(
    keep=False, choice=_KEYS_AFTER_THE_MARK, context=False, results=True
)
job_finish_claim_many_keep_results: Final = _finish_claim(
    keep=True, choice=_KEYS_FROM_THE_FRONT, context=False, results=True
)
job_finish_claim_after_keep_results: Final = _finish_claim(
    keep=True, choice=_KEYS_AFTER_THE_MARK, context=False, results=True
)
job_finish_claim_many_context_results: Final = _finish_claim(
    keep=False, choice=_KEYS_FROM_THE_FRONT, context=True, results=True
)
job_finish_claim_after_context_results: Final = _finish_claim(
    keep=False, choice=_KEYS_AFTER_THE_MARK, context=True, results=True
)
job_finish_claim_many_keep_context_results: Final = _finish_claim(
    keep=True, choice=_KEYS_FROM_THE_FRONT, context=True, results=True
)
job_finish_claim_after_keep_context_results: Final = _finish_claim(
    keep=True, choice=_KEYS_AFTER_THE_MARK, context=True, results=True
)

# job_finish_locked_many: the fast lane's outcomes, in the transaction that
# locked their rows ($1, $2 as above, releases left out: an unstarted job is
# left as it was; worker $3). Returns how many outcomes applied, and wakes
# each queue an outcome made available at once.
job_finish_locked_many: Final = f"""
{_outcomes(keep=False, fast=True, results=False)}
)
SELECT (SELECT count(*) FROM completed) + (SELECT count(*) FROM completed_later)
       + (SELECT count(*) FROM failed)
UNION ALL
SELECT NULL
{_WAKE}"""

# job_finish_locked_many_results: the same with the outcomes of jobs that keep their result (as
# the _results variants above).
job_finish_locked_many_results: Final = f"""
{_outcomes(keep=False, fast=True, results=True)}
)
SELECT (SELECT count(*) FROM completed) + (SELECT count(*) FROM completed_later)
       + (SELECT count(*) FROM failed)
UNION ALL
SELECT NULL
{_WAKE}
UNION ALL
SELECT NULL
{_NOTIFY_KEPT}"""


_section("The fast lane")

# The fast lane: one write per job. A batch of short jobs is claimed by
# locking its rows (FOR UPDATE SKIP LOCKED) inside a transaction the hot
# loop holds while the handlers run, and finished in that transaction:
# a completed job is deleted, another outcome updates its row once. The claim
# writes no row version (the state lane's claim UPDATE writes one per job,
# plus pkey and running-index entries): measured 1.6x the drain of the
# UPDATE claim with half the dead tuples. A worker that dies rolls back and
# its jobs are available again at once, attempt uncounted; the master charges
# the crash to the job it was running (job_crash_fast). A job in flight on
# the fast lane keeps its row 'available' for the < 0.1 s its batch takes,
# and a cancel or another writer of its row waits for the batch's commit;
# every report of a job's state tells it is running (_IN_FLIGHT).

# fast_begin, fast_commit, fast_rollback: the fast lane's transaction (the
# worker's connection is otherwise in autocommit).
fast_begin: Final = "BEGIN"
fast_commit: Final = "COMMIT"
fast_rollback: Final = "ROLLBACK"

# job_hand_over: a fast-lane job whose handler outran its batch's deadline
# becomes an ordinary running job of worker $2 at attempt $3 (the one it is
# running), in the batch's transaction, whose lock on its row guards it; the
# batch then commits, so the handler holds no transaction for the rest of its
# run, and its outcome is written by the state lane's statements. Returns the
# row's id (none when the row is no longer the one claimed).
job_hand_over: Final = f"""
UPDATE {_S}fastjobs_jobs_all j
   SET state = 'running', attempt = $3, attempted_at = now(), attempted_by = $2
 WHERE j.id = $1 AND j.state::text = 'available' AND {_next_attempt("j")} = $3
RETURNING j.id"""

# queue_wake: wake the workers sleeping on queue $1 (sent at commit): jobs a
# fast batch left unstarted (its deadline, a stop, a hand-over) are available
# again without a write of their own that would wake them.
queue_wake: Final = f"SELECT pg_notify('{NOTIFY_CHANNEL}', $1)"


def _crashed(*, attempt: str, worker: str, at: str) -> str:
    """The assignments that charge a crash to a job whose worker died running attempt `attempt` of it
    (worker `worker`, at `at`): retryable, due at once, or discarded after $3 crashes or its last
    attempt, or cancelled when that was requested; the reason is appended to its errors."""
    ends = f"j.crashes + 1 >= $3 OR {attempt} >= j.max_attempts"
    return f"""state = CASE WHEN j.cancel_requested THEN 'cancelled'
                    WHEN {ends} THEN 'discarded'
                    ELSE 'retryable' END::{_S}fastjobs_state,
       run_at = {at},
       finalized_at = CASE WHEN j.cancel_requested OR {ends}
                           THEN {at} END,
       errors = coalesce(j.errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
           'at', {at}, 'attempt', {attempt}, 'traceback', NULL,
           'error', CASE WHEN j.cancel_requested
                         THEN 'cancelled: its worker died after cancellation was requested'
                         WHEN j.crashes + 1 >= $3
                         THEN format('quarantined: its worker died while running it %s times', j.crashes + 1)
                         ELSE format('worker %s died while running the job (crash %s)',
                                     {worker}, j.crashes + 1) END))"""


# job_crash_fast (and job_rescue_many, job_discard: every statement that may
# end a job keeps its outcome, with keep_result, as the finish statements do):
# worker $1 died running the jobs $2 on the fast lane: its
# transaction rolled back, so each is available again with no attempt
# counted. Each counts the attempt and a crash now, as job_rescue_many does
# for a running job: retryable (due now), or discarded after $3 crashes or
# its last attempt; one whose cancellation was requested is cancelled. A
# job another worker holds meanwhile is waited for (its batch's commit, or
# its own death); one that moved on (completed, running on the state lane,
# where the rescuer charges its worker) is left alone. $2 names only jobs
# whose outcome the worker had not written (a worker that writes its last
# outcomes before dying, a handler's SystemExit, clears its slot's job), so a
# row this worker wrote last is charged too: a job that failed or snoozed on
# it, came back, and then killed it. (Left: a job another worker ran
# meanwhile and made available again at once, Retry(0) or Snooze(0), before
# the releaser came, is charged a crash it did not cause.)
job_crash_fast: Final = _ending(
    update=f"""
UPDATE {_S}fastjobs_jobs_all j
   SET crashes = j.crashes + 1,
       attempt = {_next_attempt("j")},
       attempted_at = now(), attempted_by = $1,
       {_crashed(attempt=_next_attempt("j"), worker="$1::text", at="now()")}
 WHERE j.id = ANY($2::bigint[]) AND j.state = 'available'""",
    returned="id, state::text",
)


_section("Leader")

# job_schedule_many: scheduled and retryable jobs whose time has come become
# available, at most $1 per statement, oldest first; returns their queues so
# waiting workers can be woken.
job_schedule_many: Final = f"""
WITH promoted AS (
    UPDATE {_S}fastjobs_jobs_all SET state = 'available'
     WHERE id = ANY(ARRAY(
               SELECT id FROM {_S}fastjobs_jobs_all
                WHERE state IN ('scheduled', 'retryable') AND run_at <= coalesce($2::timestamptz, now())
                ORDER BY run_at
                LIMIT $1
                  FOR UPDATE SKIP LOCKED))
    RETURNING queue
)
SELECT queue, count(*), pg_notify('{NOTIFY_CHANNEL}', queue) FROM promoted GROUP BY queue"""

# leader_try_lock: become the leader if nobody is (session level: released when the session dies).
leader_try_lock: Final = "SELECT pg_try_advisory_lock($1)"

# leader_keepalive: the server's side of the leader's keepalives.
# Idle $1, interval $2 seconds, count $3 (fastjobs.leader.KEEPALIVE_*, which
# its libpq side uses too): the server notices within seconds that the
# leader's client vanished (a cut network), so the lock frees for another
# leader; and it ends the session of a leader stopped inside a transaction
# after $4 ms (its lease).
leader_keepalive: Final = """
SELECT set_config('tcp_keepalives_idle', $1::text, false),
       set_config('tcp_keepalives_interval', $2::text, false),
       set_config('tcp_keepalives_count', $3::text, false),
       set_config('idle_in_transaction_session_timeout', $4::text, false)"""

# leader_renew: a statement on the lock's session, so pg_stat_activity shows
# the leader alive (state_change) and no candidate takes over (leader_take_over).
leader_renew: Final = "SELECT 1"

# leader_take_over: terminate the session of a leader (application_name
# $3) that holds lock $1 but has been idle for more than $2 seconds: its
# process is stopped or cut off while its socket stays open, and only its
# session's end frees the lock. Returns the pid, client and idle seconds of
# each session terminated.
leader_take_over: Final = """
SELECT a.pid, coalesce(host(a.client_addr), 'local'),
       extract(epoch FROM now() - a.state_change)::float8, pg_terminate_backend(a.pid)
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = (($1::bigint >> 32) & 4294967295)::oid
   AND l.objid = ($1::bigint & 4294967295)::oid
   AND a.application_name = $3
   AND a.state LIKE 'idle%'
   AND a.state_change < now() - make_interval(secs => $2)"""

# leader_unlock: step down cleanly.
leader_unlock: Final = "SELECT pg_advisory_unlock($1)"


_section("Workers")

# worker_session: the hot loop's connection settings.
# synchronous_commit off: it commits without waiting for its WAL flush. Safe
# under at-least-once: a crash can only forget claims and outcomes of the
# last moments, so those jobs run again; enqueues, made on the application's
# connections, stay fully durable. It takes an fsync off every claim's round
# trip (pickup latency) and lets commits group.
# enable_seqscan off: every statement of this connection finds its rows by
# index; statistics taken while the queue was empty would otherwise make a
# Seq Scan of the whole table look cheap for a batch's outcomes.
# Keepalives as the leader's (fastjobs.leader.KEEPALIVE_*: idle 5 s, every
# 2 s, 3 probes): a fast-lane batch holds its rows' locks in an open
# transaction, and a worker host cut off or paused mid-batch would otherwise
# hold them, and every rotating slot against the rotation, until the
# kernel's keepalive (two hours); the server now ends its session in ~11 s.
# plan_cache_mode force_generic_plan: its statements run on generic plans
# from the first execution, which plan_ahead then plans before the first job;
# in auto mode each would first plan 5 custom ones (2-7 ms each over the five
# slots), on the loop's thread, during the worker's first jobs (bench/RESULTS.md,
# issue 22 §5, sixth sitting). Its generic plans are those auto mode settles on.
worker_session: Final = """
SELECT set_config('synchronous_commit', 'off', false), set_config('enable_seqscan', 'off', false),
       set_config('plan_cache_mode', 'force_generic_plan', false),
       set_config('tcp_keepalives_idle', '5', false), set_config('tcp_keepalives_interval', '2', false),
       set_config('tcp_keepalives_count', '3', false)"""

_PARAMETER = re.compile(r"\$(\d+)")


def plan_ahead(statements: list[tuple[str, str]]) -> str:
    """One query that plans the prepared (name, text) statements without running them: an EXPLAIN
    EXECUTE of each, its parameters NULL, caches its generic plan (worker_session forces those)."""
    explains = []
    for name, text in statements:
        count = max((int(n) for n in _PARAMETER.findall(text)), default=0)
        nulls = f"({', '.join(['NULL'] * count)})" if count else ""
        explains.append(f"EXPLAIN (COSTS OFF) EXECUTE {name}{nulls}")
    return ";\n".join(explains)


# worker_register: a worker process announces itself (or re-announces after a reconnect).
worker_register: Final = f"""
INSERT INTO {_S}fastjobs_workers (id, host, pid, queues) VALUES ($1, $2, $3, $4::text[])
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), queues = excluded.queues"""

# worker_heartbeat: one write per interval, never one per job, carrying the
# worker's counters ($5, see stats.worker_counters) for the cluster view; a
# row the cleaner pruned (the control connection was down for an hour) comes back.
worker_heartbeat: Final = f"""
INSERT INTO {_S}fastjobs_workers (id, host, pid, queues, counters) VALUES ($1, $2, $3, $4::text[], $5::jsonb)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), counters = excluded.counters"""

# worker_list: every registered worker for the cluster view, with its age and
# its heartbeat's by the database's clock (hosts' clocks may disagree).
worker_list: Final = f"""
SELECT id, host, pid, queues,
       extract(epoch FROM now() - started_at)::float8,
       extract(epoch FROM now() - heartbeat_at)::float8,
       counters
  FROM {_S}fastjobs_workers
 ORDER BY host, started_at, id"""

# worker_sleep: a worker is about to sleep on its LISTEN connection: inserts
# notify until at least $1 seconds from now (migrations/004_wakeups.sql).
# The deadline is never moved back (another worker may sleep longer), except
# from more than an hour ahead (the server's clock went back). No FROM: a scan
# of the sequence costs the hot loop's session (enable_seqscan off) a plan
# above jit_above_cost, and 25-120 ms of JIT compilation per sleep.
worker_sleep: Final = f"""
SELECT setval('{_S}fastjobs_sleep_until',
              greatest(least(coalesce(pg_sequence_last_value('{_S}fastjobs_sleep_until'), 0),
                             (date_part('epoch', clock_timestamp()) * 1000 + 3600000)::bigint),
                       (date_part('epoch', clock_timestamp()) * 1000 + $1::float8 * 1000)::bigint))"""

# worker_delete: a worker that stops cleanly removes its row.
worker_delete: Final = f"DELETE FROM {_S}fastjobs_workers WHERE id = $1"


_section("Maintenance")

# job_rescue_many: running jobs whose worker stopped heartbeating ($1 seconds
# before $2, or whose row is gone) go back to retryable, due now, with a crash
# counted; a job that has crashed $3 times, or has no attempt left, is
# discarded instead, and one whose cancellation was requested is cancelled.
# At most $4 per statement. A running row with no attempted_at (written by
# hand: no claim leaves one) counts as stale.
job_rescue_many: Final = _ending(
    update=f"""
UPDATE {_S}fastjobs_jobs_all j
   SET crashes = j.crashes + 1,
       {_crashed(attempt="j.attempt", worker="j.attempted_by", at="$2::timestamptz")}
 WHERE j.id = ANY(ARRAY(
           SELECT r.id FROM {_S}fastjobs_jobs_all r
            WHERE r.state = 'running'
              AND (r.attempted_at < $2::timestamptz - make_interval(secs => $1)
                   OR r.attempted_at IS NULL)
              AND NOT EXISTS (SELECT 1 FROM {_S}fastjobs_workers w
                               WHERE w.id = r.attempted_by
                                 AND w.heartbeat_at >= $2::timestamptz - make_interval(secs => $1))
            LIMIT $4
              FOR UPDATE SKIP LOCKED))""",
    returned="id, state::text",
)

# releaser_session: the master's releaser waits at most $1 for a lock or a statement.
releaser_session: Final = (
    "SELECT set_config('statement_timeout', $1, false), set_config('lock_timeout', $1, false)"
)

# job_release_unstarted: worker $1 (its exact id) died. Its running jobs
# other than $2 (those whose handler was running, or whose outcome it died
# writing) had been claimed but not started, or had finished unrecorded: they
# go back to available with the attempt given back and no crash counted (or
# to cancelled, when that was requested: kept, with keep_result), so a job that kills its worker is
# quarantined alone; the rescuer deals with $2. Workers of each queue that
# got jobs back are woken once.
job_release_unstarted: Final = f"""
WITH released AS (
    UPDATE {_S}fastjobs_jobs_all j
       SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'available' END::{_S}fastjobs_state,
           attempt = greatest(attempt - 1, 0),
           finalized_at = CASE WHEN cancel_requested THEN now() END,
           errors = CASE WHEN cancel_requested
                         THEN coalesce(errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                             'at', now(), 'attempt', attempt, 'traceback', NULL,
                             'error', 'cancelled: requested while it was claimed, before it started'))
                         ELSE errors END
     WHERE state = 'running' AND attempted_by = $1 AND NOT id = ANY($2::bigint[])
    RETURNING {_indent(_ENDED, 14)}
), kept AS (
    {_indent(_keep(completed=None, ended="released"), 4)}
)
SELECT queue, count(*), CASE WHEN bool_or(state = 'available') THEN pg_notify('{NOTIFY_CHANNEL}', queue) END
  FROM released GROUP BY queue
UNION ALL
SELECT NULL, NULL, NULL
{_NOTIFY_KEPT}"""

# job_clean_completed_many: delete up to $2 completed or cancelled jobs finalized before $1.
job_clean_completed_many: Final = f"""
DELETE FROM {_S}fastjobs_jobs_all WHERE id IN (
    SELECT id FROM {_S}fastjobs_jobs_all
     WHERE state IN ('completed', 'cancelled') AND finalized_at < $1
     LIMIT $2)"""

# job_clean_discarded_many: delete up to $2 discarded jobs finalized before $1.
job_clean_discarded_many: Final = f"""
DELETE FROM {_S}fastjobs_jobs_all WHERE id IN (
    SELECT id FROM {_S}fastjobs_jobs_all
     WHERE state = 'discarded' AND finalized_at < $1
     LIMIT $2)"""

# result_clean_many: delete up to $2 kept results (fastjobs_results) that expired before $1.
result_clean_many: Final = f"""
DELETE FROM {_S}fastjobs_results WHERE id IN (
    SELECT id FROM {_S}fastjobs_results
     WHERE expires_at < $1
     ORDER BY expires_at
     LIMIT $2)"""

# The class of the advisory locks a claim holds, one per group of the keys it takes from
# (fastjobs_key_group), to its commit (fastjobs_in_turn, migrations/011_key_groups.sql).
_KEY_GROUP_LOCK: Final = "1718382456"


# key_bucket_clean_many: of the next $4 rows of fastjobs_limits after kind $2 and key $3 (in key
# order: a batch reads at most $4 rows by the primary key, and the next goes on after its last),
# delete those that hold no operator's limit and whose bucket is full again at $1. It returns the rows
# read, the rows deleted, and the last kind and key read. A bucket holds at most max(rate, 1) tokens
# and refills at its rate, which only the claiming jobs carry; the slowest rate fastjobs takes (1/h)
# refills one token in an hour, a rate of at least 1/s a bucket in a second. So a bucket left alone
# for at least a second is full when it held a whole token, and after 3,600 s per token it lacked of
# one otherwise, whatever its rate. A key's next claim makes its row again, its bucket full: nothing a
# claim could take is lost. A row is deleted only under its key group's lock (pg_try_advisory_xact_lock,
# skipped when a claim holds it): fastjobs_take makes a key's row, then takes its tokens, and a row
# deleted between the two would let that claim take the key's jobs without counting any.
key_bucket_clean_many: Final = f"""
WITH read AS (
    SELECT kind, key FROM {_S}fastjobs_limits
     WHERE (kind, key) > ($2::text, $3::text)
     ORDER BY kind, key
     LIMIT $4
), deleted AS (
    DELETE FROM {_S}fastjobs_limits l
     USING read r
     WHERE l.kind = r.kind AND l.key = r.key
       AND l.concurrency IS NULL AND l.rate_limit IS NULL AND l.rate IS NULL
       AND l.refilled_at <= $1::timestamptz - make_interval(
               secs => greatest(1, 3600 * (1 - least(coalesce(l.tokens, 1), 1))))
       AND pg_try_advisory_xact_lock({_KEY_GROUP_LOCK}, {_S}fastjobs_key_group(l.kind, l.key))
    RETURNING 1
)
SELECT (SELECT count(*) FROM read), (SELECT count(*) FROM deleted), last.kind, last.key
  FROM (SELECT NULL) AS one
  LEFT JOIN (SELECT kind, key FROM read ORDER BY kind DESC, key DESC LIMIT 1) AS last ON true"""

# worker_prune_many: rows of workers silent since before $1 that hold no running job.
worker_prune_many: Final = f"""
DELETE FROM {_S}fastjobs_workers w
 WHERE w.heartbeat_at < $1
   AND NOT EXISTS (SELECT 1 FROM {_S}fastjobs_jobs_all j
                    WHERE j.state = 'running' AND j.attempted_by = w.id)"""

# periodic_advance: take tick $2 of periodic kind $1 if no leader has; a row
# back means enqueue it, and says whether the kind was seen for the first time
# (an inserted row has xmax 0, an updated one the updater's xid). A kind seen
# for the first time records $3: its tick when that is to run, else the moment
# it was first seen (not a whole minute, so never mistaken for a tick), from
# which on its missed ticks are caught up.
periodic_advance: Final = f"""
INSERT INTO {_S}fastjobs_periodic (kind, last_tick) VALUES ($1, $3)
ON CONFLICT (kind) DO UPDATE SET last_tick = $2
 WHERE {_S}fastjobs_periodic.last_tick < $2
RETURNING xmax = 0"""

# periodic_list: the last tick recorded for each periodic kind.
periodic_list: Final = f"SELECT kind, last_tick FROM {_S}fastjobs_periodic ORDER BY kind"

# db_now: the database's clock, which every maintenance decision uses.
db_now: Final = "SELECT now()"


_section("Operators")

# job_cancel: a queued job becomes cancelled at once (kept in
# fastjobs_results with keep_result, its waiters told); a running one gets
# cancel_requested and its worker is told on the fastjobs_cancel channel.
job_cancel: Final = f"""
WITH target AS (
    SELECT id, state FROM {_S}fastjobs_jobs_all
     WHERE id = $1 AND state IN ('available', 'scheduled', 'retryable', 'running')
       FOR UPDATE
), changed AS (
    UPDATE {_S}fastjobs_jobs_all j
       SET state = CASE WHEN t.state = 'running' THEN j.state ELSE 'cancelled' END,
           finalized_at = CASE WHEN t.state = 'running' THEN j.finalized_at ELSE now() END,
           cancel_requested = (t.state = 'running')
      FROM target t
     WHERE j.id = t.id
    RETURNING {_indent(_ENDED, 14)}
), kept AS (
    {_indent(_keep(completed=None, ended="changed"), 4)}
)
SELECT c.state::text,
       CASE WHEN c.state = 'running' THEN pg_notify('{CANCEL_CHANNEL}', c.id::text)
            WHEN EXISTS (SELECT FROM kept) THEN pg_notify('{RESULT_CHANNEL}', c.id::text) END
  FROM changed c"""

# job_cancel_requested: running jobs of worker $1 whose cancellation was requested.
job_cancel_requested: Final = f"""
SELECT id FROM {_S}fastjobs_jobs_all WHERE state = 'running' AND attempted_by = $1 AND cancel_requested"""

# job_retry: job $1 to run now. A retryable or scheduled job keeps its
# attempts and limit; a discarded, cancelled or completed one comes back
# with an attempt to spare (max_attempts raised when it had none left; the
# claim counts attempts up to smallint's maximum, and so does this) and its
# crash allowance back; an outcome kept of it (fastjobs_results) is
# forgotten. Returns the state before, the attempts made, the limit before
# and after, and wakes its queue's workers (an UPDATE fires no enqueue trigger).
job_retry: Final = f"""
WITH target AS (
    SELECT id, state::text AS state, max_attempts FROM {_S}fastjobs_jobs_all
     WHERE id = $1 AND state IN ('discarded', 'cancelled', 'completed', 'retryable', 'scheduled')
       FOR UPDATE
), forgotten AS (
    DELETE FROM {_S}fastjobs_results r USING target t WHERE r.id = t.id
)
UPDATE {_S}fastjobs_jobs_all j
   SET state = 'available', run_at = now(), finalized_at = NULL, cancel_requested = false,
       max_attempts = CASE WHEN t.state IN ('retryable', 'scheduled') THEN j.max_attempts
                      ELSE greatest(j.max_attempts, {_next_attempt("j")}) END,
       crashes = CASE WHEN t.state IN ('retryable', 'scheduled') THEN j.crashes ELSE 0 END
  FROM target t
 WHERE j.id = t.id
RETURNING t.state, j.attempt, t.max_attempts, j.max_attempts, pg_notify('{NOTIFY_CHANNEL}', j.queue)"""

# job_discard: a job that is not running becomes discarded now (kept, with keep_result, as the
# statements that end jobs keep them: _ending).
job_discard: Final = _ending(
    update=f"""
UPDATE {_S}fastjobs_jobs_all j SET state = 'discarded', finalized_at = now()
 WHERE j.id = $1 AND j.state IN ('available', 'scheduled', 'retryable', 'cancelled')""",
    returned="state::text",
)

# job_delete: a job that is not running is deleted now, with the outcome kept
# of it (fastjobs_results); returns the state it was in.
job_delete: Final = f"""
WITH forgotten AS (
    DELETE FROM {_S}fastjobs_results WHERE id = $1
)
DELETE FROM {_S}fastjobs_jobs_all
 WHERE id = $1 AND state IN ('available', 'scheduled', 'retryable', 'completed', 'discarded', 'cancelled')
RETURNING state::text"""

# job_select_many: ids of the jobs in states $1 of queue $2 and kind $3 (NULL:
# any) created more than $4 ago (NULL: any time) whose args contain $7 (jsonb
# @>; NULL: any), above id $5 and up to id $8, in id order, up to $6: the pages of `fastjobs
# jobs retry|cancel|discard --state/--queue/...` and of the dashboard's bulk
# actions, each id then acted on by job_retry, job_cancel, job_discard or job_delete.
job_select_many: Final = f"""
SELECT id FROM {_S}fastjobs_jobs_all
 WHERE state::text = ANY($1::text[]) AND ($2::text IS NULL OR queue = $2) AND ($3::text IS NULL OR kind = $3)
   AND ($4::interval IS NULL OR created_at < now() - $4::interval) AND id > $5
   AND ($7::jsonb IS NULL OR args @> $7::jsonb) AND id <= $8
 ORDER BY id
 LIMIT $6"""

# job_count_many: job_select_many's page of up to $6 jobs, counted: how many
# and the last id (the next page starts above it), so an operation by filter
# counts what it will act on a bounded page per statement.
job_count_many: Final = f"SELECT count(*), max(id) FROM ({job_select_many}) AS page"

# job_id_ceiling: the highest job id now; an operation by filter acts on no
# job above it (none enqueued after it began).
job_id_ceiling: Final = f"SELECT coalesce(max(id), 0) FROM {_S}fastjobs_jobs_all"

# job_kinds: every (queue, kind) of the jobs table and its count of pending
# jobs, for `fastjobs stats` (kinds no live worker handles) and the
# suggestions of `fastjobs jobs` when a --queue or --kind filter names none.
job_kinds: Final = f"""
SELECT queue, kind, count(*) FILTER (WHERE state IN ('available', 'scheduled', 'retryable'))
  FROM {_S}fastjobs_jobs_all
 GROUP BY queue, kind
 ORDER BY queue, kind"""

# queue_pause: pause queue $1 (a claim takes none of its jobs from the
# statement after this commits); when it was paused, already or now.
queue_pause: Final = f"""
INSERT INTO {_S}fastjobs_queues AS q (name, paused_at) VALUES ($1, now())
    ON CONFLICT (name) DO UPDATE SET paused_at = coalesce(q.paused_at, now()), updated_at = now()
RETURNING paused_at"""

# queue_resume: resume queue $1 and wake the workers sleeping on it (at
# commit); a row comes back only when it was paused.
queue_resume: Final = f"""
UPDATE {_S}fastjobs_queues SET paused_at = NULL, updated_at = now()
 WHERE name = $1 AND paused_at IS NOT NULL
RETURNING pg_notify('{NOTIFY_CHANNEL}', name)"""

# queue_limit: set queue $1's concurrency to $2 when $3, its max_backlog to
# $4 when $5, and its rate limit to $6 ("200/s") at $7 jobs a second when $8
# (NULL: no limit), leaving the others as they were. A new max_backlog is
# counted from the leader's next turn; a new rate starts with a full bucket.
queue_limit: Final = f"""
INSERT INTO {_S}fastjobs_queues AS q (name, concurrency, max_backlog, rate_limit, rate, tokens)
VALUES ($1, $2, $4, $6, $7::float8, coalesce(greatest($7::float8, 1.0), 0.0))
    ON CONFLICT (name) DO UPDATE
   SET concurrency = CASE WHEN $3 THEN $2 ELSE q.concurrency END,
       max_backlog = CASE WHEN $5 THEN $4 ELSE q.max_backlog END,
       backlog = CASE WHEN $5 THEN NULL ELSE q.backlog END,
       backlog_at = CASE WHEN $5 THEN NULL ELSE q.backlog_at END,
       rate_limit = CASE WHEN $8 THEN $6 ELSE q.rate_limit END,
       rate = CASE WHEN $8 THEN $7 ELSE q.rate END,
       tokens = CASE WHEN $8 THEN coalesce(greatest($7::float8, 1.0), 0.0) ELSE q.tokens END,
       refilled_at = CASE WHEN $8 THEN now() ELSE q.refilled_at END,
       updated_at = now()"""

# queue_list: every queue fastjobs knows of (acted on by an operator, or
# holding jobs) with when it was paused (NULL: running), its jobs waiting
# (available, scheduled, retryable) and running, its concurrency and
# max_backlog, the enqueues held back by it, and its fair mark (queue_fair).
queue_list: Final = f"""
SELECT name, max(paused_at), coalesce(sum(waiting), 0)::int8, coalesce(sum(running), 0)::int8,
       max(concurrency), max(rate_limit), max(max_backlog), coalesce(max(held_back), 0),
       coalesce(bool_or(fair), false)
  FROM (SELECT name, paused_at, NULL::int8 AS waiting, NULL::int8 AS running, concurrency, rate_limit,
               max_backlog, held_back, fair
          FROM {_S}fastjobs_queues
        UNION ALL
        SELECT queue, NULL,
               count(*) FILTER (WHERE state IN ('available', 'scheduled', 'retryable')),
               count(*) FILTER (WHERE state = 'running'), NULL, NULL, NULL, NULL, NULL
          FROM {_S}fastjobs_jobs_all
         WHERE state IN ('available', 'scheduled', 'retryable', 'running')
         GROUP BY queue) AS known
 GROUP BY name
 ORDER BY name"""

# queue_states: the queues an operator acted on: when paused (NULL:
# running), their concurrency, rate limit, max_backlog, last backlog count and enqueues
# held back, for `fastjobs stats` and the metrics.
queue_states: Final = f"""
SELECT name, paused_at, concurrency, rate_limit, max_backlog, backlog, held_back
  FROM {_S}fastjobs_queues
 ORDER BY name"""

# queue_fair: mark queue $1 fair: a producer process enqueueing its first keyed
# jobs into it says so once (fastjobs.queues.FairQueues); from then on its claims
# ask fastjobs_fair_keyed whether keyed jobs wait (sql._Choice.select).
queue_fair: Final = f"""
INSERT INTO {_S}fastjobs_queues AS q (name, fair) VALUES ($1, true)
ON CONFLICT (name) DO UPDATE SET fair = true, updated_at = now() WHERE NOT q.fair"""

# queue_limited: the queues with a concurrency limit, which a worker's loop claims a wave at a
# time, those ever given a keyed job, which it claims with the statements that take keyed
# jobs, and those marked fair, which it never claims in one slot (fastjobs.planner): read at its
# start and at each heartbeat.
queue_limited: Final = f"""
SELECT name, concurrency IS NOT NULL, keyed, fair
  FROM {_S}fastjobs_queues WHERE concurrency IS NOT NULL OR keyed OR fair"""

# key_limit: set kind $1's limits for key $2 ('': the kind as a whole; fastjobs.keys): its
# concurrency to $3 when $4, its rate limit to $5 ("10/s") at $6 jobs a second when $7 (NULL: the
# limit its jobs were enqueued with), leaving the other as it was. A new rate starts with a full
# bucket (tokens NULL).
key_limit: Final = f"""
INSERT INTO {_S}fastjobs_limits AS l (kind, key, concurrency, rate_limit, rate)
VALUES ($1, $2, $3, $5, $6::float8)
    ON CONFLICT (kind, key) DO UPDATE
   SET concurrency = CASE WHEN $4 THEN $3 ELSE l.concurrency END,
       rate_limit = CASE WHEN $7 THEN $5 ELSE l.rate_limit END,
       rate = CASE WHEN $7 THEN $6 ELSE l.rate END,
       tokens = CASE WHEN $7 THEN NULL ELSE l.tokens END,
       refilled_at = CASE WHEN $7 THEN now() ELSE l.refilled_at END,
       updated_at = now()"""

# key_limits: the limits an operator set per kind and key (key_limit), with each key's jobs
# running, for `fastjobs queues keys` (by kind and key).
key_limits: Final = f"""
SELECT l.kind, l.key, l.concurrency, l.rate_limit,
       (SELECT count(*) FROM {_S}fastjobs_jobs_all j
         WHERE j.kind = l.kind AND j.limit_key = l.key AND j.state = 'running')
  FROM {_S}fastjobs_limits l
 WHERE l.concurrency IS NOT NULL OR l.rate_limit IS NOT NULL
 ORDER BY l.kind, l.key"""

# key_usage: per kind with jobs limited per key (limit_key) running or due, for `fastjobs stats` and
# the metrics (fastjobs.keys.usage): its keys with jobs running, those jobs, the keys at their
# concurrency limit (an operator's, else the one their jobs were enqueued with), and the key of its
# job due the longest among the first KEY_FRONT of each queue in claim order, with how long it has
# waited. Every read is bounded, none a scan of the table: the running keyed jobs (the index
# fastjobs_jobs_limit_idx: at most the workers' concurrency), one fastjobs_limits probe per key
# running, and, in slot 0 (where keyed jobs live), one descent of the claim index per queue with
# available jobs and at most KEY_FRONT entries of its front. A kind whose keys are held back has its
# due jobs at that front: the claims take the jobs behind them.
KEY_FRONT: Final = 1000
key_usage: Final = f"""
WITH RECURSIVE queues AS (
    (SELECT queue FROM {_S}fastjobs_jobs WHERE state = 'available' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {_S}fastjobs_jobs j
             WHERE j.state = 'available' AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
      FROM queues q WHERE q.queue IS NOT NULL
), waiting AS (
    SELECT DISTINCT ON (f.kind) f.kind, f.limit_key AS key, f.run_at
      FROM queues q CROSS JOIN LATERAL (
           SELECT j.kind, j.limit_key, j.run_at FROM {_S}fastjobs_jobs j
            WHERE j.queue = q.queue AND j.state = 'available' AND j.run_at <= now()
            ORDER BY j.priority DESC, j.run_at, j.id
            LIMIT {KEY_FRONT}) AS f
     WHERE f.limit_key IS NOT NULL
     ORDER BY f.kind, f.run_at
), running AS (
    SELECT j.kind, j.limit_key AS key, count(*) AS running, min(j.limit_concurrency) AS declared
      FROM {_S}fastjobs_jobs j
     WHERE j.state = 'running' AND j.limit_key IS NOT NULL
     GROUP BY j.kind, j.limit_key
), keyed AS (
    SELECT r.kind, count(*) AS keys, sum(r.running)::int8 AS running,
           count(*) FILTER (WHERE r.running >= coalesce(l.concurrency, r.declared)) AS full
      FROM running r LEFT JOIN {_S}fastjobs_limits l ON l.kind = r.kind AND l.key = r.key
     GROUP BY r.kind
)
SELECT coalesce(k.kind, w.kind), coalesce(k.keys, 0), coalesce(k.running, 0), coalesce(k.full, 0),
       w.key, extract(epoch FROM now() - w.run_at)::float8
  FROM keyed k FULL JOIN waiting w ON w.kind = k.kind
 ORDER BY 1"""

# queue_full: the queues whose backlog the leader found at their max_backlog
# in the last $1 seconds (a count older than that, say with no leader, holds
# no producer back), with that count and the limit; what producers read, at
# most once a second each.
queue_full: Final = f"""
SELECT name, backlog, max_backlog FROM {_S}fastjobs_queues
 WHERE backlog >= max_backlog AND backlog_at > now() - $1 * interval '1 second'"""

# queue_held_back: add $2 to the enqueues queue $1 held back (a producer's
# count since its last report).
queue_held_back: Final = f"""
UPDATE {_S}fastjobs_queues SET held_back = held_back + $2 WHERE name = $1"""

# queue_count_backlogs: the leader counts the backlog (available, scheduled,
# retryable jobs) of each queue with a max_backlog, up to the limit (a count
# past it says no more), so the count costs at most the limit's index
# entries; the number of queues counted.
queue_count_backlogs: Final = f"""
WITH counted AS (
    SELECT q.name,
           (SELECT count(*)
              FROM (SELECT 1 FROM {_S}fastjobs_jobs_all j
                     WHERE j.queue = q.name AND j.state IN ('available', 'scheduled', 'retryable')
                     LIMIT q.max_backlog) AS upto) AS backlog
      FROM {_S}fastjobs_queues q
     WHERE q.max_backlog IS NOT NULL
)
UPDATE {_S}fastjobs_queues q SET backlog = counted.backlog, backlog_at = now()
  FROM counted
 WHERE q.name = counted.name"""


_section("State reports")

# A job in flight on the fast lane keeps its row 'available' for the < 0.1 s
# its batch takes. Every read of a job's state for people and metrics
# (job_state, job_get, job_list, job_stats_by_queue, testing_jobs_in_states,
# job_status, job_page)
# reports such a job 'running', by this one test: an available row whose
# xmax is a transaction in progress for the reading statement's snapshot is
# locked by a live transaction, a fast batch (or, for a moment, a state-lane
# claim's UPDATE about to make it running, or a cancel's lock). In progress:
# listed in pg_snapshot_xip, or at or after the snapshot's xmax, the first
# xid not completed when it was taken (a batch holding the newest xid, or one
# that took its xid during the statement, is not in the list). The second is
# computed on the low 32 bits (xmax has no epoch), modulo 2^32 so that
# wraparound cannot confuse it, and within 2^20 xids: xids taken between
# the last completion before the snapshot and the end of the statement fit
# well inside it, and a multixact xmax (a row locked by several
# transactions at once, which fastjobs never does; a user's foreign key or
# FOR SHARE can) counts on another counter, so only a 2^-12 chance puts it
# there instead of half the circle. A stale xmax cannot pass either: one
# 2^32 xids old would have been frozen away. Only available rows with a
# non-zero xmax reach the comparisons (a row never locked costs one). A
# locker in a subtransaction older than the snapshot's xmax is not listed
# (pg_snapshot_xip has top-level xids only): its row reads 'available'. A
# row another session holds (SELECT ... FOR UPDATE in a transaction of the
# user's) reads 'running' too: nothing tells its locker from a worker's
# batch, and no worker can claim it while it is held, so it is not waiting
# for one (tests/test_fast_lane.py). The row itself never says 'running'.
_IN_FLIGHT: Final = """state = 'available' AND xmax <> '0'::xid
AND (xmax = ANY(ARRAY(SELECT xid(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x))
     OR (xmax::text::bigint + 4294967296
         - (SELECT xid(pg_snapshot_xmax(pg_current_snapshot()))::text::bigint)) % 4294967296
        < 1048576)"""


def _reported_state(spaces: int) -> str:
    """A job's state as reported (see _IN_FLIGHT), laid out to sit `spaces` in."""
    return f"CASE WHEN {_indent(_IN_FLIGHT, spaces + 5)}\n{' ' * spaces}THEN 'running' ELSE state::text END"


# job_state: the state of job $1 (NULL when there is no such job), 'running'
# for a job in flight on the fast lane: the messages of cancel, retry and
# discard name it as jobs list does.
job_state: Final = f"""
SELECT {_reported_state(7)} AS state
  FROM {_S}fastjobs_jobs_all WHERE id = $1"""

# job_get: one job's row, for inspection and tests.
job_get: Final = f"""
SELECT id, queue, kind, args, priority,
       {_reported_state(7)} AS state,
       run_at, attempt, max_attempts, created_at, attempted_at, finalized_at, attempted_by, errors,
       unique_key, meta, crashes, cancel_requested
  FROM {_S}fastjobs_jobs_all WHERE id = $1"""

# job_list: jobs filtered by queue ($1), state ($2), kind ($3), newest first,
# up to $4. A job in flight on the fast lane is 'running', in its row and for
# the filter: `--state running` lists it, `--state available` does not. The
# CTE's state condition is a superset of the filter's, on the column: a
# custom plan can still answer `--state running` from the running and claim
# indexes instead of reading every job.
job_list: Final = f"""
WITH job AS (
    SELECT id, queue, kind, priority, attempt, max_attempts, run_at, created_at,
           {_reported_state(11)} AS state
      FROM {_S}fastjobs_jobs_all
     WHERE ($1::text IS NULL OR queue = $1) AND ($3::text IS NULL OR kind = $3)
       AND ($2::{_S}fastjobs_state IS NULL OR state = $2 OR ($2 = 'running' AND state = 'available'))
)
SELECT id, queue, kind, state, priority, attempt, max_attempts, run_at, created_at
  FROM job
 WHERE $2::{_S}fastjobs_state IS NULL OR state = $2::{_S}fastjobs_state::text
 ORDER BY id DESC
 LIMIT $4"""
# job_stats_by_queue: depth and oldest age (seconds) per queue and state, for
# `fastjobs stats` and the metrics endpoint. Ages: available since run_at,
# running since attempted_at, the rest since created_at. An infinite oldest
# time (a run_at of -infinity or infinity) has no age: NULL, where
# PostgreSQL < 17 would fail the subtraction and 17+ return an infinity
# that JSON cannot carry. A job in flight on the fast lane counts as
# running (see _IN_FLIGHT), since now: its batch began under 0.1 s ago, and
# its attempted_at is its last attempt's, if any. Whether a row is such a
# job (in_flight) is a key of the first grouping, so each row is tested
# once, in the scan (an expression of the outer query would be evaluated
# again, with snapshot arrays of its own); the second merges a queue's
# jobs in flight with its running ones. EXPLAIN ANALYZE on 1M rows (8
# queues, 70% available, 2,000 of them locked by a live transaction, 20
# xids in progress), medians of 9 on 2 busy cores: 185 -> 207 ms (parallel),
# 269 -> 280 ms (serial); with 100k more available rows last locked by a
# committed transaction (each takes the second comparison): 181 -> 214 ms,
# 251 -> 312 ms.
job_stats_by_queue: Final = f"""
WITH job AS (
    SELECT queue, state, run_at, attempted_at, created_at,
           {_indent(_IN_FLIGHT, 11)} AS in_flight
      FROM {_S}fastjobs_jobs_all
), grouped AS (
    SELECT queue, state::text AS state, in_flight, count(*) AS count,
           min(CASE state WHEN 'available' THEN run_at
                          WHEN 'running' THEN attempted_at
                          ELSE created_at END) AS oldest
      FROM job
     GROUP BY queue, state, in_flight
), depths AS (
    SELECT queue, CASE WHEN in_flight THEN 'running' ELSE state END AS state, sum(count)::bigint AS count,
           min(CASE WHEN in_flight THEN now() ELSE oldest END) AS oldest
      FROM grouped
     GROUP BY queue, CASE WHEN in_flight THEN 'running' ELSE state END
)
SELECT queue, state, count,
       CASE WHEN isfinite(oldest) THEN extract(epoch FROM now() - oldest)::float8 END
  FROM depths
 ORDER BY queue, state"""

# testing_jobs_in_states: the jobs in states $1, oldest first, for the
# assertions of the testing kit (fastjobs.testing); a job in flight on the
# fast lane is running, not pending.
testing_jobs_in_states: Final = f"""
WITH job AS (
    SELECT id, kind, queue, args, priority, run_at, attempt, max_attempts, errors, unique_key,
           {_reported_state(11)} AS state
      FROM {_S}fastjobs_jobs_all
)
SELECT id, kind, queue, args, priority, state, run_at, attempt, max_attempts, errors, unique_key
  FROM job
 WHERE state = ANY($1::{_S}fastjobs_state[]::text[])
 ORDER BY id"""


# job_status: job $1 as App.status reports it, from fastjobs_results (a kept
# outcome) or else from the jobs table: id, kind, queue, state (a job in
# flight on the fast lane is running), attempt, max_attempts, args,
# created_at, attempted_at, finalized_at, the value kept, errors, its
# keep_result, whether the row is a kept one, whether it has expired (the
# cleaner has yet to remove it) and its priority. No row: no such job.
job_status: Final = f"""
SELECT id, kind, queue, state, attempt, max_attempts, args, created_at, attempted_at, finalized_at,
       value, errors, keep_result, source = 0, expired, priority
  FROM (SELECT id, kind, queue, state::text AS state, attempt, max_attempts, args, created_at,
               attempted_at, finalized_at, value, errors, NULL::int4 AS keep_result,
               expires_at <= now() AS expired, 0 AS source, priority
          FROM {_S}fastjobs_results WHERE id = $1
        UNION ALL
        SELECT id, kind, queue,
               {_reported_state(15)},
               attempt, max_attempts, args, created_at, attempted_at,
               finalized_at, NULL, errors, keep_result, false, 1, priority
          FROM {_S}fastjobs_jobs_all WHERE id = $1) AS found
 ORDER BY source
 LIMIT 1"""


# result_get: the kept outcome of job $1 (fastjobs_results), for `fastjobs jobs show`.
result_get: Final = f"""
SELECT id, queue, kind, priority, state::text AS state, attempt, max_attempts, created_at,
       attempted_at, finalized_at, expires_at, args, errors, value AS result
  FROM {_S}fastjobs_results WHERE id = $1"""


_section("Vacuum and rotation")

# jobs_dead_rows: dead row versions of slot 0, fastjobs_jobs (the rotating
# slots are truncated, never vacuumed), that the statistics know of (each
# backend reports within a second or so), for the leader's vacuumer.
jobs_dead_rows: Final = (
    f"SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = '{_S}fastjobs_jobs'::regclass"
)

# vacuum_jobs: the leader's VACUUM of slot 0 (fastjobs_jobs); it skips a table
# another VACUUM (autovacuum, say) is working on instead of waiting. It
# leaves the empty pages at the table's end in place (TRUNCATE false): a
# queue's table ends in pages emptied a moment ago and filled again the next,
# and cutting them off takes an ACCESS EXCLUSIVE lock that every claim and
# enqueue queues behind. Under the soak at 80% load, VACUUM spent its time in
# the VacuumTruncate wait, workers in relation extension, and pickup latency
# had stalls of 0.1-3 s (bench/RESULTS.md, latency under load).
vacuum_jobs: Final = f"VACUUM (SKIP_LOCKED, TRUNCATE false) {_S}fastjobs_jobs"

# The rotation (fastjobs.maintenance.rotate_once): inserts through the parent go
# to the slot fastjobs_slot names; every `interval` the leader empties the
# oldest rotating slot, the one after the current, and makes it current. The
# slot's table is named in slot_lock and slot_truncate ({partition}:
# fastjobs_jobs_1 .. _4, composed with psycopg.sql.Identifier as
# migration_index_drop's index is): LOCK and TRUNCATE take no parameter.

# slot_current: the rotating slot inserts go to now.
slot_current: Final = f"SELECT pg_sequence_last_value('{_S}fastjobs_slot')::int"

# slot_usage: the rotating slot inserts go to now, and the bytes the four
# rotating slots take (tables, indexes, TOAST): the rotation runs only once
# they are worth emptying (RotationConfig.worth). Each size takes and at once
# releases an ACCESS SHARE lock, which nothing but a rotation conflicts with.
slot_usage: Final = f"""
SELECT pg_sequence_last_value('{_S}fastjobs_slot')::int,
       (pg_total_relation_size('{_S}fastjobs_jobs_1') + pg_total_relation_size('{_S}fastjobs_jobs_2')
        + pg_total_relation_size('{_S}fastjobs_jobs_3')
        + pg_total_relation_size('{_S}fastjobs_jobs_4'))::int8"""

# slot_rows: the rows slot $1 still holds, counted up to $2 (a slot holding
# more waits: a backlog drains oldest first, from the oldest slot).
slot_rows: Final = f"SELECT count(*) FROM (SELECT FROM {_S}fastjobs_jobs_all WHERE slot = $1 LIMIT $2) AS r"

# slot_lock_timeout: how long the rotation waits for its lock (this
# transaction only). Enqueues never wait behind it (an insert locks only the
# slot it goes to, never the oldest); claims and finishes, which lock every
# slot, wait at most this long, plus the time the lock is held.
slot_lock_timeout: Final = "SELECT set_config('lock_timeout', $1, true)"

# slot_lock: the slot to empty, ACCESS EXCLUSIVE until the rotation commits.
# Granted once the transactions that inserted into it (or hold its rows)
# have ended, so every row committed into it is then visible to slot_move;
# a statement that waited for it runs afterwards on a snapshot that sees the
# rows where slot_move put them (tests/test_rotation.py).
slot_lock: Final = "LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE"

# The columns of a job's row but its slot: the rotation copies rows whole (id,
# state, attempt, attempted_by, errors...), deleted from one slot and
# inserted into another.
_ROW: Final = (
    ("id", "queue", "kind", "args", "priority", "state", "run_at", "attempt", "max_attempts"),
    ("created_at", "attempted_at", "finalized_at", "attempted_by", "errors", "unique_key"),
    ("meta", "crashes", "cancel_requested", "keep_result", "fair_key"),
)


def _row(*, alias: str, spaces: int) -> str:
    """_ROW's columns, of table `alias` if given, laid out to sit `spaces` in."""
    prefix = f"{alias}." if alias else ""
    return (",\n" + " " * spaces).join(", ".join(prefix + column for column in line) for line in _ROW)


def _to_slot_0(*, moved: str, which: str, oldest_first: bool) -> str:
    """Up to $2 rows of slot $1 that `which` chooses (oldest first, or in any order) moved to slot 0
    by row locks; a row another session holds is skipped (slot_move copies it later), and a writer
    that waited for a moved row finds it gone and must look again by id."""
    order = "\n                ORDER BY id" if oldest_first else ""
    return f"""
WITH {moved} AS (
    DELETE FROM {_S}fastjobs_jobs_all j
     WHERE j.slot = $1::smallint AND j.id = ANY(ARRAY(
               SELECT id FROM {_S}fastjobs_jobs_all
                WHERE slot = $1::smallint AND {which}{order}
                LIMIT $2
                  FOR UPDATE SKIP LOCKED))
    RETURNING {_row(alias="j", spaces=14)}
)
INSERT INTO {_S}fastjobs_jobs_all ({_row(alias="", spaces=31)}, slot)
SELECT {_row(alias="", spaces=7)}, 0::smallint
  FROM {moved}"""


# slot_move: the rows slot $1 still holds, copied whole: available and
# running ones into slot $2 (the current one), the rest (scheduled,
# retryable, finished) into slot 0, where the scheduler promotes and the
# cleaner removes them.
slot_move: Final = f"""
INSERT INTO {_S}fastjobs_jobs_all ({_row(alias="", spaces=31)}, slot)
SELECT {_row(alias="", spaces=7)},
       CASE WHEN state IN ('available', 'running') THEN $2::smallint ELSE 0::smallint END
  FROM {_S}fastjobs_jobs_all
 WHERE slot = $1::smallint"""

# slot_settle: up to $2 settled rows (neither available nor running:
# scheduled, retryable, finished) of slot $1 moved to slot 0, before the
# rotation takes its lock: kept completed jobs, a burst of discarded ones or
# a long backoff would otherwise stop the rotation (its slot would hold more
# than max_move rows) or be copied under its lock.
slot_settle: Final = _to_slot_0(
    moved="settled", which="state NOT IN ('available', 'running')", oldest_first=False
)

# slot_evacuate: up to $2 available rows of slot $1 moved to slot 0, oldest
# first, when the slot has held a backlog past the rotation's patience (a
# queue nobody serves): a slot that never empties would stop the rotation of
# every slot. Rows a claim or a fast-lane batch holds are skipped (the claim
# wins them); a writer that waited for a moved row looks again by id
# (fastjobs.control). Slot 0 is vacuumed: the backlog leaves the rotation for good.
slot_evacuate: Final = _to_slot_0(moved="evacuated", which="state = 'available'", oldest_first=True)

# slot_privileges: what the current role lacks to rotate, as GRANT clauses
# (none: it may), and the role. LOCK and TRUNCATE name each rotating slot
# (TRUNCATE on it allows both); setval needs UPDATE on fastjobs_slot; the
# settle and move steps read, delete and insert through fastjobs_jobs_all.
# A role that was granted the tables but does not own them lacks the first
# two (005 copies only fastjobs_jobs's grants, to the parent).
slot_privileges: Final = f"""
SELECT array_agg(p.clause ORDER BY p.n) FILTER (WHERE NOT p.held), current_user::text
  FROM (VALUES
        (1, 'TRUNCATE ON {_S}fastjobs_jobs_1', has_table_privilege('{_S}fastjobs_jobs_1', 'TRUNCATE')),
        (2, 'TRUNCATE ON {_S}fastjobs_jobs_2', has_table_privilege('{_S}fastjobs_jobs_2', 'TRUNCATE')),
        (3, 'TRUNCATE ON {_S}fastjobs_jobs_3', has_table_privilege('{_S}fastjobs_jobs_3', 'TRUNCATE')),
        (4, 'TRUNCATE ON {_S}fastjobs_jobs_4', has_table_privilege('{_S}fastjobs_jobs_4', 'TRUNCATE')),
        (5, 'UPDATE ON SEQUENCE {_S}fastjobs_slot', has_sequence_privilege('{_S}fastjobs_slot', 'UPDATE')),
        (6, 'SELECT ON {_S}fastjobs_jobs_all', has_table_privilege('{_S}fastjobs_jobs_all', 'SELECT')),
        (7, 'INSERT ON {_S}fastjobs_jobs_all', has_table_privilege('{_S}fastjobs_jobs_all', 'INSERT')),
        (8, 'DELETE ON {_S}fastjobs_jobs_all', has_table_privilege('{_S}fastjobs_jobs_all', 'DELETE')))
       AS p(n, clause, held)"""

# slot_truncate: empty the slot: its storage is freed at commit, whatever snapshot is open.
slot_truncate: Final = "TRUNCATE {partition}"

# slot_advance: inserts go to slot $1 from now on (seen by every session at once, without a commit).
slot_advance: Final = f"SELECT setval('{_S}fastjobs_slot', $1)"


_section("Monitoring")

# mvcc_horizon: the oldest snapshot of this database holding back cleanup
# (VACUUM cannot remove a dead row any snapshot may still see): a backend's
# transaction, a prepared transaction, or a replication slot. Vacuums
# themselves are left out (PostgreSQL ignores their snapshots when it
# computes the horizon), and so is this session.
# Backends of other users show no xmin to a role without pg_read_all_stats.
# The query's runs of whitespace become one space: its detail is one line.
mvcc_horizon: Final = """
SELECT source, ident, seconds, xid_age, detail FROM (
  SELECT 'backend' AS source, pid::text AS ident,
         extract(epoch FROM clock_timestamp() - coalesce(xact_start, query_start))::float8 AS seconds,
         age(coalesce(backend_xmin, backend_xid))::int8 AS xid_age,
         concat_ws(', ', nullif(application_name, ''), state,
                   left(regexp_replace(query, '[[:space:]]+', ' ', 'g'), 100)) AS detail
    FROM pg_stat_activity
   WHERE pid <> pg_backend_pid() AND coalesce(backend_xmin, backend_xid) IS NOT NULL
     AND backend_type <> 'autovacuum worker' AND query NOT ILIKE 'vacuum%'
     AND (datname = current_database() OR datname IS NULL)
  UNION ALL
  SELECT 'prepared transaction', gid, extract(epoch FROM clock_timestamp() - prepared)::float8,
         age(transaction)::int8, owner::text
    FROM pg_prepared_xacts
   WHERE database = current_database()
  UNION ALL
  SELECT 'replication slot', slot_name::text, NULL, age(xmin)::int8, slot_type
    FROM pg_replication_slots
   WHERE xmin IS NOT NULL
) holders
 ORDER BY xid_age DESC NULLS LAST, seconds DESC NULLS LAST
 LIMIT 1"""

# mvcc_tables: size, live and dead rows, and vacuums of fastjobs's tables
# (the statistics collector's estimates, as autovacuum sees them).
mvcc_tables: Final = f"""
SELECT relname::text, n_live_tup, n_dead_tup, pg_table_size(relid), pg_indexes_size(relid),
       extract(epoch FROM last_autovacuum)::float8, extract(epoch FROM last_vacuum)::float8,
       autovacuum_count, extract(epoch FROM last_autoanalyze)::float8
  FROM pg_stat_user_tables
 WHERE schemaname = {_SCHEMA_NAME} AND relname LIKE 'fastjobs\\_%'
 ORDER BY relname"""

# database_identity: which database this is, nothing secret: the cluster's
# system identifier and the database's name. A master records it in its
# shared-memory file so `fastjobs stats` shows only the masters of its own
# database, however each spelled its DSN; and of its own schema, whose name a
# schema's identity ends with (as its channels do).
database_identity: Final = (
    f"SELECT system_identifier::text || '/' || current_database(){_IDENTITY} FROM pg_control_system()"
)

# metrics_session: the metrics process's connection gives up on a lock and
# on any statement after $1 and $2 (a scrape then answers without the
# database's part, and no backend is left waiting behind a lock).
metrics_session: Final = (
    "SELECT set_config('lock_timeout', $1, false), set_config('statement_timeout', $2, false)"
)

# notify_queue_usage: the fraction of the server's NOTIFY queue in use. It
# grows when a listening session sits in a long transaction; at 100% every
# NOTIFY (so every enqueue) fails.
notify_queue_usage: Final = "SELECT pg_notification_queue_usage()"


_section("Dashboard")

# The dashboard (fastjobs.web) reads the jobs table without scanning it
# whole: a page answers in well under 200 ms with 10 million jobs
# (bench/web_pages.py). Where an exact figure would scan, it shows an
# estimate and says so.

# sample_write: the leader's sample at $1 (fastjobs.samples): per queue ($2),
# the outcomes the workers' heartbeats have counted so far, completed ($3) and
# failed ($4: retried or discarded), summed over every registered worker.
sample_write: Final = f"""
INSERT INTO {_S}fastjobs_samples (at, queue, completed, failed)
SELECT $1, s.queue, s.completed, s.failed
  FROM unnest($2::text[], $3::int8[], $4::int8[]) AS s(queue, completed, failed)
ON CONFLICT (at, queue) DO NOTHING"""

# sample_prune: the samples taken before $1.
sample_prune: Final = f"DELETE FROM {_S}fastjobs_samples WHERE at < $1"

# sample_list: the samples taken since $1, by queue and time, for the overview's charts.
sample_list: Final = f"""
SELECT at, queue, completed, failed FROM {_S}fastjobs_samples WHERE at >= $1 ORDER BY queue, at"""

# jobs_estimate: the rows of the jobs table's partitions and of the kept
# results, as the statistics collector counts them (inserts and deletes as
# they happen, no scan): whether the overview counts exactly or estimates.
jobs_estimate: Final = f"""
SELECT coalesce(sum(n_live_tup) FILTER (WHERE relid <> '{_S}fastjobs_results'::regclass), 0)::int8,
       coalesce(sum(n_live_tup) FILTER (WHERE relid = '{_S}fastjobs_results'::regclass), 0)::int8
  FROM pg_stat_user_tables
 WHERE relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = '{_S}fastjobs_jobs_all'::regclass)
    OR relid = '{_S}fastjobs_results'::regclass"""


# The states the bounded count takes together: those one partial index holds
# (migrations/001 and 002: the claim, running, due and finalized indexes), so
# each group is read from its index and never by a scan of other states' rows.
DEPTH_GROUPS: Final = (
    ("available",),
    ("running",),
    ("scheduled", "retryable"),
    ("completed", "cancelled", "discarded"),
)


def _bounded_depth(states: tuple[str, ...]) -> str:
    """Per state and queue, the jobs of `states` (a group of DEPTH_GROUPS) among the first $1 of the
    group found, and the oldest of them (its time as job_stats_by_queue ages it). The states are
    literals, their index's own predicate: a parameter would leave a generic plan scanning every row."""
    listed = ", ".join(f"'{state}'" for state in states)
    return f"""SELECT state::text AS state, queue, count(*)::int8 AS count,
       min(CASE state WHEN 'available' THEN run_at WHEN 'running' THEN attempted_at ELSE created_at END)
         AS oldest
  FROM (SELECT state, queue, run_at, attempted_at, created_at
          FROM {_S}fastjobs_jobs_all WHERE state IN ({listed}) LIMIT $1) AS found
 GROUP BY state, queue"""


# depth_by_index: for the rest of the transaction, the planner reads jobs_depth_bounded's groups from
# their indexes. Its estimates assume a group's rows are spread over the table; they are where its
# jobs' time put them (a backlog after a million completed rows), which a scan for the first $1
# of them reads through, and a bitmap scan reads the whole index first: measured 200-400 ms on 2
# million jobs, against 5 ms by index scans.
depth_by_index: Final = """
SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true)"""

# jobs_depth_bounded: per state and queue, the jobs counted up to $1 per group
# of DEPTH_GROUPS (a group with fewer is counted exactly; one with more is
# estimated from jobs_depth_sampled), and their oldest age in seconds. A job
# in flight on the fast lane (under 0.1 s) counts as available here.
jobs_depth_bounded: Final = f"""
SELECT state, queue, count, CASE WHEN isfinite(oldest) THEN extract(epoch FROM now() - oldest)::float8 END
  FROM ({_bounded_depth(DEPTH_GROUPS[0])}
        UNION ALL
        {_bounded_depth(DEPTH_GROUPS[1])}
        UNION ALL
        {_bounded_depth(DEPTH_GROUPS[2])}
        UNION ALL
        {_bounded_depth(DEPTH_GROUPS[3])}) AS depths
 ORDER BY queue, state"""

# jobs_depth_sampled: per queue and state, the jobs of a sample of $1 percent
# of the jobs table's pages (TABLESAMPLE SYSTEM), and the oldest age among
# them: the estimate of the states with more jobs than jobs_depth_bounded counts.
jobs_depth_sampled: Final = f"""
SELECT queue, state::text, count(*)::int8,
       extract(epoch FROM now() - min(CASE state WHEN 'available' THEN run_at
                                                 WHEN 'running' THEN attempted_at
                                                 ELSE created_at END))::float8
  FROM {_S}fastjobs_jobs_all TABLESAMPLE SYSTEM ($1::float4)
 GROUP BY queue, state"""

# job_page: a page of the jobs list. The newest $2 jobs below id $1 are read
# (the primary keys, newest first: a window, so that no filter makes a page
# scan the table), and of them up to $7 that match queue $3, state $4 (as
# reported: a job in flight on the fast lane is running), kind $5 and args
# containing $6 (jsonb @>; NULL: any) are returned, newest first, each with
# the lowest id and the count the window read. No match: one row of NULLs
# but those two. The next page starts below the last job shown, or below
# the window when it was read through.
job_page: Final = f"""
WITH recent AS (
    SELECT id, queue, kind, args, priority, attempt, max_attempts, run_at, created_at,
           {_reported_state(11)} AS state
      FROM {_S}fastjobs_jobs_all
     WHERE id < $1
     ORDER BY id DESC
     LIMIT $2
), read AS (
    SELECT min(id) AS low, count(*) AS n FROM recent
)
SELECT m.id, m.queue, m.kind, m.state, m.priority, m.attempt, m.max_attempts, m.run_at, m.created_at,
       left(m.args::text, 200) AS args, read.low, read.n
  FROM read
  LEFT JOIN LATERAL (
      SELECT * FROM recent
       WHERE ($3::text IS NULL OR queue = $3) AND ($4::text IS NULL OR state = $4)
         AND ($5::text IS NULL OR kind = $5) AND ($6::jsonb IS NULL OR args @> $6::jsonb)
       ORDER BY id DESC
       LIMIT $7
  ) AS m ON true
 ORDER BY m.id DESC"""

# result_list: the newest kept results (fastjobs_results), up to $1, for the engine page.
result_list: Final = f"""
SELECT id, queue, kind, state::text AS state, finalized_at, expires_at
  FROM {_S}fastjobs_results
 ORDER BY id DESC
 LIMIT $1"""

_section("Testing kit")

# The testing kit's (fastjobs.testing): its drain claims and completes through
# the hot loop's own statements; these only pick what it drains and move its clock.

# testing_shift_due: the drain's clock moved forward to the next pending job of
# the queues $2 (NULL: all) if it is due by $1: the pending jobs due by $1 have
# their run_at moved back by (its run_at - now()), all by the same amount, so
# the real claim and scheduler find it due, the others in the order they would
# have run. Returns that amount, in seconds (NULL: nothing moved), which the
# drain takes off $1: a job the drain runs and snoozes (or retries) for d is
# due again d after the time it ran, not d after the real now, so it runs
# again only if that is by $1 (as it would have, one step at a time).
testing_shift_due: Final = f"""
WITH next AS (
  SELECT min(run_at) AS at FROM {_S}fastjobs_jobs_all
   WHERE state IN ('available', 'scheduled', 'retryable')
     AND ($2::text[] IS NULL OR queue = ANY($2::text[]))
), moved AS (
  UPDATE {_S}fastjobs_jobs_all j SET run_at = j.run_at - (next.at - now())
    FROM next
   WHERE next.at > now() AND next.at <= $1::timestamptz
     AND j.state IN ('available', 'scheduled', 'retryable') AND j.run_at <= $1::timestamptz
     AND ($2::text[] IS NULL OR j.queue = ANY($2::text[]))
  RETURNING 1
)
SELECT CASE WHEN next.at > now() AND next.at <= $1::timestamptz
            THEN extract(epoch FROM next.at - now())::float8 END
  FROM next"""

# testing_queues_due: the queues among $1 (NULL: all) with a job available now.
testing_queues_due: Final = f"""
SELECT DISTINCT queue FROM {_S}fastjobs_jobs_all
 WHERE state = 'available' AND run_at <= now() AND ($1::text[] IS NULL OR queue = ANY($1::text[]))
 ORDER BY queue"""

# testing_notify_commit: the inline kit's own wake-up in the caller's
# transaction, heard by that session at its commit (the insert trigger
# notifies only while a worker sleeps).
testing_notify_commit: Final = f"NOTIFY {_channel(NOTIFY_CHANNEL)}"

# testing_args_round_trip: job args as a worker reads them back (jsonb
# normalises numbers: the float 1e16 comes back as the integer 10000000000000000).
testing_args_round_trip: Final = "SELECT $1::jsonb::text"


# Registry ------------------------------------------------------------------

# Statements that PREPARE cannot take (COPY); the test of every statement skips them.
NOT_PREPARABLE: Final = frozenset(
    {
        "vacuum_jobs",
        "slot_lock",
        "slot_truncate",
        "fast_begin",
        "fast_commit",
        "fast_rollback",
        "job_copy",
        "job_copy_at",
        "job_copy_fair",
        "job_copy_at_fair",
        "job_copy_staged",
        "job_stage_create",
        "migration_table_create",
        "schema_create",
        "migration_index_drop",
        "listen_jobs",
        "listen_ping",
        "listen_cancel",
        "listen_result",
        "unlisten_result",
        "testing_notify_commit",
    }
)

# Every statement above, by its name, in the order written: the name it is
# prepared as and its test id (tests/test_sql.py prepares each).
STATEMENTS: Final[Mapping[str, str]] = MappingProxyType(
    {name: value for name, value in globals().items() if name[:1].islower() and isinstance(value, str)}
)


def _sections() -> dict[str, tuple[str, ...]]:
    names = list(globals())
    ends = [start for _, start in _SECTION_STARTS[1:]] + [len(names)]
    return {
        title: tuple(name for name in names[start:end] if name in STATEMENTS)
        for (title, start), end in zip(_SECTION_STARTS, ends, strict=True)
    }


# The statements of each section, as the contents at the top lists them.
SECTIONS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(_sections())

# The hot loop's statement by (keep completed jobs, claim after the mark): the
# name it is prepared as, and its text.
FINISH: Final[Mapping[tuple[bool, bool], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_finish_claim_many", job_finish_claim_many),
        (False, True): ("job_finish_claim_after", job_finish_claim_after),
        (True, False): ("job_finish_claim_many_keep", job_finish_claim_many_keep),
        (True, True): ("job_finish_claim_after_keep", job_finish_claim_after_keep),
    }
)

# The same for a batch whose outcomes are all completions at a first attempt: the
# job_complete_claim_ variants; and IN_SLOT (2) for where the claim starts: after the mark, in slot 0
# and the current rotating slot alone (_IN_SLOT).
IN_SLOT: Final = 2
COMPLETE: Final[Mapping[tuple[bool, int], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_complete_claim_many", job_complete_claim_many),
        (False, True): ("job_complete_claim_after", job_complete_claim_after),
        (False, IN_SLOT): ("job_complete_claim_in_slot", job_complete_claim_in_slot),
        (True, False): ("job_complete_claim_many_keep", job_complete_claim_many_keep),
        (True, True): ("job_complete_claim_after_keep", job_complete_claim_after_keep),
        (True, IN_SLOT): ("job_complete_claim_in_slot_keep", job_complete_claim_in_slot_keep),
    }
)

# The same with nothing to finish (kept or not: none is): the job_claim_only_ variants.
CLAIM_ONLY: Final[Mapping[tuple[bool, int], tuple[str, str]]] = MappingProxyType(
    {(keep, False): ("job_claim_only_many", job_claim_only_many) for keep in (False, True)}
    | {(keep, True): ("job_claim_only_after", job_claim_only_after) for keep in (False, True)}
    | {(keep, IN_SLOT): ("job_claim_only_in_slot", job_claim_only_in_slot) for keep in (False, True)}
)

# The same for the outcomes of a batch that held a job with keep_result: the _results variants.
FINISH_RESULTS: Final[Mapping[tuple[bool, bool], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_finish_claim_many_results", job_finish_claim_many_results),
        (False, True): ("job_finish_claim_after_results", job_finish_claim_after_results),
        (True, False): ("job_finish_claim_many_keep_results", job_finish_claim_many_keep_results),
        (True, True): ("job_finish_claim_after_keep_results", job_finish_claim_after_keep_results),
    }
)

# The same, for a worker whose app has middleware: the _context variants.
FINISH_CONTEXT: Final[Mapping[tuple[bool, bool], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_finish_claim_many_context", job_finish_claim_many_context),
        (False, True): ("job_finish_claim_after_context", job_finish_claim_after_context),
        (True, False): ("job_finish_claim_many_keep_context", job_finish_claim_many_keep_context),
        (True, True): ("job_finish_claim_after_keep_context", job_finish_claim_after_keep_context),
    }
)

# And their job_complete_claim_ variants.
COMPLETE_CONTEXT: Final[Mapping[tuple[bool, int], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_complete_claim_many_context", job_complete_claim_many_context),
        (False, True): ("job_complete_claim_after_context", job_complete_claim_after_context),
        (False, IN_SLOT): ("job_complete_claim_in_slot_context", job_complete_claim_in_slot_context),
        (True, False): ("job_complete_claim_many_keep_context", job_complete_claim_many_keep_context),
        (True, True): ("job_complete_claim_after_keep_context", job_complete_claim_after_keep_context),
        (True, IN_SLOT): ("job_complete_claim_in_slot_keep_context", job_complete_claim_in_slot_keep_context),
    }
)

# And their job_claim_only_ variants.
CLAIM_ONLY_CONTEXT: Final[Mapping[tuple[bool, int], tuple[str, str]]] = MappingProxyType(
    {(keep, False): ("job_claim_only_many_context", job_claim_only_many_context) for keep in (False, True)}
    | {(keep, True): ("job_claim_only_after_context", job_claim_only_after_context) for keep in (False, True)}
    | {
        (keep, IN_SLOT): ("job_claim_only_in_slot_context", job_claim_only_in_slot_context)
        for keep in (False, True)
    }
)

# And their _results variants.
FINISH_CONTEXT_RESULTS: Final[Mapping[tuple[bool, bool], tuple[str, str]]] = MappingProxyType(
    {
        (False, False): ("job_finish_claim_many_context_results", job_finish_claim_many_context_results),
        (False, True): ("job_finish_claim_after_context_results", job_finish_claim_after_context_results),
        (True, False): (
            "job_finish_claim_many_keep_context_results",
            job_finish_claim_many_keep_context_results,
        ),
        (True, True): (
            "job_finish_claim_after_keep_context_results",
            job_finish_claim_after_keep_context_results,
        ),
    }
)

# The fast lane's claim by (full context: the app has middleware, claim after the mark, keyed
# jobs too: planner.takes_keys): its name and text.
LOCK: Final[Mapping[tuple[bool, bool, bool], tuple[str, str]]] = MappingProxyType(
    {
        (False, False, False): ("job_lock_many", job_lock_many),
        (False, True, False): ("job_lock_after", job_lock_after),
        (True, False, False): ("job_lock_many_context", job_lock_many_context),
        (True, True, False): ("job_lock_after_context", job_lock_after_context),
        (False, False, True): ("job_lock_keyed_many", job_lock_keyed_many),
        (False, True, True): ("job_lock_keyed_after", job_lock_keyed_after),
        (True, False, True): ("job_lock_keyed_many_context", job_lock_keyed_many_context),
        (True, True, True): ("job_lock_keyed_after_context", job_lock_keyed_after_context),
    }
)

# The statements, and the names the code reads besides them.
__all__ = [
    *STATEMENTS,
    "ATTEMPT_CAP",
    "CANCEL_CHANNEL",
    "CHANNELS",
    "CLAIM_MARK_MARGIN",
    "DEPTH_GROUPS",
    "CLAIM_ONLY",
    "CLAIM_ONLY_CONTEXT",
    "COMPLETE",
    "COMPLETE_CONTEXT",
    "FINISH",
    "FINISH_CONTEXT",
    "FINISH_CONTEXT_RESULTS",
    "FINISH_RESULTS",
    "IN_SLOT",
    "KEY_FRONT",
    "LEADER_LOCK_KEY",
    "LOCK",
    "MIGRATION_LOCK_KEY",
    "NOTIFY_CHANNEL",
    "NOT_PREPARABLE",
    "PING_CHANNEL",
    "RESULT_CHANNEL",
    "RESULT_PAYLOAD_MAX",
    "SCHEMA",
    "SCHEMA_MAX",
    "SECTIONS",
    "STATEMENTS",
    "UNIQUE_STATES",
    "of",
    "relation",
    "schema_name",
]
