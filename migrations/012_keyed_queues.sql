-- 012_keyed_queues: a queue's claims skip the keyed part of the claim until it has keyed jobs.
--
-- A claim that may meet a job limited per key (009) reads each candidate's
-- key, its group's turn (011) and fastjobs_take's count: a fifth of the
-- statement a shallow queue pays once per job, whether or not it ever had a
-- keyed job (bench/RESULTS.md, "Issue 22 §5, fifth sitting"). Here a queue
-- is marked `keyed` when its first keyed job is inserted, by a trigger on
-- slot 0, where every keyed job lands (job_insert, job_insert_staged), so
-- producers of every version mark it; a worker's heartbeat reads the marks
-- (sql.queue_limited) and its loop claims a queue never marked with the
-- statements that take keyless jobs only (sql.COMPLETE, sql.CLAIM_ONLY).
-- A mark is never cleared: a queue once keyed claims as before.
--
-- Live: a column with a constant default (a catalogue change), a trigger
-- created under SHARE ROW EXCLUSIVE for milliseconds (it waits for the
-- inserts in flight, so none escapes both it and the marks below), and the
-- queues of the keyed jobs already there marked once.

ALTER TABLE fastjobs_queues ADD COLUMN IF NOT EXISTS keyed boolean NOT NULL DEFAULT false;

-- Mark the queue of a keyed job inserted (fired for those rows only: its WHEN).
-- The lookup first, so the usual keyed insert writes nothing more.
CREATE OR REPLACE FUNCTION fastjobs_mark_keyed() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM fastjobs_queues WHERE name = NEW.queue AND keyed) THEN
        INSERT INTO fastjobs_queues AS q (name, keyed) VALUES (NEW.queue, true)
        ON CONFLICT (name) DO UPDATE SET keyed = true, updated_at = now() WHERE NOT q.keyed;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS fastjobs_mark_keyed ON fastjobs_jobs;
CREATE TRIGGER fastjobs_mark_keyed AFTER INSERT ON fastjobs_jobs
    FOR EACH ROW WHEN (NEW.limit_key IS NOT NULL) EXECUTE FUNCTION fastjobs_mark_keyed();

INSERT INTO fastjobs_queues AS q (name, keyed)
SELECT DISTINCT queue, true FROM fastjobs_jobs WHERE limit_key IS NOT NULL
ON CONFLICT (name) DO UPDATE SET keyed = true, updated_at = now() WHERE NOT q.keyed;
