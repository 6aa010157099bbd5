-- 006_results: job results kept apart from the jobs table.
--
-- A job enqueued with keep_result (seconds) keeps its handler's return value,
-- or the state and errors it was discarded or cancelled with, in
-- fastjobs_results until expires_at; the leader's cleaner removes expired
-- rows in batches. The jobs table still deletes a completed job at once: its
-- row is copied into fastjobs_results by the statement that writes the
-- outcome, so a job that keeps nothing writes nothing more.
--
-- Live: the column is added to the partitioned parent, nullable without a
-- default (a catalogue change, no row touched), under ACCESS EXCLUSIVE for
-- milliseconds.

ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS keep_result integer;

-- A finished job's outcome as it was written; the columns are the jobs
-- table's (for `fastjobs jobs show` and App.status), plus the value and the expiry.
CREATE TABLE IF NOT EXISTS fastjobs_results (
    id           bigint         PRIMARY KEY,
    queue        text           NOT NULL,
    kind         text           NOT NULL,
    args         jsonb          NOT NULL,
    priority     smallint       NOT NULL,
    state        fastjobs_state NOT NULL,
    value        jsonb,
    errors       jsonb,
    attempt      smallint       NOT NULL,
    max_attempts smallint       NOT NULL,
    created_at   timestamptz    NOT NULL,
    attempted_at timestamptz,
    finalized_at timestamptz    NOT NULL,
    expires_at   timestamptz    NOT NULL
);

-- The cleaner takes the oldest expiries first.
CREATE INDEX IF NOT EXISTS fastjobs_results_expires ON fastjobs_results (expires_at);
