-- 010_fair: fair sharing within a queue, round-robin across the jobs' fairness keys.
--
-- A job enqueued with a fairness key (@app.job(fair_key=...), or
-- enqueue(..., fair_key=...)) carries it in fair_key. While a queue has
-- keyed jobs available, its claims take them round-robin across keys
-- (fastjobs_fair) instead of in queue order, so one key's backlog does not
-- hold back another's jobs; a queue without one claims as before
-- (sql._Choice.select).
--
-- Live: the column is added to the partitioned parent, nullable without a
-- default (a catalogue change, no row touched), under ACCESS EXCLUSIVE for
-- milliseconds; the indexes are built CONCURRENTLY, one per partition (a
-- partitioned table cannot build one so), and hold keyed jobs only: a job
-- without a key writes no entry.

ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS fair_key text;

-- A queue that was ever given keyed jobs (a producer marks it at its first:
-- sql.queue_fair). Only a marked queue's claims look for keyed jobs, so a
-- queue never given one pays nothing for fairness.
ALTER TABLE fastjobs_queues ADD COLUMN IF NOT EXISTS fair boolean NOT NULL DEFAULT false;

-- Up to `asked` available jobs of queue q, locked (FOR UPDATE SKIP LOCKED),
-- whole rows, taken round-robin across its members at the highest priority due:
-- each fairness key is a member, and the jobs without one together are one
-- more, first in turn (they are looked for among as many of the first jobs
-- of that priority, in queue order, as a member's share: an index of them
-- would cost every job without a key, keyed queue or not). A claim visits at most 256 members, in turn from where
-- the session's last fair claim of q stopped (a session setting, kept at
-- commit: each worker's connection goes round on its own), and takes an
-- equal share of `asked` from each, then fills what they lacked from the
-- members it visited, in turn. Its cost is bounded by the members it
-- visits (an index descent each on fastjobs_jobs_*_fair_idx), not by how
-- many keys or jobs wait. Its names are those of the schema it is created
-- in, as fastjobs_room's.
CREATE OR REPLACE FUNCTION fastjobs_fair(q text, asked bigint) RETURNS SETOF fastjobs_jobs_all
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT SET enable_sort = off AS $$
DECLARE
    cursor_name text := 'fastjobs.fair_' || md5(current_schema() || '/' || q);
    start text := current_setting(cursor_name, true);  -- NULL: none; '': the keyless; else 'k' || key
    top smallint;
    members text[] := '{}';
    keyless boolean := start IS NULL;
    wrapped boolean := start IS NULL;
    after text := coalesce(substr(start, 2), '');  -- keys are non-empty: '' is before every key
    next_key text;
    last text := CASE WHEN start IS NULL THEN '' END;
    taken bigint[] := '{}';
    share bigint;
    wanted bigint;
