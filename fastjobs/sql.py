"""Every SQL statement fastjobs runs, named, with its purpose.

The constant's name is the prepared statement's name and the test id.
Placeholders are PostgreSQL's own `$n`: the statements run unchanged through
psycopg's RawCursor and through libpq in the Cython hot loop.
"""

from __future__ import annotations

from typing import Final

# Key of the transaction-level advisory lock `fastjobs migrate` holds, so two
# concurrent migrations apply each file once. ("fastjobs" in ASCII, truncated.)
MIGRATION_LOCK_KEY: Final = 0x66_61_73_74_6A_6F_62

# Default key of the session-level advisory lock the leader holds; the
# application can choose another so it cannot collide with its own locks.
LEADER_LOCK_KEY: Final = 0x66_6A_6C_65_61_64  # "fjlead"

# Channel every wake-up is sent on; the payload is the queue name.
NOTIFY_CHANNEL: Final = "fastjobs"

# migration_table_create: the table recording applied migrations.
migration_table_create: Final = """
CREATE TABLE IF NOT EXISTS fastjobs_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""

# migration_lock: serialise migrators until this transaction ends.
migration_lock: Final = "SELECT pg_advisory_xact_lock($1)"

# migration_applied_list: versions already applied.
migration_applied_list: Final = "SELECT version FROM fastjobs_migrations ORDER BY version"

# migration_record: mark one migration applied.
migration_record: Final = "INSERT INTO fastjobs_migrations (version, name) VALUES ($1, $2)"

# schema_exists: whether the migrations table exists (schema_version would fail without it).
schema_exists: Final = "SELECT to_regclass('fastjobs_migrations') IS NOT NULL"

# schema_version: the newest applied migration.
schema_version: Final = "SELECT max(version) FROM fastjobs_migrations"

# job_insert: one job; scheduled when its run_at ($6, or now + $7 seconds) is in the future.
job_insert: Final = """
INSERT INTO fastjobs_jobs (queue, kind, args, priority, max_attempts, state, run_at)
SELECT $1, $2, $3::jsonb, $4, $5,
       CASE WHEN t.run_at > now() THEN 'scheduled' ELSE 'available' END::fastjobs_state,
       t.run_at
  FROM (SELECT coalesce($6::timestamptz,
                        now() + make_interval(secs => coalesce($7::float8, 0)))) AS t(run_at)
RETURNING id"""

# job_copy: bulk insert, binary COPY; rows are encoded by fastjobs._core.encode_copy_rows.
job_copy: Final = "COPY fastjobs_jobs (queue, kind, args, priority, max_attempts) FROM STDIN (FORMAT BINARY)"

# job_copy_at: bulk insert of jobs that all share one run_at (and state).
job_copy_at: Final = (
    "COPY fastjobs_jobs (queue, kind, args, priority, max_attempts, state, run_at) FROM STDIN (FORMAT BINARY)"
)

# job_claim_many: take up to $2 available jobs of queue $1 for worker $3, in
# claim order, skipping rows other workers hold; the attempt is counted here.
job_claim_many: Final = """
UPDATE fastjobs_jobs j
   SET state = 'running', attempt = j.attempt + 1,
       attempted_at = now(), attempted_by = $3
  FROM (SELECT id FROM fastjobs_jobs
         WHERE state = 'available' AND queue = $1 AND run_at <= now()
         ORDER BY priority DESC, run_at, id
         LIMIT $2
           FOR UPDATE SKIP LOCKED) c
 WHERE j.id = c.id
