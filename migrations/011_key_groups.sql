-- 011_key_groups: claims of keyed jobs take turns per group of keys, and each takes a few groups.
--
-- 009's claims locked the stripes of every key among their candidates and
-- held them to commit; a claim in a queue of 1,000 interleaved keys locked
-- all 128, so the claims of every worker ran one at a time (bench/RESULTS.md,
-- "Limits per key"). Here the keys (kind and key) fall into 16 groups, and a
-- state-lane claim takes a group's turn before it looks at that group's jobs
-- at all (fastjobs_in_turn, in the claim's WHERE): it takes the groups of the
-- first keyed jobs it meets, up to 4, skipping those other claims hold, and
-- passes over the jobs of every other group (they stay unlocked, for the
-- claims that hold theirs). So concurrent claims share out the groups and
-- count their keys side by side, and no claim waits for another's turn.
-- fastjobs_take counts, as before, on a snapshot taken after the turns came,
-- and only takes candidates of the groups its claim holds.
--
-- And a fair claim takes as many jobs as it asks for while its keys have
-- them: 010's fastjobs_fair gives each key it visits an equal share of
-- `asked` (rounded down) and filled what was left from the same keys only
-- when that share was above one, so asked for fewer than two jobs a key it
-- dropped the remainder (19 asked of 10 keys with 3 jobs each: 10 taken),
-- and under a rate limit had taken tokens for jobs it did not start. It is
-- replaced below, the fill running whenever the shares fell short.
--
-- Live: functions only.

-- The group of kind k's key y: one of 16 (an advisory lock's second key).
CREATE OR REPLACE FUNCTION fastjobs_key_group(k text, y text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT abs(hashtext(k || ':' || y) % 16) $$;

-- Whether this transaction holds the turn of key y's group (kind k, the
-- job's limit lim), taking it if it can without waiting (an advisory
-- transaction lock, tried) while it holds fewer than 4 groups with room: a
-- claim takes the groups of the first keyed jobs it meets, and a group
-- another claim holds is passed over for this one's whole transaction.
-- Claims never wait on each other, so none waits behind a claim that holds
-- every group of its candidates. A group whose first key met is at its
-- limit (a look at its running jobs, before fastjobs_take counts for real)
-- is held without counting towards the 4, so keys at their limits never
-- keep a claim from the groups behind them. The groups held, passed over
-- and held full are kept in settings local to the transaction (bit masks),
-- so the test of a job of either of the first two reads one setting.
CREATE OR REPLACE FUNCTION fastjobs_in_turn(k text, y text, lim integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
DECLARE
    seen integer := coalesce(nullif(current_setting('fastjobs.key_groups', true), ''), '0')::integer;
    full_ integer := coalesce(nullif(current_setting('fastjobs.key_groups_full', true), ''), '0')::integer;
    g integer := fastjobs_key_group(k, y);
    room boolean;
BEGIN
    IF k IS NULL OR y IS NULL THEN
        RETURN NULL;
    ELSIF seen & (1 << g) <> 0 THEN
        RETURN true;
    ELSIF seen & (1 << (16 + g)) <> 0 THEN
        RETURN false;
    ELSIF length(replace((seen & ~full_ & 65535)::bit(16)::text, '0', '')) < 4
          AND pg_try_advisory_xact_lock(1718382456, g) THEN
        SELECT coalesce(min(l.concurrency), lim) IS NULL
               OR (SELECT count(*) FROM fastjobs_jobs j
                    WHERE j.kind = k AND j.limit_key = y AND j.state = 'running') < coalesce(min(l.concurrency), lim)
          INTO room
          FROM fastjobs_limits l WHERE l.kind = k AND l.key = y;
        PERFORM set_config('fastjobs.key_groups', (seen | (1 << g))::text, true);
        IF NOT room THEN
            PERFORM set_config('fastjobs.key_groups_full', (full_ | (1 << g))::text, true);
        END IF;
        RETURN true;
    END IF;
    PERFORM set_config('fastjobs.key_groups', (seen | (1 << (16 + g)))::text, true);
    RETURN false;
END
$$;

-- As 009's, with the turns of fastjobs_in_turn in place of the stripes: the
-- candidates whose group the claim does not hold (a fair claim's, which
-- fastjobs_in_turn did not filter) are left; the count's snapshot is taken
-- after every turn came.
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
    SELECT array_agg(c.id ORDER BY c.n), array_agg(c.k ORDER BY c.n), array_agg(c.y ORDER BY c.n),
           array_agg(c.lim ORDER BY c.n), array_agg(c.rate ORDER BY c.n)
      INTO ids, kinds, keys, limits, rates
      FROM unnest(ids, kinds, keys, limits, rates) WITH ORDINALITY AS c(id, k, y, lim, rate, n)
     WHERE CASE WHEN coalesce(nullif(current_setting('fastjobs.key_groups', true), ''), '0')::int4
                     & (65537 << fastjobs_key_group(c.k, c.y)) = 0
                THEN fastjobs_in_turn(c.k, c.y, c.lim)
                ELSE coalesce(nullif(current_setting('fastjobs.key_groups', true), ''), '0')::int4
                     & (1 << fastjobs_key_group(c.k, c.y)) <> 0 END;  -- sql._IN_TURN
    IF ids IS NULL THEN
        RETURN '{}';
    END IF;
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

-- fastjobs_fair as 010 describes it, its fill whenever the shares fell short of `asked`.
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
        IF wanted > 0 THEN  -- some had less than their share, or `asked` did not divide: fill in, in turn
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
