"""The benchmark's own SQL: the raw-SQL limit and its bookkeeping, named as in fastjobs.sql."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

# bench_available_count: progress of a benchmark drain (reads only the claim index).
bench_available_count: Final = "SELECT count(*) FROM fastjobs_jobs_all WHERE state = 'available'"

# bench_seed_finished: $1 completed jobs finalized two days ago, for the cleaner benchmark.
bench_seed_finished: Final = """
INSERT INTO fastjobs_jobs (kind, args, state, attempt, created_at, attempted_at, finalized_at)
SELECT 'fastjobs.bench.old', jsonb_build_object('i', i), 'completed', 1,
       now() - interval '2 days', now() - interval '2 days', now() - interval '2 days'
  FROM generate_series(1, $1::int) AS i"""

# bench_raw_complete: the raw-SQL limit's completion, DELETE by id array.
bench_raw_complete: Final = "DELETE FROM fastjobs_jobs_all WHERE id = ANY($1::bigint[])"

# bench_raw_complete_keep: the raw-SQL limit's completion when completed jobs are kept.
bench_raw_complete_keep: Final = (
    "UPDATE fastjobs_jobs_all SET state = 'completed', finalized_at = now() WHERE id = ANY($1::bigint[])"
)

# bench_plain_create: the producers benchmark's limit, a table like fastjobs_jobs
# (columns, defaults, identity, indexes, checks, storage) without its trigger.
bench_plain_create: Final = """
CREATE TABLE IF NOT EXISTS fastjobs_bench_plain (LIKE fastjobs_jobs INCLUDING ALL)"""

# bench_plain_reset: empty that table between runs.
bench_plain_reset: Final = "TRUNCATE fastjobs_bench_plain RESTART IDENTITY"

# bench_plain_insert: the limit, one job into the table without trigger: the
# statement app.enqueue sends (sql.job_insert_now, less its meta, NULL for a
# job without), without fastjobs around it.
bench_plain_insert: Final = """
INSERT INTO fastjobs_bench_plain (queue, kind, args, priority, max_attempts)
VALUES ($1, $2, $3::jsonb, $4, $5)
RETURNING id"""

# bench_trigger_insert: the same INSERT into fastjobs_jobs_all, as sql.job_insert_now (less
# its meta): its trigger and the routing to the current rotating slot included.
bench_trigger_insert: Final = """
INSERT INTO fastjobs_jobs_all (queue, kind, args, priority, max_attempts)
VALUES ($1, $2, $3::jsonb, $4, $5)
RETURNING id"""


# Statements PREPARE cannot take: tests/test_sql.py runs them instead.
NOT_PREPARABLE: Final = frozenset(
    {"bench_plain_create", "bench_plain_reset", "bench_rows_create", "bench_rows_reset"}
)


# bench_rows_create: the table the latency run's handlers write to with --latency-write.
bench_rows_create: Final = """
CREATE TABLE IF NOT EXISTS fastjobs_bench_rows (
    job_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT now()
)"""

# bench_rows_reset: empty that table before a latency run.
bench_rows_reset: Final = "TRUNCATE fastjobs_bench_rows"

# bench_row: a latency handler's write, one row for its job $1 (an application job's own write).
bench_row: Final = "INSERT INTO fastjobs_bench_rows (job_id) VALUES ($1)"

# Every statement of this module, by name (as fastjobs.sql.STATEMENTS).
STATEMENTS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "bench_available_count": bench_available_count,
        "bench_seed_finished": bench_seed_finished,
        "bench_raw_complete": bench_raw_complete,
        "bench_raw_complete_keep": bench_raw_complete_keep,
        "bench_plain_create": bench_plain_create,
        "bench_plain_reset": bench_plain_reset,
        "bench_plain_insert": bench_plain_insert,
        "bench_trigger_insert": bench_trigger_insert,
        "bench_rows_create": bench_rows_create,
        "bench_rows_reset": bench_rows_reset,
        "bench_row": bench_row,
    }
)
