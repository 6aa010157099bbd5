"""Job control: cancel, retry, discard and inspect jobs, one or by filter (the `fastjobs jobs` commands)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.rows import dict_row, tuple_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import Jsonb

from . import sql
from .errors import FastjobsError, JobNotFound

__all__ = [
    "ACTS_ON",
    "CANCELLABLE",
    "COUNT_PAGE",
    "DELETABLE",
    "DISCARDABLE",
    "MOVED_RETRIES",
    "RETRIABLE",
    "SELECT_PAGE",
    "Acted",
    "Retried",
    "Selection",
    "act",
    "act_by_filter",
    "cancel",
    "count",
    "delete",
    "discard",
    "inspecting",
    "kinds",
    "list_jobs",
    "pages",
    "retry",
    "select",
    "show",
]


class _LenientTimestamptzLoader(Loader):
    """A timestamptz as a datetime, or as PostgreSQL's text when a datetime cannot hold it.

    The schema allows any run_at (a row written by hand may say -infinity,
    infinity, 44 BC or the year 294276); psycopg refuses to load those, and
    one such row would otherwise make every listing that includes it fail.
    """

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._exact = TimestamptzLoader(oid, context)

    def load(self, data: Buffer) -> Any:
        try:
            return self._exact.load(data)
        except psycopg.DataError:
            return bytes(data).decode()


def inspecting(conn: psycopg.Connection[Any]) -> psycopg.RawCursor[dict[str, Any]]:
    """A cursor returning dicts whose timestamps may be text (see _LenientTimestamptzLoader)."""
    cur = psycopg.RawCursor(conn, row_factory=dict_row)
    cur.adapters.register_loader("timestamptz", _LenientTimestamptzLoader)
    return cur


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.RawCursor[tuple[Any, ...]]:
    """A cursor returning tuples whatever row factory the caller's connection has."""
    return psycopg.RawCursor(conn, row_factory=tuple_row)


def _state(cur: psycopg.RawCursor[Any], job_id: int, sql: ModuleType = sql) -> str:
    row = cur.execute(sql.job_state, (job_id,)).fetchone()
    if row is None:
        raise JobNotFound(f"no job with id {job_id}")
    return str(row[0])


# The rotation moves a job's row to another slot (delete and insert, in one
# transaction: fastjobs.maintenance.rotate_once). A statement that waited for the
# row's lock then finds it deleted and acts on nothing, though the job is
# still there, in a state it acts on: it looks again by id, this many times
# (a row moves at most once per rotation, every couple of seconds).
MOVED_RETRIES = 5

CANCELLABLE = frozenset({"available", "scheduled", "retryable", "running"})
RETRIABLE = frozenset({"discarded", "cancelled", "completed", "retryable", "scheduled"})
DISCARDABLE = frozenset({"available", "scheduled", "retryable", "cancelled"})
DELETABLE = frozenset({"available", "scheduled", "retryable", "completed", "discarded", "cancelled"})
# The states each operation by filter acts on (`fastjobs jobs retry|cancel|discard`, the dashboard's).
ACTS_ON = {"retry": RETRIABLE, "cancel": CANCELLABLE, "discard": DISCARDABLE, "delete": DELETABLE}


def _moved(
    cur: psycopg.RawCursor[Any], job_id: int, acts_on: frozenset[str], tries: int, sql: ModuleType
) -> str | None:
    """After a statement acted on no row of job `job_id`: None when the job is in a state the
    statement acts on (its row was moved meanwhile: try again), else its state."""
    state = _state(cur, job_id, sql)
    return None if state in acts_on and tries < MOVED_RETRIES else state


