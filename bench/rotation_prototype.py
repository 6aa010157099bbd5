"""Issue 13 part 2, raw-SQL prototype: rotating partitions TRUNCATEd instead of a table VACUUM must clean.

Run: python bench/rotation_prototype.py [DSN]   (default postgresql://postgres@127.0.0.1:5432/postgres)
It creates (and drops at the end) its own database, fastjobs_rotation_proto, and prints:

1. locks: which relations an INSERT into the partitioned parent locks (custom and generic plan),
   and which a claim locks;
2. drain: the raw claim (UPDATE ... FOR UPDATE SKIP LOCKED) + DELETE by ids, 2 processes, batch 1,000,
   on a plain table and on the partitioned layout, alternated, median of 3 and the ratio;
3. soak: 2 consumers draining what a producer offers at a fixed rate, with a REPEATABLE READ snapshot
   held (on another table) from 10 s on: size of table + indexes every 10 s for both layouts, the
   rotation's lock waits, and single-INSERT enqueue latency (p50, p99, max) while rotation runs.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time

import psycopg
from psycopg.conninfo import make_conninfo

DB = "fastjobs_rotation_proto"
LOCK_TIMEOUT_MS = 50  # how long the rotation waits for its lock before it gives way (claims queue behind it)
SLOTS = 4  # rotating partitions 1..SLOTS; 0 is the durable one

COLUMNS = """
    queue text NOT NULL DEFAULT 'default', kind text NOT NULL, args jsonb NOT NULL DEFAULT '{}',
    priority smallint NOT NULL DEFAULT 0, state text NOT NULL DEFAULT 'available',
    run_at timestamptz NOT NULL DEFAULT now(), attempt smallint NOT NULL DEFAULT 0,
    max_attempts smallint NOT NULL DEFAULT 25, created_at timestamptz NOT NULL DEFAULT now(),
    attempted_at timestamptz, finalized_at timestamptz, attempted_by text, errors jsonb,
    unique_key text, meta jsonb"""

INDEXES = """
CREATE INDEX ON {t} (queue, priority DESC, run_at, id) WHERE state = 'available';
CREATE INDEX ON {t} (run_at) WHERE state IN ('scheduled', 'retryable');
CREATE INDEX ON {t} (attempted_by) WHERE state = 'running';
"""

PLAIN = f"""
DROP TABLE IF EXISTS plain_jobs;
CREATE TABLE plain_jobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, {COLUMNS})
  WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 5000,
        autovacuum_vacuum_cost_delay = 0);
{INDEXES.format(t="plain_jobs")}
"""

ROTATING = f"""
DROP TABLE IF EXISTS rot_jobs CASCADE;
DROP SEQUENCE IF EXISTS rot_slot;
CREATE SEQUENCE rot_slot AS smallint MINVALUE 1 MAXVALUE {SLOTS};
SELECT setval('rot_slot', 1);
CREATE SEQUENCE IF NOT EXISTS rot_id;
CREATE TABLE rot_jobs (id bigint NOT NULL DEFAULT nextval('rot_id'), {COLUMNS},
                       slot smallint NOT NULL DEFAULT pg_sequence_last_value('rot_slot'))
  PARTITION BY LIST (slot);
CREATE UNIQUE INDEX ON rot_jobs (id, slot);
{INDEXES.format(t="rot_jobs")}
CREATE TABLE rot_jobs_0 PARTITION OF rot_jobs FOR VALUES IN (0)
  WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 5000);
""" + "".join(
    f"CREATE TABLE rot_jobs_{k} PARTITION OF rot_jobs FOR VALUES IN ({k})"
    " WITH (fillfactor = 70, autovacuum_enabled = false);\n"
    for k in range(1, SLOTS + 1)
)

CLAIM = """
UPDATE {t} j SET state = 'running', attempt = j.attempt + 1, attempted_at = now(), attempted_by = $2
 WHERE j.id = ANY(ARRAY(
   SELECT id FROM {t} WHERE state = 'available' AND queue = 'default' AND run_at <= now()
    ORDER BY priority DESC, run_at, id LIMIT $1 FOR UPDATE SKIP LOCKED))
