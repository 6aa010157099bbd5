-- 001_initial: the jobs table, its claim index, wake-up trigger and the workers table.

CREATE TYPE fastjobs_state AS ENUM (
    'available', 'scheduled', 'running', 'retryable', 'completed', 'discarded', 'cancelled'
);

-- fillfactor leaves room on each page so the claim's and completion's UPDATEs
-- stay HOT (no index writes); aggressive per-table autovacuum keeps dead
-- tuples from piling up under a sustained drain.
CREATE TABLE fastjobs_jobs (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue         text           NOT NULL DEFAULT 'default'
                                 CHECK (queue <> '' AND length(queue) <= 128),
    kind          text           NOT NULL CHECK (kind <> '' AND length(kind) <= 512),
    args          jsonb          NOT NULL DEFAULT '{}',
    priority      smallint       NOT NULL DEFAULT 0,
    state         fastjobs_state NOT NULL DEFAULT 'available',
    run_at        timestamptz    NOT NULL DEFAULT now(),
    attempt       smallint       NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts  smallint       NOT NULL DEFAULT 25 CHECK (max_attempts > 0),
    created_at    timestamptz    NOT NULL DEFAULT now(),
    attempted_at  timestamptz,
    finalized_at  timestamptz,
    attempted_by  text,
    errors        jsonb,
    unique_key    text,
    meta          jsonb
) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 50000,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim reads this index in order: one queue, highest priority first,
-- then FIFO by run_at and id. Only available jobs are in it, so it stays
-- as small as the backlog, whatever the history kept in the table.
CREATE INDEX fastjobs_jobs_claim_idx
    ON fastjobs_jobs (queue, priority DESC, run_at, id)
    WHERE state = 'available';

-- What the scheduler promotes: future and retryable jobs by due time.
CREATE INDEX fastjobs_jobs_due_idx
    ON fastjobs_jobs (run_at)
    WHERE state IN ('scheduled', 'retryable');

-- Rescue and inspection: jobs by state and worker.
CREATE INDEX fastjobs_jobs_running_idx
    ON fastjobs_jobs (attempted_by)
    WHERE state = 'running';

-- One notification per queue per statement, never one per row: NOTIFY takes
-- a global lock at commit, and a bulk COPY of 100,000 rows must not queue
-- 100,000 of them.
CREATE FUNCTION fastjobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('fastjobs', q.queue)
       FROM (SELECT DISTINCT queue FROM inserted WHERE state = 'available') q;
    RETURN NULL;
END
$$;

CREATE TRIGGER fastjobs_jobs_notify
    AFTER INSERT ON fastjobs_jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION fastjobs_notify_inserted();

-- One row per worker process, heartbeated (one write per interval, not per job).
CREATE TABLE fastjobs_workers (
    id            text        PRIMARY KEY,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    queues        text[]      NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);
