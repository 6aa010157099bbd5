-- 007_queues: per-queue state and limits an operator sets at run time.
--
-- A paused queue (paused_at set) keeps its jobs and takes enqueues; no claim
-- takes its jobs (sql._Choice.where) until it is resumed. A queue with
-- concurrency N never has more than N jobs running, cluster-wide: its
-- claims take the state lane only and ask fastjobs_room how many more may
-- start. A queue with a rate limit (rate_limit as given, "200/s"; rate in
-- jobs per second) starts at most that many jobs per second, cluster-wide:
-- the same claims take tokens from its bucket (tokens, refilled at rate since
-- refilled_at, holding at most one second's worth). A queue with max_backlog refuses enqueues (QueueFull, or the
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
    rate_limit  text,
    rate        double precision CHECK (rate > 0),
    tokens      double precision NOT NULL DEFAULT 0,
    refilled_at timestamptz NOT NULL DEFAULT now(),
    max_backlog bigint      CHECK (max_backlog > 0),
    backlog     bigint,
    backlog_at  timestamptz,
    held_back   bigint      NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- How many of `asked` jobs a claim of queue q may take: all of them when the
-- queue has no limit; with a concurrency limit, at most the limit less the
-- jobs of it running; with a rate limit, at most the whole tokens in its
-- bucket, which the claim takes (all it may take, found or not: a limit is
-- never exceeded, and a queue it binds has a backlog, whose claims find
-- what they ask). The queue's row stays locked until the claim's transaction ends,
-- so claims of one limited queue take turns; VOLATILE, the count runs on a
-- snapshot taken after that lock, so it sees every claim committed before.
-- A finish statement that claims passes its worker and the outcomes it
-- writes (its completed ids, its outcome records): the count cannot see
-- that statement's own writes, and leaves those jobs out. Its names are
-- those of the schema it is created in (search_path FROM CURRENT: the
-- migration's), not of its caller's search_path, which in a database of two
-- fastjobs schemas (App(schema=...)) may find the other's tables.
CREATE OR REPLACE FUNCTION fastjobs_room(
    q text, asked bigint, worker text DEFAULT NULL, done bigint[] DEFAULT '{}', outcomes jsonb DEFAULT '[]'
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
DECLARE
    limits fastjobs_queues%ROWTYPE;
    room bigint := asked;
    running bigint;
    at timestamptz := clock_timestamp();
    bucket double precision;
BEGIN
    SELECT * INTO limits FROM fastjobs_queues WHERE name = q FOR UPDATE;
    IF limits.concurrency IS NOT NULL THEN
        SELECT count(*) INTO running
          FROM fastjobs_jobs_all j
         WHERE j.queue = q AND j.state = 'running'
           AND NOT (j.attempted_by = worker
                    AND (j.id = ANY(done) OR j.id IN (SELECT (o->>'id')::bigint FROM jsonb_array_elements(outcomes) o)));
        room := greatest(0, least(room, limits.concurrency - running));
    END IF;
    IF limits.rate IS NOT NULL THEN
        bucket := least(greatest(limits.rate, 1),
                        limits.tokens + limits.rate * greatest(0, extract(epoch FROM at - limits.refilled_at)));
        room := least(room, floor(bucket)::bigint);
        UPDATE fastjobs_queues SET tokens = bucket - room, refilled_at = at WHERE name = q;
    END IF;
    RETURN room;
END
$$;
