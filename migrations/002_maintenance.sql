-- 002_maintenance: what the leader's services and unique jobs need.

-- Times a job was running on a worker that died: kept apart from ordinary
-- failures so a job that kills its worker is quarantined, not retried forever.
ALTER TABLE fastjobs_jobs ADD COLUMN crashes smallint NOT NULL DEFAULT 0;

-- Cancellation of a running job is a request its worker acts on.
ALTER TABLE fastjobs_jobs ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false;

-- At most one pending or running job per unique key; finished ones free the key.
CREATE UNIQUE INDEX fastjobs_jobs_unique_idx
    ON fastjobs_jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('available', 'scheduled', 'running', 'retryable');

-- What the cleaner removes, oldest first.
CREATE INDEX fastjobs_jobs_finalized_idx
    ON fastjobs_jobs (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');

-- The last tick each periodic job was enqueued for: the leader advances it in
-- the same transaction as the enqueue, so a tick is enqueued once across
-- leader changes.
CREATE TABLE fastjobs_periodic (
    kind       text        PRIMARY KEY,
    last_tick  timestamptz NOT NULL
);
