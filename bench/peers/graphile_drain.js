// One graphile-worker process of bench/peers.py: connects its pool, prints "ready", waits for a
// line on stdin (the start), drains with runOnce and exits when no runnable job is left.
// Settings are graphile-worker's documented throughput configuration (its Performance page):
// a local queue fetching jobs in batches and batched completion.
"use strict";
const { runOnce, Logger } = require("graphile-worker");
const { Pool } = require("pg");

const [connectionString, concurrency, localQueueSize] = process.argv.slice(2);
const jobs = Number(concurrency);
// Warnings and errors only: a no-op drain logs nothing per job, as the other contenders.
const quiet = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") console.error(`graphile-worker ${level}: ${message}`);
});

async function main() {
  const pgPool = new Pool({ connectionString, max: jobs + 1 });
  const report = (error) => console.error(`graphile-worker pool: ${error}`);
  pgPool.on("error", report);
  pgPool.on("connect", (client) => client.on("error", report));
  const clients = await Promise.all(Array.from({ length: jobs + 1 }, () => pgPool.connect()));
  for (const client of clients) client.release();
  process.stdout.write("ready\n");
  await new Promise((resolve) => process.stdin.once("data", resolve));
  process.stdin.destroy(); // an open stdin would keep this process alive after the drain
  await runOnce({
    pgPool,
    logger: quiet,
    taskList: { noop: async () => {} },
    preset: {
      worker: {
        concurrentJobs: jobs,
        maxPoolSize: jobs + 1,
        localQueue: { size: Number(localQueueSize) },
        completeJobBatchDelay: 0,
        failJobBatchDelay: 0,
      },
    },
  });
  await pgPool.end();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
