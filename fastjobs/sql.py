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

# schema_version: the newest applied migration, or NULL when there is no schema.
schema_version: Final = """
SELECT CASE WHEN to_regclass('fastjobs_migrations') IS NULL THEN NULL
            ELSE (SELECT max(version) FROM fastjobs_migrations) END"""

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
job_copy: Final = (
    "COPY fastjobs_jobs (queue, kind, args, priority, max_attempts) FROM STDIN (FORMAT BINARY)"
)

# job_copy_at: bulk insert of jobs that all share one run_at (and state).
job_copy_at: Final = (
    "COPY fastjobs_jobs (queue, kind, args, priority, max_attempts, state, run_at)"
    " FROM STDIN (FORMAT BINARY)"
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

# job_get: one job's row, for inspection and tests.
job_get: Final = """
SELECT id, queue, kind, args, priority, state, run_at, attempt, max_attempts,
       created_at, attempted_at, finalized_at, attempted_by, errors, unique_key, meta
  FROM fastjobs_jobs WHERE id = $1"""

# Statements that PREPARE cannot take (COPY); the test of every statement skips them.
NOT_PREPARABLE: Final = frozenset({"job_copy", "job_copy_at", "migration_table_create"})


def statements() -> dict[str, str]:
    """Every named statement of this module, by name."""
    return {
        name: value
        for name, value in globals().items()
        if name[0].islower() and isinstance(value, str) and name not in {"annotations"}
    }
