-- 005_rotation: storage bounded by the backlog, not by VACUUM.
--
-- Every job leaves dead row versions (its claim, its completion) that only
-- VACUUM reclaims, and VACUUM reclaims nothing while any snapshot is older
-- than them: with a REPEATABLE READ snapshot held 2 minutes the table grew
-- to 4.4 GB and never shrank. TRUNCATE frees a table's storage whatever the
-- snapshots (it is not MVCC-bound). So jobs are kept in a partitioned table,
-- fastjobs_jobs_all, LIST-partitioned on `slot`:
--   slot 0, fastjobs_jobs itself (the table of 001-004, attached as is):
--      the durable partition, vacuumed as before. Unique-key and scheduled
--      jobs are inserted there directly, and finished rows end there.
--   slots 1-4, fastjobs_jobs_1..4: due-now jobs without a unique key, the
--      mass. An insert's slot is the default, the sequence fastjobs_slot,
--      which the leader moves (no lookup per insert); the leader then
--      empties the oldest slot: its leftover rows are copied out and it is
--      TRUNCATEd (fastjobs.leader.rotate_once).
--
-- The parent has a name of its own so that code of 004 keeps running on
-- this schema: it reads and writes fastjobs_jobs, now partition 0, whose
-- unique index still arbitrates its ON CONFLICT (a unique index on a
-- partitioned table must include the partition key, so `ON CONFLICT
-- (unique_key)` could never name the parent). It sees only the jobs of
-- partition 0 (every job it enqueues lands there); jobs enqueued by code of
-- 005 are run by workers of 005.
--
-- Live: three short transaction steps under lock_timeout; nothing rewrites
-- or scans fastjobs_jobs under a lock that stops writes. PostgreSQL 17 and
-- later refuse to attach a table with an identity column, so `id` becomes a
-- plain default on a sequence of its own, started where the identity was.

CREATE SEQUENCE IF NOT EXISTS fastjobs_slot AS smallint MINVALUE 1 MAXVALUE 4;
-- The default of every insert through the parent reads it.
GRANT SELECT ON SEQUENCE fastjobs_slot TO PUBLIC;
-- A sequence never called has no last value (pg_sequence_last_value is NULL).
SELECT setval('fastjobs_slot', 1) WHERE pg_sequence_last_value('fastjobs_slot') IS NULL;

-- ACCESS EXCLUSIVE for milliseconds: a column with a constant default
-- touches no row, NOT VALID checks none. (Tested first: on a partition,
-- ADD COLUMN IF NOT EXISTS fails even when the column exists.)
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'fastjobs_jobs'::regclass AND attname = 'slot') THEN
        ALTER TABLE fastjobs_jobs ADD COLUMN slot smallint NOT NULL DEFAULT 0;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conrelid = 'fastjobs_jobs'::regclass AND conname = 'fastjobs_jobs_slot_check') THEN
        ALTER TABLE fastjobs_jobs ADD CONSTRAINT fastjobs_jobs_slot_check CHECK (slot = 0) NOT VALID;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = 'fastjobs_jobs'::regclass AND attname = 'id' AND attidentity <> '') THEN
        LOCK TABLE fastjobs_jobs IN ACCESS EXCLUSIVE MODE;
        CREATE SEQUENCE fastjobs_jobs_id AS bigint;
        PERFORM setval('fastjobs_jobs_id',
                       coalesce(pg_sequence_last_value(pg_get_serial_sequence('fastjobs_jobs', 'id')), 0) + 1,
                       false);
        ALTER TABLE fastjobs_jobs ALTER COLUMN id DROP IDENTITY;
        ALTER TABLE fastjobs_jobs ALTER COLUMN id SET DEFAULT nextval('fastjobs_jobs_id');
        ALTER SEQUENCE fastjobs_jobs_id OWNED BY fastjobs_jobs.id;
    END IF;
END
$$;

