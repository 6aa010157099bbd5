-- 003_cluster: what `fastjobs stats` shows of every host running workers.
--
-- Each worker's heartbeat carries its counters (totals, rate, outcomes per
-- queue and kind), written whole with the heartbeat it already sends: one
-- row per process every couple of seconds, never a write per job. A nullable
-- column without a default is added without touching a row: the lock on
-- fastjobs_workers lasts milliseconds. Code of 002 never reads or writes it.
ALTER TABLE fastjobs_workers ADD COLUMN IF NOT EXISTS counters jsonb;
