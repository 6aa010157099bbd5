-- 004_wakeups: an insert notifies only while a worker sleeps.
--
-- A NOTIFY takes a cluster-wide lock at commit and holds it across the
-- commit's WAL flush, so commits that notify cannot share a flush: with the
-- trigger of 001, 16 producers each enqueueing one job per transaction
-- committed at 0.10-0.20 x the rate of the same INSERTs without the trigger
-- (`fastjobs bench --producers 16`). Calling the trigger's function costs
-- besides: some 25 us a statement, a third of a single INSERT.
--
-- A worker about to sleep on its LISTEN connection moves a deadline forward
-- (a sequence: setval is seen by every session at once, without a commit,
-- and writes no row), then claims once more; the trigger runs only before
-- that deadline. Under load no worker sleeps, no commit notifies, commits
-- share their flushes, and the trigger costs its WHEN test alone.
--
-- One short transaction step: the trigger is replaced under lock_timeout.
-- DROP TRIGGER takes ACCESS EXCLUSIVE on fastjobs_jobs (CREATE OR REPLACE
-- TRIGGER would take less, but needs PostgreSQL 14): held for milliseconds,
-- and waited for at most lock_timeout per try, during which enqueues, claims
-- and readers queue behind it; the step gives way and retries. Workers of 003 do
-- not move the deadline: on this schema they are notified only while a
-- worker of 004 sleeps, and otherwise find new jobs by their poll
-- (poll_interval, 1 s by default) until they are upgraded.

-- Until when (milliseconds since 1970, the server's clock) some worker sleeps.
CREATE SEQUENCE IF NOT EXISTS fastjobs_sleep_until AS bigint MINVALUE 0 START 0;
-- Every role that inserts jobs runs the trigger's WHEN test, which reads it.
GRANT SELECT ON SEQUENCE fastjobs_sleep_until TO PUBLIC;

-- Still one notification per queue per statement, and the same function;
-- now only before the deadline. A test in WHEN costs no function call.
DROP TRIGGER IF EXISTS fastjobs_jobs_notify ON fastjobs_jobs;
CREATE TRIGGER fastjobs_jobs_notify
    AFTER INSERT ON fastjobs_jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT
    WHEN (pg_sequence_last_value('fastjobs_sleep_until') > date_part('epoch', clock_timestamp()) * 1000)
    EXECUTE FUNCTION fastjobs_notify_inserted();