-- The parent: fastjobs_jobs's columns, without their checks (each
-- partition carries its own). No index of its own: each partition has its
-- indexes, so attaching fastjobs_jobs builds none.
CREATE TABLE IF NOT EXISTS fastjobs_jobs_all (
    id               bigint         NOT NULL DEFAULT nextval('fastjobs_jobs_id'),
    queue            text           NOT NULL DEFAULT 'default',
    kind             text           NOT NULL,
    args             jsonb          NOT NULL DEFAULT '{}',
    priority         smallint       NOT NULL DEFAULT 0,
    state            fastjobs_state NOT NULL DEFAULT 'available',
    run_at           timestamptz    NOT NULL DEFAULT now(),
    attempt          smallint       NOT NULL DEFAULT 0,
    max_attempts     smallint       NOT NULL DEFAULT 25,
    created_at       timestamptz    NOT NULL DEFAULT now(),
    attempted_at     timestamptz,
    finalized_at     timestamptz,
    attempted_by     text,
    errors           jsonb,
    unique_key       text,
    meta             jsonb,
    crashes          smallint       NOT NULL DEFAULT 0,
    cancel_requested boolean        NOT NULL DEFAULT false,
    slot             smallint       NOT NULL DEFAULT pg_sequence_last_value('fastjobs_slot')
) PARTITION BY LIST (slot);

-- The rotating slots. Never vacuumed: TRUNCATE cleans them, and an
-- autovacuum holding its lock would make each rotation wait out its
-- lock_timeout. No unique key ever lands here (they stay in fastjobs_jobs,
-- whose unique index enforces them).
CREATE TABLE IF NOT EXISTS fastjobs_jobs_1 PARTITION OF fastjobs_jobs_all (
    PRIMARY KEY (id),
    CHECK (queue <> '' AND length(queue) <= 128), CHECK (kind <> '' AND length(kind) <= 512),
    CHECK (attempt >= 0), CHECK (max_attempts > 0), CHECK (unique_key IS NULL)
) FOR VALUES IN (1) WITH (fillfactor = 70, autovacuum_enabled = false);
CREATE TABLE IF NOT EXISTS fastjobs_jobs_2 PARTITION OF fastjobs_jobs_all (
    PRIMARY KEY (id),
    CHECK (queue <> '' AND length(queue) <= 128), CHECK (kind <> '' AND length(kind) <= 512),
    CHECK (attempt >= 0), CHECK (max_attempts > 0), CHECK (unique_key IS NULL)
) FOR VALUES IN (2) WITH (fillfactor = 70, autovacuum_enabled = false);
CREATE TABLE IF NOT EXISTS fastjobs_jobs_3 PARTITION OF fastjobs_jobs_all (
    PRIMARY KEY (id),
    CHECK (queue <> '' AND length(queue) <= 128), CHECK (kind <> '' AND length(kind) <= 512),
    CHECK (attempt >= 0), CHECK (max_attempts > 0), CHECK (unique_key IS NULL)
) FOR VALUES IN (3) WITH (fillfactor = 70, autovacuum_enabled = false);
CREATE TABLE IF NOT EXISTS fastjobs_jobs_4 PARTITION OF fastjobs_jobs_all (
    PRIMARY KEY (id),
    CHECK (queue <> '' AND length(queue) <= 128), CHECK (kind <> '' AND length(kind) <= 512),
    CHECK (attempt >= 0), CHECK (max_attempts > 0), CHECK (unique_key IS NULL)
) FOR VALUES IN (4) WITH (fillfactor = 70, autovacuum_enabled = false);

