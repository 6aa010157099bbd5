-- 007_queues: per-queue state an operator sets at run time.
--
-- A paused queue (paused_at set) keeps its jobs and takes enqueues; no claim
-- takes its jobs (sql._Choice.where) until it is resumed. A queue needs a
-- row only once an operator acted on it: a queue without one runs.
--
-- Live: a new table, no lock on the jobs table.

CREATE TABLE IF NOT EXISTS fastjobs_queues (
    name       text        PRIMARY KEY,
    paused_at  timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);