RETURNING j.id, j.kind, j.args, j.attempt, j.max_attempts"""

# The outcomes of a batch ($2, a JSON array written by fastjobs.handlers):
# {id, state, delay (seconds, null keeps run_at), uncount (1 gives the attempt
# back: snoozed and released jobs), error (appended to errors, or null)}.
_FINISH_FAILED = """
    UPDATE fastjobs_jobs j
       SET state = f.state,
           run_at = CASE WHEN f.delay IS NULL THEN j.run_at
                         ELSE now() + make_interval(secs => f.delay) END,
           attempt = j.attempt - f.uncount,
           finalized_at = CASE WHEN f.state IN ('discarded', 'cancelled') THEN now() END,
           errors = CASE WHEN f.error IS NULL THEN j.errors
                         ELSE coalesce(j.errors, '[]'::jsonb) || jsonb_build_array(f.error) END
      FROM jsonb_to_recordset($2::jsonb)
           AS f(id bigint, state fastjobs_state, delay float8, uncount smallint, error jsonb)
     WHERE j.id = f.id AND j.state = 'running'"""

_CLAIM = """
    UPDATE fastjobs_jobs j
       SET state = 'running', attempt = j.attempt + 1,
           attempted_at = now(), attempted_by = $5
      FROM (SELECT id FROM fastjobs_jobs
             WHERE state = 'available' AND queue = $3 AND run_at <= now()
             ORDER BY priority DESC, run_at, id
             LIMIT $4
               FOR UPDATE SKIP LOCKED) c
     WHERE j.id = c.id
    RETURNING j.id, j.kind, j.args, j.attempt, j.max_attempts"""

# job_finish_claim_many: the hot loop's one statement, one round trip per batch.
# Deletes the completed jobs ($1, an int8 array), records the other outcomes
# ($2), and claims up to $4 jobs of queue $3 for worker $5 (LIMIT 0: none).
job_finish_claim_many: Final = f"""
WITH completed AS (
    DELETE FROM fastjobs_jobs WHERE id = ANY($1::bigint[]) AND state = 'running'
), failed AS ({_FINISH_FAILED}
), claimed AS ({_CLAIM}
)
SELECT id, kind, args, attempt, max_attempts FROM claimed"""

# job_finish_claim_many_keep: the same, keeping completed jobs as 'completed'
# rows for the cleaner to remove after the retention period.
job_finish_claim_many_keep: Final = f"""
WITH completed AS (
    UPDATE fastjobs_jobs SET state = 'completed', finalized_at = now()
     WHERE id = ANY($1::bigint[]) AND state = 'running'
), failed AS ({_FINISH_FAILED}
), claimed AS ({_CLAIM}
)
SELECT id, kind, args, attempt, max_attempts FROM claimed"""

# job_schedule_many: scheduled and retryable jobs whose time has come become
# available, at most $1 per statement, oldest first; returns their queues so
# waiting workers can be woken.
job_schedule_many: Final = """
WITH due AS (
    SELECT id FROM fastjobs_jobs
     WHERE state IN ('scheduled', 'retryable') AND run_at <= coalesce($2::timestamptz, now())
     ORDER BY run_at
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE fastjobs_jobs j SET state = 'available' FROM due WHERE j.id = due.id RETURNING j.queue
)
SELECT queue, count(*), pg_notify('fastjobs', queue) FROM promoted GROUP BY queue"""

# leader_try_lock: become the leader if nobody is (session level: released when the session dies).
leader_try_lock: Final = "SELECT pg_try_advisory_lock($1)"

# leader_unlock: step down cleanly.
leader_unlock: Final = "SELECT pg_advisory_unlock($1)"

# worker_register: a worker process announces itself (or re-announces after a reconnect).
worker_register: Final = """
INSERT INTO fastjobs_workers (id, host, pid, queues) VALUES ($1, $2, $3, $4::text[])
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), queues = excluded.queues"""

# worker_heartbeat: one write per interval, never one per job.
worker_heartbeat: Final = "UPDATE fastjobs_workers SET heartbeat_at = now() WHERE id = $1"

# worker_delete: a worker that stops cleanly removes its row.
worker_delete: Final = "DELETE FROM fastjobs_workers WHERE id = $1"

# job_get: one job's row, for inspection and tests.
job_get: Final = """
SELECT id, queue, kind, args, priority, state, run_at, attempt, max_attempts,
       created_at, attempted_at, finalized_at, attempted_by, errors, unique_key, meta
  FROM fastjobs_jobs WHERE id = $1"""

# job_stats_by_queue: depth and oldest age (seconds) per queue and state, for
# `fastjobs stats` and the metrics endpoint. Ages: available since run_at,
# running since attempted_at, the rest since created_at.
job_stats_by_queue: Final = """
SELECT queue, state::text, count(*),
       extract(epoch FROM now() - min(CASE state WHEN 'available' THEN run_at
                                                 WHEN 'running' THEN attempted_at
                                                 ELSE created_at END))::float8
  FROM fastjobs_jobs
 GROUP BY queue, state
 ORDER BY queue, state"""

# bench_available_count: progress of a benchmark drain (reads only the claim index).
bench_available_count: Final = "SELECT count(*) FROM fastjobs_jobs WHERE state = 'available'"

# bench_raw_complete: the raw-SQL limit's completion, DELETE by id array.
bench_raw_complete: Final = "DELETE FROM fastjobs_jobs WHERE id = ANY($1::bigint[])"

# bench_raw_complete_keep: the raw-SQL limit's completion when completed jobs are kept.
bench_raw_complete_keep: Final = (
    "UPDATE fastjobs_jobs SET state = 'completed', finalized_at = now() WHERE id = ANY($1::bigint[])"
)

# Statements that PREPARE cannot take (COPY); the test of every statement skips them.
NOT_PREPARABLE: Final = frozenset({"job_copy", "job_copy_at", "migration_table_create"})


def statements() -> dict[str, str]:
    """Every named statement of this module, by name."""
    return {name: value for name, value in globals().items() if name[0].islower() and isinstance(value, str)}
