-- 007_queues: per-queue state and limits an operator sets at run time.
--
-- A paused queue (paused_at set) keeps its jobs and takes enqueues; no claim
-- takes its jobs (sql._Choice.where) until it is resumed. A queue with
-- max_backlog refuses enqueues (QueueFull, or the producer waits for room)
-- while its backlog, counted by the leader every second into backlog and
-- backlog_at, is at the limit; held_back counts the enqueues it held back. A
-- queue needs a row only once an operator acted on it: a queue without one runs.
--
-- Live: a new table, no lock on the jobs table.

CREATE TABLE IF NOT EXISTS fastjobs_queues (
    name        text        PRIMARY KEY,
    paused_at   timestamptz,
    max_backlog bigint      CHECK (max_backlog > 0),
    backlog     bigint,
    backlog_at  timestamptz,
    held_back   bigint      NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
