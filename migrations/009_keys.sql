-- 009_keys: concurrency and rate limits per key (per tenant) and per kind.
--
-- A job of a kind declared with concurrency_key (or rate_limit) carries its
-- key and the kind's limits, computed at enqueue: limit_key (the key's value
-- as text; '' for a limit on the kind as a whole), limit_concurrency (at most
-- that many jobs of its kind and key running at once) and limit_rate (jobs of
-- its kind and key started per second). Every other job has NULLs there and
-- costs nothing more. fastjobs_limits holds, per kind and key, what an
-- operator set instead of the declared limits (concurrency, rate_limit as
-- given, rate in jobs per second) and the key's token bucket (tokens,
-- refilled at rate since refilled_at, holding at most one second's worth).
-- A key needs a row only once an operator limited it or it has a rate.
--
-- Live: nullable columns without a default (no row touched), a new table and
-- function, and an index per partition built CONCURRENTLY.

ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS limit_key text;
ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS limit_concurrency integer;
ALTER TABLE fastjobs_jobs_all ADD COLUMN IF NOT EXISTS limit_rate double precision;

-- A keyed job lives in slot 0 only (fastjobs_jobs), so the count of a key's
-- running jobs reads one partition's index; the rotating slots refuse one
-- (NOT VALID: no row is read, each of theirs has NULL there).
DO $$
DECLARE
    slot integer;
BEGIN
    FOR slot IN 1..4 LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = format('fastjobs_jobs_%s_no_limit_key', slot)) THEN
            EXECUTE format('ALTER TABLE fastjobs_jobs_%s ADD CONSTRAINT fastjobs_jobs_%s_no_limit_key'
                           ' CHECK (limit_key IS NULL) NOT VALID', slot, slot);
        END IF;
    END LOOP;
END
$$;

CREATE TABLE IF NOT EXISTS fastjobs_limits (
    kind        text        NOT NULL,
    key         text        NOT NULL,
    concurrency integer     CHECK (concurrency > 0),
    rate_limit  text,
    rate        double precision CHECK (rate > 0),
    tokens      double precision,
    refilled_at timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, key)
);