RETURNING j.id"""
COMPLETE = "DELETE FROM {t} j WHERE j.id = ANY($1::bigint[]) AND j.state = 'running' AND j.attempted_by = $2"
INSERT = "INSERT INTO {t} (kind, args) VALUES ('k', $1::jsonb) RETURNING id"
INSERT_MANY = (
    "INSERT INTO {t} (kind, args) SELECT 'k', jsonb_build_object('i', i) FROM generate_series(1, $1) i"
)


def rotate(conn: psycopg.Connection, timeout_ms: int) -> tuple[bool, float, float]:
    """One rotation step: empty the oldest slot (the one after the current), then make it current.

    Under lock_timeout: LOCK waits for the transactions that inserted into that slot (so rows they
    committed are then visible), its rows still there (backlog, retryable, running) are copied into
    the current slot with their ids, it is truncated, and the slot default moves. Returns
    (done, seconds the lock was waited for, seconds it was held up to the end of the commit)."""
    cur_slot = conn.execute("SELECT pg_sequence_last_value('rot_slot')").fetchone()[0]
    oldest = cur_slot % SLOTS + 1
    asked = time.perf_counter()
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{timeout_ms}ms'")
            conn.execute(f"LOCK TABLE rot_jobs_{oldest} IN ACCESS EXCLUSIVE MODE")
            t0 = time.perf_counter()
            conn.execute(
                f"INSERT INTO rot_jobs_{cur_slot} SELECT id, queue, kind, args, priority, state, run_at,"
                " attempt, max_attempts, created_at, attempted_at, finalized_at, attempted_by, errors,"
                " unique_key, meta,"
                f" {cur_slot} FROM rot_jobs_{oldest}"
            )
            conn.execute(f"TRUNCATE rot_jobs_{oldest}")
            conn.execute("SELECT setval('rot_slot', %s)", (oldest,))
        return True, t0 - asked, time.perf_counter() - t0
    except psycopg.errors.LockNotAvailable:
        return False, time.perf_counter() - asked, 0.0


def size_mb(conn: psycopg.Connection, table: str) -> float:
    if table == "plain_jobs":
        q = "SELECT pg_total_relation_size('plain_jobs')"
    else:
        q = (
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_inherits i JOIN pg_class c"
            " ON c.oid = i.inhrelid WHERE i.inhparent = 'rot_jobs'::regclass AND c.relkind = 'r'"
        )
    return float(conn.execute(q).fetchone()[0]) / 2**20


# --- 1. locks ---------------------------------------------------------------------------------


def locks(dsn: str) -> None:
    print("1. locks taken (relations of the jobs layout):")
    with psycopg.connect(dsn) as conn:
        for mode in ("force_custom_plan", "force_generic_plan"):
            conn.execute(f"SET plan_cache_mode = {mode}")
            with psycopg.RawCursor(conn) as cur:
                for name, stmt, args in (
                    ("INSERT", INSERT.format(t="rot_jobs"), ("{}",)),
                    ("claim", CLAIM.format(t="rot_jobs"), (1, "w")),
                ):
                    for _ in range(6):  # past the 5 custom plans
                        cur.execute(stmt, args, prepare=True)
                        rels = cur.connection.execute(
                            "SELECT string_agg(relation::regclass::text || ' ' || mode, ', '"
                            " ORDER BY relation::regclass::text)"
                            " FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
                            " AND relation::regclass::text LIKE 'rot_jobs%'"
                            " AND relation::regclass::text NOT LIKE '%idx'"
                        ).fetchone()[0]
                        conn.rollback()
                    print(f"   {name:6} ({mode}): {rels}")


# --- 2. drain ---------------------------------------------------------------------------------


def _consumer(dsn: str, table: str, batch: int, done: object, stop: object) -> None:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        conn.execute("SET synchronous_commit = off")
        cur = psycopg.RawCursor(conn)
        me = f"w{id(conn)}"
        claim, complete = CLAIM.format(t=table), COMPLETE.format(t=table)
        while not stop.is_set():  # type: ignore[attr-defined]
            ids = [r[0] for r in cur.execute(claim, (batch, me))]
            if not ids:
                time.sleep(0.001)
                continue
            cur.execute(complete, (ids, me))
            with done.get_lock():  # type: ignore[attr-defined]
                done.value += len(ids)  # type: ignore[attr-defined]


def drain_once(dsn: str, table: str, jobs: int, procs: int = 2) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        psycopg.RawCursor(conn).execute(INSERT_MANY.format(t=table), (jobs,))
        conn.execute(f"VACUUM ANALYZE {table}")
    ctx = multiprocessing.get_context("fork")
    done, stop = ctx.Value("q", 0), ctx.Event()
    ps = [ctx.Process(target=_consumer, args=(dsn, table, 1000, done, stop)) for _ in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    while done.value < jobs:
        time.sleep(0.005)
    elapsed = time.perf_counter() - t0
    stop.set()
    for p in ps:
        p.join()
    return jobs / elapsed


def drain(dsn: str, jobs: int = 100_000, repeats: int = 3) -> None:
    print(f"2. drain of {jobs:,} jobs, 2 processes, batch 1,000 (claim UPDATE + DELETE by ids):")
    plain, rot = [], []
    for _ in range(repeats):
        plain.append(drain_once(dsn, "plain_jobs", jobs))
        rot.append(drain_once(dsn, "rot_jobs", jobs))
        print(
            f"   plain {plain[-1]:>9,.0f} jobs/s   partitioned {rot[-1]:>9,.0f} jobs/s"
            f"   ratio {rot[-1] / plain[-1]:.2f}"
        )
    print(
        "   median ratio partitioned / plain:",
        f"{statistics.median(r / p for r, p in zip(rot, plain, strict=True)):.2f}",
    )


# --- 3. soak with a held snapshot ---------------------------------------------------------------


def _producer(dsn: str, table: str, rate: float, stop: object) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        began, sent = time.perf_counter(), 0
        stmt = INSERT_MANY.format(t=table)
        while not stop.is_set():  # type: ignore[attr-defined]
            n = int((time.perf_counter() - began) * rate) - sent
            if n <= 0:
                time.sleep(0.01)
                continue
            psycopg.RawCursor(conn).execute(stmt, (n,))
            sent += n


def _single_enqueues(dsn: str, table: str, stop: threading.Event, lat: list[tuple[float, float]]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        stmt = INSERT.format(t=table)
        while not stop.is_set():
            t0 = time.perf_counter()
            psycopg.RawCursor(conn).execute(stmt, ("{}",), prepare=True)
            lat.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)


def soak(dsn: str, table: str, seconds: int, rate: float, hold_from: float, rotate_every: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        conn.execute("CREATE TABLE IF NOT EXISTS other (x int)")
    ctx = multiprocessing.get_context("fork")
    done, stop = ctx.Value("q", 0), ctx.Event()
    ps = [ctx.Process(target=_consumer, args=(dsn, table, 1000, done, stop)) for _ in range(2)]
    ps.append(ctx.Process(target=_producer, args=(dsn, table, rate, stop)))
    for p in ps:
        p.start()
    tstop = threading.Event()
    lat: list[tuple[float, float]] = []
    enq = threading.Thread(target=_single_enqueues, args=(dsn, table, tstop, lat))
    enq.start()
    holder = psycopg.connect(dsn)
    rotations: list[tuple[float, float]] = []
    failures = 0
    waits: list[float] = []
    began = time.perf_counter()
    print(f"   {table}: offered {rate:,.0f} jobs/s, snapshot held from {hold_from:.0f} s")
    with psycopg.connect(dsn, autocommit=True) as watch, psycopg.connect(dsn, autocommit=True) as leader:
        last_done, last_t, next_sample, next_rotate = 0, began, began + 10, began + rotate_every
        held = False
        while (now := time.perf_counter()) < began + seconds:
            if not held and now - began >= hold_from:
                holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM other")
                held = True
            if table == "rot_jobs" and now >= next_rotate:
                ok, waited, spent = rotate(leader, LOCK_TIMEOUT_MS)
                waits.append(waited)
                if ok:
                    rotations.append((now, spent))
                    next_rotate = now + rotate_every
                else:
                    failures += 1
                    next_rotate = now + 0.1
            if now >= next_sample:
                d = done.value
                backlog = watch.execute(f"SELECT count(*) FROM {table} WHERE state = 'available'").fetchone()[
                    0
                ]
                print(
                    f"   {now - began:>5.0f}s {(d - last_done) / (now - last_t):>9,.0f} jobs/s"
                    f"  backlog {backlog:>8,}"
                    f"  table+indexes {size_mb(watch, table):>8.1f} MB{'  (snapshot held)' if held else ''}"
                )
                last_done, last_t, next_sample = d, now, next_sample + 10
            time.sleep(0.01)
    holder.close()
    stop.set()
    tstop.set()
    enq.join()
    for p in ps:
        p.join()
    ls = sorted(x[1] for x in lat)
    print(
        f"   single enqueues: {len(ls):,}, p50 {ls[len(ls) // 2] * 1e3:.2f} ms,"
        f" p99 {ls[int(len(ls) * 0.99)] * 1e3:.2f} ms,"
        f" max {ls[-1] * 1e3:.2f} ms"
    )
    if rotations:
        near = [d for t0, d in lat if any(abs(t0 - r) < 0.05 for r, _ in rotations)]
        held_ms = sorted(s * 1e3 for _, s in rotations)
        print(
            f"   rotations: {len(rotations)} done, {failures} gave way on lock_timeout {LOCK_TIMEOUT_MS} ms;"
            f" lock waited for max {max(waits) * 1e3:.1f} ms; held (to the end of the commit)"
            f" p50 {held_ms[len(held_ms) // 2]:.1f} ms max {held_ms[-1]:.1f} ms;"
            f" enqueues within 50 ms of a rotation: {len(near)}, max {max(near, default=0) * 1e3:.2f} ms"
        )


def insert_latency(dsn: str, n: int = 3000) -> None:
    print(f"   single INSERT round trip, idle server, {n:,} each, median of per-statement times:")
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = psycopg.RawCursor(conn)
        for table in ("plain_jobs", "rot_jobs", "plain_jobs", "rot_jobs"):
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                cur.execute(INSERT.format(t=table), ("{}",), prepare=True)
                ts.append(time.perf_counter() - t0)
            print(f"     {table:10} {statistics.median(ts) * 1e6:7.0f} us")


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB}")
        conn.execute(f"CREATE DATABASE {DB}")
    dsn = make_conninfo(base, dbname=DB)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(conn.execute("SELECT version()").fetchone()[0])
            conn.execute(PLAIN)
            conn.execute(ROTATING)
        locks(dsn)
        insert_latency(dsn)
        drain(dsn)
        seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 70
        rate = float(sys.argv[3]) if len(sys.argv) > 3 else 8000.0
        print(
            f"3. {seconds} s at a fixed offered rate, 2 consumers;"
            " rotation every 2 s for the partitioned layout:"
        )
        soak(dsn, "plain_jobs", seconds, rate, 10, 2.0)
        soak(dsn, "rot_jobs", seconds, rate, 10, 2.0)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


if __name__ == "__main__":
    main()