BEGIN
    IF asked <= 0 THEN
        RETURN;
    END IF;
    SELECT priority INTO top FROM fastjobs_jobs_all
     WHERE queue = q AND state = 'available' AND run_at <= now()
     ORDER BY priority DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    WHILE cardinality(members) + keyless::int < least(asked, 256) LOOP
        SELECT fair_key INTO next_key FROM fastjobs_jobs_all
         WHERE queue = q AND state = 'available' AND fair_key IS NOT NULL AND priority = top
           AND fair_key > after
         ORDER BY fair_key LIMIT 1;
        IF next_key IS NULL THEN
            EXIT WHEN wrapped;
            wrapped := true;  -- past the last key: the keyless' turn, then the keys from the first
            after := '';
            IF NOT keyless THEN
                keyless := true;
                last := '';
            END IF;
            CONTINUE;
        END IF;
        EXIT WHEN wrapped AND start IS NOT NULL AND next_key > substr(start, 2);
        members := members || next_key;
        after := next_key;
        last := 'k' || next_key;
    END LOOP;
    share := greatest(1, asked / (cardinality(members) + keyless::int));
    IF keyless THEN
        taken := ARRAY(
            SELECT j.id FROM fastjobs_jobs_all j
             WHERE j.id = ANY(ARRAY(
                       SELECT w.id
                         FROM (SELECT id, fair_key FROM fastjobs_jobs_all
                                WHERE queue = q AND state = 'available' AND priority = top AND run_at <= now()
                                ORDER BY run_at, id LIMIT share) w
                        WHERE w.fair_key IS NULL))
               AND j.state = 'available'
               FOR UPDATE SKIP LOCKED);
    END IF;
    wanted := asked - cardinality(taken);
    IF cardinality(members) > wanted THEN  -- the keyless took a share: the rest wait for the next claim
        members := members[1:wanted];
        last := CASE WHEN wanted > 0 THEN 'k' || members[wanted] ELSE '' END;
    END IF;
    IF cardinality(members) > 0 THEN
        share := greatest(1, wanted / cardinality(members));
        taken := taken || ARRAY(
            SELECT j.id FROM unnest(members) m(key) CROSS JOIN LATERAL (
                SELECT id FROM fastjobs_jobs_all
                 WHERE queue = q AND state = 'available' AND fair_key = m.key AND priority = top
                   AND run_at <= now()
                 ORDER BY run_at, id LIMIT share
                   FOR UPDATE SKIP LOCKED) j);
        wanted := asked - cardinality(taken);
        IF wanted > 0 AND share > 1 THEN  -- some had less than their share: the others fill in, in turn
            taken := taken || ARRAY(
                SELECT j.id FROM unnest(members) m(key) CROSS JOIN LATERAL (
                    SELECT id FROM fastjobs_jobs_all
                     WHERE queue = q AND state = 'available' AND fair_key = m.key AND priority = top
                       AND run_at <= now() AND id <> ALL(taken)
                     ORDER BY run_at, id LIMIT wanted
                       FOR UPDATE SKIP LOCKED) j
                 LIMIT wanted);
        END IF;
    END IF;
    IF cardinality(taken) = 0 AND keyless THEN  -- the keyless' turn found none: the next key's instead
        SELECT fair_key INTO next_key FROM fastjobs_jobs_all
         WHERE queue = q AND state = 'available' AND fair_key IS NOT NULL AND priority = top
           AND fair_key > coalesce(members[cardinality(members)], after)
         ORDER BY fair_key LIMIT 1;
        IF next_key IS NULL THEN
            SELECT fair_key INTO next_key FROM fastjobs_jobs_all
             WHERE queue = q AND state = 'available' AND fair_key IS NOT NULL AND priority = top
             ORDER BY fair_key LIMIT 1;
        END IF;
        IF next_key IS NOT NULL THEN
            taken := ARRAY(
                SELECT id FROM fastjobs_jobs_all
                 WHERE queue = q AND state = 'available' AND fair_key = next_key AND priority = top
                   AND run_at <= now()
                 ORDER BY run_at, id LIMIT asked
                   FOR UPDATE SKIP LOCKED);
            last := 'k' || next_key;
        END IF;
    END IF;
    PERFORM set_config(cursor_name, last, false);
    RETURN QUERY SELECT * FROM fastjobs_jobs_all WHERE id = ANY(taken);
END
$$;

-- Whether queue q has jobs with a fairness key available: one probe of the
-- partial indexes below. A function, so the claim statements that ask it (of
-- a queue marked fair: sql._Choice.select) are planned as cheaply as before:
-- its query is planned once per session, not with each claim's.
CREATE OR REPLACE FUNCTION fastjobs_fair_keyed(q text) RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
BEGIN
    RETURN EXISTS (SELECT FROM fastjobs_jobs_all WHERE queue = q AND state = 'available' AND fair_key IS NOT NULL);
END
$$;

-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_fair_idx
    ON fastjobs_jobs (queue, priority DESC, fair_key, run_at, id) WHERE state = 'available' AND fair_key IS NOT NULL;
-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_1_fair_idx
    ON fastjobs_jobs_1 (queue, priority DESC, fair_key, run_at, id) WHERE state = 'available' AND fair_key IS NOT NULL;
-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_2_fair_idx
    ON fastjobs_jobs_2 (queue, priority DESC, fair_key, run_at, id) WHERE state = 'available' AND fair_key IS NOT NULL;
-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_3_fair_idx
    ON fastjobs_jobs_3 (queue, priority DESC, fair_key, run_at, id) WHERE state = 'available' AND fair_key IS NOT NULL;
-- fastjobs: concurrently
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_4_fair_idx
    ON fastjobs_jobs_4 (queue, priority DESC, fair_key, run_at, id) WHERE state = 'available' AND fair_key IS NOT NULL;
