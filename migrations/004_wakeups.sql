-- 004_wakeups: NOTIFY only when a worker waits for it.
--
-- A NOTIFY takes a cluster-wide lock at commit and holds it across the
-- commit's WAL flush, so commits that notify cannot share a flush: with the
-- trigger of 001, 16 producers each enqueueing one job per transaction
-- commit at a fraction of the rate of the same INSERTs without it. A worker
-- about to sleep now advertises itself here (and claims once more), and the
-- trigger notifies only while some worker of the queue waits: under load
-- nobody waits, no commit notifies, and commits share their flushes.
--
-- One short transaction step: a new table, and the trigger's function
-- replaced in place (no lock on fastjobs_jobs; the next INSERT runs the new
-- body). Workers of 003 do not advertise: on this schema they are no longer
-- notified and find new jobs by their poll (poll_interval, 1 s by default)
-- until they are upgraded.

-- One row per worker sleeping on its LISTEN connection, until it wakes.
-- UNLOGGED: no WAL for a flag that only matters while its worker lives (a
-- crash empties it; workers advertise again on their next sleep). A row
-- whose worker died without removing it stops counting at `until`: the
-- worker renews it while it sleeps longer.
CREATE UNLOGGED TABLE IF NOT EXISTS fastjobs_waiting (
    worker  text        PRIMARY KEY,
    queues  text[]      NOT NULL,
    until   timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000
);

-- Still one notification per queue per statement, now only for queues a
-- worker waits on; the transition table is read only then.
CREATE OR REPLACE FUNCTION fastjobs_notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM fastjobs_waiting WHERE until > now()) THEN
        PERFORM pg_notify('fastjobs', q.queue)
           FROM (SELECT DISTINCT queue FROM inserted WHERE state = 'available') q
          WHERE EXISTS (SELECT 1 FROM fastjobs_waiting w WHERE q.queue = ANY (w.queues) AND w.until > now());
    END IF;
    RETURN NULL;
END
$$;
