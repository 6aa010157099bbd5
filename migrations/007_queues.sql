-- 007_queues: per-queue state and limits an operator sets at run time.
--
-- A paused queue (paused_at set) keeps its jobs and takes enqueues; no claim
-- takes its jobs (sql._Choice.where) until it is resumed. A queue with
-- concurrency N never has more than N jobs running, cluster-wide: its
-- claims take the state lane only and ask fastjobs_room how many more may
-- start. A queue with max_backlog refuses enqueues (QueueFull, or the
-- producer waits for room) while its backlog, counted by the leader every
-- second into backlog and backlog_at, is at the limit; held_back counts the
-- enqueues it held back. A queue needs a row only once an operator acted on
-- it: a queue without one runs, unlimited.
--
-- Live: a new table and function, no lock on the jobs table.

CREATE TABLE IF NOT EXISTS fastjobs_queues (
    name        text        PRIMARY KEY,
    paused_at   timestamptz,
    concurrency integer     CHECK (concurrency > 0),
    max_backlog bigint      CHECK (max_backlog > 0),
    backlog     bigint,
    backlog_at  timestamptz,
    held_back   bigint      NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- How many of `asked` jobs a claim of queue q may take: all of them when the
-- queue has no concurrency limit, else at most its limit less the jobs of it
-- running. The queue's row stays locked until the claim's transaction ends,
-- so claims of one limited queue take turns; VOLATILE, the count runs on a
-- snapshot taken after that lock, so it sees every claim committed before.
-- A finish statement that claims passes its worker and the outcomes it
-- writes (its completed ids, its outcome records): the count cannot see
-- that statement's own writes, and leaves those jobs out.
CREATE OR REPLACE FUNCTION fastjobs_room(
    q text, asked bigint, worker text DEFAULT NULL, done bigint[] DEFAULT '{}', outcomes jsonb DEFAULT '[]'
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    most integer;
    running bigint;
BEGIN
    SELECT concurrency INTO most FROM fastjobs_queues WHERE name = q FOR UPDATE;
    IF most IS NULL THEN
        RETURN asked;
    END IF;
    SELECT count(*) INTO running
      FROM fastjobs_jobs_all
     WHERE queue = q AND state = 'running'
       AND NOT (attempted_by = worker
                AND (id = ANY(done) OR id IN (SELECT (o->>'id')::bigint FROM jsonb_array_elements(outcomes) o)));
    RETURN greatest(0, least(asked, most - running));
END
$$;