-- Which of the keyed candidates a claim may take, in claim order (ids,
-- with each one's kind, key and declared limits): for each kind and key, at
-- most its concurrency less its jobs running, and at most the whole tokens
-- of its bucket, which the claim takes (only those it uses: it knows how
-- many candidates each key has). STRICT: a claim whose candidates have no
-- key passes NULL arrays, and the function is not called at all.
--
-- Claims take turns per stripe of keys (an advisory transaction lock on the
-- key's hash modulo 128, taken in order: no deadlock, at most 128 locks a
-- claim), then count on a snapshot taken after their turn came (VOLATILE:
-- each statement here has its own), so two claims can never both take a
-- key's last place; the locks are held to the claim's commit. A finish
-- statement that claims passes its worker and the outcomes it writes, whose
-- jobs the count leaves out (fastjobs_room's rule: it cannot see them end).
-- A key's bucket starts full and holds at most one second's worth (at least
-- one token). Its names are the migration's schema's (search_path FROM CURRENT);
-- its statements are planned for the arrays they get (a generic plan, which
-- guesses 10 elements per array, joined 1,000 keys by a nested loop: 1.2 s).
CREATE OR REPLACE FUNCTION fastjobs_take(
    ids bigint[], kinds text[], keys text[], limits integer[], rates double precision[],
    worker text, done bigint[], outcomes jsonb
) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE STRICT SET search_path FROM CURRENT SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    at timestamptz := clock_timestamp();
    ended bigint[] := done || ARRAY(SELECT (o->>'id')::bigint FROM jsonb_array_elements(outcomes) o);
    g_kinds text[];
    g_keys text[];
    g_rooms bigint[];
    g_rates double precision[];
    r_kinds text[];
    r_keys text[];
    r_rooms bigint[];
    taken bigint[];
BEGIN
    PERFORM pg_advisory_xact_lock(1718382455, s.stripe)
       FROM (SELECT DISTINCT abs(hashtext(c.k || ':' || c.y) % 128) AS stripe
               FROM unnest(kinds, keys) AS c(k, y) ORDER BY 1) AS s;
    WITH g AS (
        SELECT c.k, c.y, count(*) AS wanted,
               coalesce(min(l.concurrency), min(c.lim)) AS lim, coalesce(min(l.rate), min(c.rate)) AS rate
          FROM unnest(kinds, keys, limits, rates) AS c(k, y, lim, rate)
          LEFT JOIN fastjobs_limits l ON l.kind = c.k AND l.key = c.y
         GROUP BY c.k, c.y
    )
    SELECT array_agg(g.k), array_agg(g.y), array_agg(g.rate),
           array_agg(CASE WHEN g.lim IS NULL THEN g.wanted
                          ELSE greatest(0, least(g.wanted, g.lim - r.running)) END)
      INTO g_kinds, g_keys, g_rates, g_rooms
      FROM g LEFT JOIN LATERAL (  -- one probe of the index per key: never a scan of every key's entries
           SELECT count(*) AS running
             FROM fastjobs_jobs j
            WHERE g.lim IS NOT NULL AND j.kind = g.k AND j.limit_key = g.y AND j.state = 'running'
              AND NOT (j.attempted_by = worker AND j.id IN (SELECT unnest(ended)))) AS r ON true;
    IF EXISTS (SELECT FROM unnest(g_rates) AS r(rate) WHERE r.rate IS NOT NULL) THEN
        INSERT INTO fastjobs_limits (kind, key)
        SELECT g.k, g.y FROM unnest(g_kinds, g_keys, g_rates) AS g(k, y, rate) WHERE g.rate IS NOT NULL
        ON CONFLICT DO NOTHING;
        WITH took AS (
            UPDATE fastjobs_limits l
               SET tokens = b.bucket - b.room, refilled_at = at
              FROM (SELECT g.k, g.y, least(g.room, floor(k.bucket)::bigint) AS room, k.bucket
                      FROM unnest(g_kinds, g_keys, g_rooms, g_rates) AS g(k, y, room, rate)
                      JOIN fastjobs_limits l2 ON l2.kind = g.k AND l2.key = g.y,
                           LATERAL (SELECT least(greatest(g.rate, 1),
                                                 coalesce(l2.tokens, greatest(g.rate, 1))
                                                 + g.rate * greatest(0, extract(epoch FROM at - l2.refilled_at)))
                                    ) AS k(bucket)
                     WHERE g.rate IS NOT NULL) AS b
             WHERE l.kind = b.k AND l.key = b.y
            RETURNING l.kind, l.key, b.room
        )
        SELECT array_agg(kind), array_agg(key), array_agg(room) INTO r_kinds, r_keys, r_rooms FROM took;
    END IF;
    SELECT array_agg(c.id ORDER BY c.n) INTO taken
      FROM (SELECT c.id, c.n, c.k, c.y, row_number() OVER (PARTITION BY c.k, c.y ORDER BY c.n) AS nth
              FROM unnest(ids, kinds, keys) WITH ORDINALITY AS c(id, k, y, n)) AS c
      JOIN unnest(g_kinds, g_keys, g_rooms) AS g(k, y, room) ON g.k = c.k AND g.y = c.y
      LEFT JOIN unnest(r_kinds, r_keys, r_rooms) AS r(k, y, room) ON r.k = c.k AND r.y = c.y
     WHERE c.nth <= coalesce(r.room, g.room);
    RETURN coalesce(taken, '{}');
END
$$;

-- fastjobs: concurrently
-- The count of a key's running jobs (fastjobs_take): in slot 0 only, where
-- every keyed job is inserted (job_insert, job_insert_staged) and stays.
CREATE INDEX CONCURRENTLY IF NOT EXISTS fastjobs_jobs_limit_idx
    ON fastjobs_jobs (kind, limit_key) WHERE state = 'running' AND limit_key IS NOT NULL;