-- The indexes of 001 and 002 (the unique keys' aside), on each rotating slot.
CREATE INDEX IF NOT EXISTS fastjobs_jobs_1_claim_idx ON fastjobs_jobs_1 (queue, priority DESC, run_at, id)
    WHERE state = 'available';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_2_claim_idx ON fastjobs_jobs_2 (queue, priority DESC, run_at, id)
    WHERE state = 'available';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_3_claim_idx ON fastjobs_jobs_3 (queue, priority DESC, run_at, id)
    WHERE state = 'available';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_4_claim_idx ON fastjobs_jobs_4 (queue, priority DESC, run_at, id)
    WHERE state = 'available';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_1_due_idx ON fastjobs_jobs_1 (run_at) WHERE state IN ('scheduled', 'retryable');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_2_due_idx ON fastjobs_jobs_2 (run_at) WHERE state IN ('scheduled', 'retryable');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_3_due_idx ON fastjobs_jobs_3 (run_at) WHERE state IN ('scheduled', 'retryable');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_4_due_idx ON fastjobs_jobs_4 (run_at) WHERE state IN ('scheduled', 'retryable');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_1_running_idx ON fastjobs_jobs_1 (attempted_by) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_2_running_idx ON fastjobs_jobs_2 (attempted_by) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_3_running_idx ON fastjobs_jobs_3 (attempted_by) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_4_running_idx ON fastjobs_jobs_4 (attempted_by) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS fastjobs_jobs_1_finalized_idx ON fastjobs_jobs_1 (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_2_finalized_idx ON fastjobs_jobs_2 (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_3_finalized_idx ON fastjobs_jobs_3 (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');
CREATE INDEX IF NOT EXISTS fastjobs_jobs_4_finalized_idx ON fastjobs_jobs_4 (finalized_at)
    WHERE state IN ('completed', 'cancelled', 'discarded');

-- Inserts through the parent wake sleeping workers as 004's do through
-- fastjobs_jobs (a statement trigger fires for the table named, never for
-- both: one notification per queue per statement still).
-- Created only where missing: a re-run (an interrupted migrate, the --sql
-- script applied again) takes no ACCESS EXCLUSIVE lock on the live parent.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                    WHERE tgrelid = 'fastjobs_jobs_all'::regclass AND tgname = 'fastjobs_jobs_all_notify') THEN
        CREATE TRIGGER fastjobs_jobs_all_notify
            AFTER INSERT ON fastjobs_jobs_all
            REFERENCING NEW TABLE AS inserted
            FOR EACH STATEMENT
            WHEN (pg_sequence_last_value('fastjobs_sleep_until') > date_part('epoch', clock_timestamp()) * 1000)
            EXECUTE FUNCTION fastjobs_notify_inserted();
    END IF;
END
$$;

-- Roles granted fastjobs_jobs get the same on the parent, and those that
-- insert get the id sequence (an identity needed no grant, a default
-- nextval() does): producer roles that are not the owner keep enqueueing,
-- through either table.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee,
                    a.privilege_type
               FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
               LEFT JOIN pg_roles r ON r.oid = a.grantee
              WHERE c.oid = 'fastjobs_jobs'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON fastjobs_jobs_all TO %s', g.privilege_type, g.grantee);
        IF g.privilege_type = 'INSERT' THEN
            EXECUTE format('GRANT USAGE ON SEQUENCE fastjobs_jobs_id TO %s', g.grantee);
        END IF;
    END LOOP;
END
$$;

-- fastjobs: transaction
-- Reads fastjobs_jobs whole, under SHARE UPDATE EXCLUSIVE: enqueues, claims
-- and completions go on meanwhile.
ALTER TABLE fastjobs_jobs VALIDATE CONSTRAINT fastjobs_jobs_slot_check;

-- fastjobs: transaction
-- SHARE UPDATE EXCLUSIVE on the parent, ACCESS EXCLUSIVE on fastjobs_jobs
-- for milliseconds: the valid check above proves the partition's bound
-- without a scan.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = 'fastjobs_jobs'::regclass) THEN
        ALTER TABLE fastjobs_jobs_all ATTACH PARTITION fastjobs_jobs FOR VALUES IN (0);
    END IF;
END
$$;

-- fastjobs: transaction
-- Autovacuum of slot 0 leaves the empty pages at its end, as the leader's
-- VACUUM does (sql.vacuum_jobs): cutting them off takes an ACCESS EXCLUSIVE
-- lock every claim and enqueue queues behind (stalls of 0.1-3 s measured
-- under load). SHARE UPDATE EXCLUSIVE: writes go on.
ALTER TABLE fastjobs_jobs SET (vacuum_truncate = false);
