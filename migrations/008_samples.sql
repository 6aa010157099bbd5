-- 008_samples: the leader's periodic samples of throughput, for the dashboard's charts.
--
-- Every SamplesConfig.interval the leader writes one row per queue: the
-- outcomes the workers' heartbeats have counted so far (completed, and
-- failed: retried or discarded), summed over every registered worker. A
-- chart is the difference between consecutive rows. Rows older than
-- SamplesConfig.retention are deleted by the same service, so the table
-- stays a few thousand rows whatever the load: no job ever writes it.
CREATE TABLE IF NOT EXISTS fastjobs_samples (
    at        timestamptz NOT NULL,
    queue     text        NOT NULL,
    completed bigint      NOT NULL,
    failed    bigint      NOT NULL,
    PRIMARY KEY (at, queue)
);