def cancel(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> str:
    """'cancelled' for a queued job, 'cancelling' for a running one, else its (final) state.

    `sql`: the catalogue of the App's schema (fastjobs.sql.of), as for every function here.
    """
    with _cursor(conn) as cur:
        for tries in range(1, MOVED_RETRIES + 1):
            row = cur.execute(sql.job_cancel, (job_id,)).fetchone()
            if row is not None:
                return "cancelling" if row[0] == "running" else str(row[0])
            state = _moved(cur, job_id, CANCELLABLE, tries, sql)
            if state is not None:
                return state
    raise AssertionError("the last try returns a state")


@dataclass(frozen=True, slots=True)
class Retried:
    """What `retry` did to one job."""

    id: int
    was: str  # its state before
    state: str  # its state now
    attempt: int | None = None  # the attempts it has made (None: the job was left as it was)
    max_attempts: int | None = None  # its limit now
    max_attempts_before: int | None = None  # its limit before, when the retry raised it

    def describe(self) -> str:
        """One line for the operator: what happened to the job."""
        if self.attempt is None:
            return f"job {self.id}: {self.state} already, left as it is"
        line = f"job {self.id}: {self.was}, now {self.state}: runs now as attempt {self.attempt + 1}"
        line += f" of {self.max_attempts}"
        if self.max_attempts_before is not None:
            line += f" (max_attempts raised from {self.max_attempts_before})"
        return line


def retry(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> Retried:
    """Job `job_id` to run now, and what that took.

    A retryable or scheduled job runs now, its attempts as they are. A
    discarded, cancelled or completed job comes back with its error history
    and one attempt to spare: `max_attempts` is raised when it had none left
    (the result says so). An available job is left as it is. A running job,
    or a unique job whose key another pending or running job holds again,
    raises ValueError naming why (the holder).
    """
    with _cursor(conn) as cur:
        tries = 0
        for _ in range(3 + MOVED_RETRIES):
            try:
                with _savepoint(conn):
                    row = cur.execute(sql.job_retry, (job_id,)).fetchone()
            except psycopg.errors.UniqueViolation:
                key, holder = _unique_holder(conn, cur, job_id, sql)
                if holder is None:
                    continue  # the holder finished meanwhile: the key is free again
                raise ValueError(
                    f"job {job_id} cannot be retried: job {holder} ({_state(cur, holder, sql)}) holds its"
                    f" unique key {key!r}; retry it once that job has finished"
                ) from None
            if row is None:
                tries += 1
                state = _moved(cur, job_id, RETRIABLE, tries, sql)
                if state is None:
                    continue
                if state == "available":
                    return Retried(job_id, state, state)
                raise ValueError(f"job {job_id} is {state}: a running job cannot be retried until it ends")
            was, attempt, before, after = str(row[0]), int(row[1]), int(row[2]), int(row[3])
            return Retried(job_id, was, "available", attempt, after, before if after != before else None)
    raise FastjobsError(f"job {job_id}: its unique key kept changing hands; not retried")


def _unique_holder(
    conn: psycopg.Connection[Any], cur: psycopg.RawCursor[Any], job_id: int, sql: ModuleType
) -> tuple[str | None, int | None]:
    """Job `job_id`'s unique key, and the id of the pending or running job holding it (None: no one)."""
    with inspecting(conn) as look:
        job = look.execute(sql.job_get, (job_id,)).fetchone()
    key = None if job is None else job["unique_key"]
    holder = None if key is None else cur.execute(sql.job_get_unique, (key,)).fetchone()
    return key, None if holder is None else int(holder[0])


def _savepoint(conn: psycopg.Connection[Any]) -> Any:
    """A transaction in autocommit, a savepoint inside the caller's: a failed statement leaves it usable."""
    if conn.autocommit or conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        return conn.transaction()
    return contextlib.nullcontext()


def discard(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> str:
    """A job that is not running becomes discarded; returns the new state."""
    with _cursor(conn) as cur:
        for tries in range(1, MOVED_RETRIES + 1):
            row = cur.execute(sql.job_discard, (job_id,)).fetchone()
            if row is not None:
                return str(row[0])
            state = _moved(cur, job_id, DISCARDABLE, tries, sql)
            if state is not None:
                raise ValueError(f"job {job_id} is {state}: running or finished jobs cannot be discarded")
    raise AssertionError("the last try raises")


def delete(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> str:
    """A job that is not running is deleted, with its kept outcome; returns 'deleted'."""
    with _cursor(conn) as cur:
        for tries in range(1, MOVED_RETRIES + 1):
            if cur.execute(sql.job_delete, (job_id,)).fetchone() is not None:
                return "deleted"
            state = _moved(cur, job_id, DELETABLE, tries, sql)
            if state is not None:
                raise ValueError(f"job {job_id} is {state}: a running job cannot be deleted until it ends")
    raise AssertionError("the last try raises")


def act(
    conn: psycopg.Connection[Any], action: str, job_id: int, sql: ModuleType = sql
) -> tuple[str, dict[str, Any]]:
    """Operation `action` (a key of ACTS_ON) on job `job_id`, as one job of an operation by filter:
    the job's state now ("left <state>" when a retry left it as it was) and what to report of it.

    Raises what the single-job operation raises (FastjobsError, ValueError) when the job is running
    now, finished meanwhile, or its unique key is held.
    """
    if action == "retry":
        retried = retry(conn, job_id, sql)
        state = retried.state if retried.attempt is not None else f"left {retried.state}"
        return state, dataclasses.asdict(retried)
    state = {"cancel": cancel, "discard": discard, "delete": delete}[action](conn, job_id, sql)
    return state, {"id": job_id, "state": state}


def show(conn: psycopg.Connection[Any], job_id: int, sql: ModuleType = sql) -> dict[str, Any]:
    """Every column of one job, and its kept outcome (`result`, `result_expires_at`) if it has one;
    a job only among the kept results (its row gone from the jobs table) is shown from there. A
    timestamp a datetime cannot hold comes as PostgreSQL's text."""
    with inspecting(conn) as cur:
        row = cur.execute(sql.job_get, (job_id,)).fetchone()
        kept = cur.execute(sql.result_get, (job_id,)).fetchone()
    if row is None and kept is None:
        raise JobNotFound(f"no job with id {job_id}")
    if row is None:
        assert kept is not None
        expires = kept.pop("expires_at")
        return {**kept, "result_expires_at": expires}
    if kept is not None:
        row["result"], row["result_expires_at"] = kept["result"], kept["expires_at"]
    return row


def list_jobs(
    conn: psycopg.Connection[Any],
    *,
    queue: str | None = None,
    state: str | None = None,
    kind: str | None = None,
    limit: int = 50,
    sql: ModuleType = sql,
) -> list[dict[str, Any]]:
    """Jobs matching the filters, newest first; a run_at a datetime cannot hold comes as PostgreSQL's text."""
    with inspecting(conn) as cur:
        return cur.execute(sql.job_list, (queue, state, kind, limit)).fetchall()


# Ids an operation by filter reads per statement, and jobs it counts per statement.
SELECT_PAGE = 10_000
COUNT_PAGE = 100_000


@dataclass(frozen=True, slots=True)
class Selection:
    """The jobs an operation by filter acts on: in `states`, matching the filters (created more than
    `older_than` ago, their args containing `args` as jsonb's @> does), with an id up to `ceiling`,
    the highest when the selection was made: never a job enqueued after it. `first` is its first
    page of ids, read then: a selection of one page costs one pass over the table, as before."""

    states: tuple[str, ...]
    queue: str | None
    kind: str | None
    older_than: dt.timedelta | None
    args: Any
    ceiling: int
    first: tuple[int, ...] = ()

    def _params(self, after: int, limit: int) -> tuple[Any, ...]:
        contains = None if self.args is None else Jsonb(self.args)
        return (
            list(self.states),
            self.queue,
            self.kind,
            self.older_than,
            after,
            limit,
            contains,
            self.ceiling,
        )

    def _page(self, cur: psycopg.RawCursor[Any], after: int, sql: ModuleType) -> list[int]:
        if not self.states:
            return []
        return [int(row[0]) for row in cur.execute(sql.job_select_many, self._params(after, SELECT_PAGE))]


def select(
    conn: psycopg.Connection[Any],
    states: Iterable[str],
    *,
    queue: str | None = None,
    kind: str | None = None,
    older_than: dt.timedelta | None = None,
    args: Any = None,
    sql: ModuleType = sql,
) -> Selection:
    """The selection of the jobs in `states` matching the filters, as of now, with its first page
    of ids (see Selection)."""
    with _cursor(conn) as cur:
        row = cur.execute(sql.job_id_ceiling).fetchone()
        ceiling = int(row[0]) if row else 0
        selection = Selection(tuple(sorted(states)), queue, kind, older_than, args, ceiling)
        return dataclasses.replace(selection, first=tuple(selection._page(cur, 0, sql)))


def count(conn: psycopg.Connection[Any], selection: Selection, sql: ModuleType = sql) -> int:
    """The jobs `selection` matches: its first page, and those after it now, counted COUNT_PAGE per
    statement (no snapshot held long); no statement when the first page was the last."""
    total = len(selection.first)
    if total < SELECT_PAGE:
        return total
    after = selection.first[-1]
    with _cursor(conn) as cur:
        while True:
            row = cur.execute(sql.job_count_many, selection._params(after, COUNT_PAGE)).fetchone()
            n, last = (int(row[0]), row[1]) if row else (0, None)
            total += n
            if n < COUNT_PAGE or last is None:
                return total
            after = int(last)


def pages(conn: psycopg.Connection[Any], selection: Selection, sql: ModuleType = sql) -> Iterator[list[int]]:
    """The ids `selection` matches, in id order, SELECT_PAGE per statement after its first page:
    each page is read when the one before has been used, so a job is matched in the state it is in
    by then (and `act` names one that left those states meanwhile)."""
    page = list(selection.first)
    with _cursor(conn) as cur:
        while page:
            yield page
            if len(page) < SELECT_PAGE:
                return
            page = selection._page(cur, page[-1], sql)


@dataclass(frozen=True, slots=True)
class Acted:
    """One job of an operation by filter: its state after and report (`act`'s), or why it was not
    acted on (state None: running now, finished meanwhile, its unique key held)."""

    id: int
    state: str | None
    report: dict[str, Any]
    error: str = ""


def act_by_filter(
    conn: psycopg.Connection[Any], action: str, selection: Selection, sql: ModuleType = sql
) -> Iterator[Acted]:
    """Operation `action` (a key of ACTS_ON) on every job of `selection`, one by one through `act`
    (each in its own transaction, the rotation's moves looked after), a page of ids at a time. The
    caller stops by no longer iterating: the jobs not reached are left as they are."""
    for page in pages(conn, selection, sql):
        for job_id in page:
            try:
                state, report = act(conn, action, job_id, sql)
            except (FastjobsError, ValueError) as exc:
                yield Acted(job_id, None, {"id": job_id}, str(exc))
            else:
                yield Acted(job_id, state, report)


def kinds(conn: psycopg.Connection[Any], sql: ModuleType = sql) -> list[tuple[str, str, int]]:
    """Every (queue, kind) the jobs table holds, with its count of pending jobs."""
    with _cursor(conn) as cur:
        return [(str(q), str(k), int(n)) for q, k, n in cur.execute(sql.job_kinds)]
