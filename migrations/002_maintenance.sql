-- 002_maintenance: what the leader's services and unique jobs need.
--
-- Safe on a live system, and the same schema as when it was one transaction:
-- the columns and the table first, in one short transaction (a column with a
-- constant default is added without touching a row, so the ACCESS EXCLUSIVE
-- lock on fastjobs_jobs lasts milliseconds, under lock_timeout), then each
-- index built CONCURRENTLY while writes go on. Every step is idempotent: a run
-- interrupted between steps is completed by the next.

-- Times a job was running on a worker that died: kept apart from ordinary
-- failures so a job that kills its worker is quarantined, not retried forever.
-- Cancellation of a running job is a request its worker acts on.
-- (Tested first, not IF NOT EXISTS alone: once 005 has made fastjobs_jobs a
-- partition, ALTER TABLE ... ADD COLUMN on it fails even when the column
-- exists, and `fastjobs migrate --sql` output must run again harmlessly.)
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = 'fastjobs_jobs'::regclass AND attname = 'cancel_requested') THEN
        ALTER TABLE fastjobs_jobs ADD COLUMN IF NOT EXISTS crashes smallint NOT NULL DEFAULT 0;
        ALTER TABLE fastjobs_jobs ADD COLUMN IF NOT EXISTS cancel_requested boolean NOT NULL DEFAULT false;
    END IF;
END
$$;

-- The last tick each periodic job was enqueued for: the leader advances it in
-- the same transaction as the enqueue, so a tick is enqueued once across
-- leader changes.
CREATE TABLE IF NOT EXISTS fastjobs_periodic (
    kind       text        PRIMARY KEY,
    last_tick  timestamptz NOT NULL
);

-- fastjobs: concurrently
-- At most one pending or running job per unique key; finished ones free the key.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_unique_idx
    ON fastjobs_jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('available', 'scheduled', 'running', 'retryable');

-- fastjobs: concurrently
-- What the cleaner removes, oldest first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_finalized_idx
    ON fastjobs_jobs (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');
