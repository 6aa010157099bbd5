"""The testing kit: a fresh database per test, draining jobs through the real worker, assertions.

Nothing here fakes the database. A test's jobs are real rows in a real
PostgreSQL (FASTJOBS_TEST_DSN, else an embedded server started once per
process), in a database cloned from a template migrated once per process;
`Testing.drain` runs them through the worker's own hot loop and executor, so
retries, Snooze, Cancel, timeouts and middleware behave as in production.

The pytest plugin (`_fastjobs_pytest`) turns this into fixtures; the module itself needs no
pytest. Importing `fastjobs` does not import it: `App.testing` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import orjson
import psycopg

from . import database, enqueue, maintenance, schema, sql
from .context import JobContext, _async_job, _thread
from .errors import FastjobsError
from .executor import Executor
from .impl import core
from .sandbox import Databases, databases
from .types import ArgsSchema, JobState

if TYPE_CHECKING:
    from .app import App
    from .job import Job

__all__ = [
    "Databases",
    "Drained",
    "EnqueuedJob",
    "Mode",
    "Testing",
    "databases",
]


def __dir__() -> list[str]:
    return sorted(__all__)  # what help() and completion show: the public names only


logger = logging.getLogger(__name__)

Mode = Literal["manual", "inline"]
MODES: tuple[Mode, ...] = ("manual", "inline")

# What `enqueued` and the assertions look at unless given `state=`: jobs waiting to run.
PENDING = (JobState.AVAILABLE, JobState.SCHEDULED, JobState.RETRYABLE)

# The most jobs one drain runs before it concludes something requeues itself forever.
DRAIN_LIMIT = 10_000

# The worker id a drain's claims carry (attempted_by).
WORKER_ID = "fastjobs-testing"

T = TypeVar("T")


# --- Databases ---------------------------------------------------------------


# --- The kit -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnqueuedJob:
    """A job row as the assertions see it."""

    id: int
    kind: str
    queue: str
    args: dict[str, Any]
    priority: int
    state: str
    run_at: dt.datetime
    attempt: int
    max_attempts: int
    errors: list[dict[str, Any]] | None
    unique_key: str | None


@dataclass(frozen=True, slots=True)
class Drained:
    """What one drain did: attempts by outcome (a job retried twice, then completed, counts in both)."""

    completed: int = 0
    retried: int = 0
    discarded: int = 0
    cancelled: int = 0
    snoozed: int = 0


class Testing:
    """The testing kit bound to an App: `app.testing(mode=...)`, or the `fastjobs_testing` fixture.

    As a context manager it points the app at `dsn` (when given) and, in
    `inline` mode, makes every enqueue run its job; on exit the app is as it
    was. `manual` mode changes nothing about enqueueing: jobs wait in the
    table until `drain` runs them.
    """

    def __init__(self, app: App, mode: Mode = "manual", *, dsn: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"testing mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.app = app
        self.mode = mode
        self._dsn = dsn
        self._saved: tuple[str | None, Testing | None] | None = None
        self._draining = False
        self._listening: weakref.WeakSet[Any] = weakref.WeakSet()
        self._inline_error: BaseException | None = None

    # -- as a context manager

    def __enter__(self) -> Testing:
        app = self.app
        self._saved = (app._dsn, app._testing)
        if self._dsn is not None:
            app.configure(dsn=self._dsn)
            if app.schema is not None:  # the kit's databases are migrated without it
                with database.connect(self._dsn) as conn:
                    schema.migrate(conn, schema=app.schema)
        app._testing = self if self.mode == "inline" else None
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._saved is not None, "exit without enter"
        dsn, previous = self._saved
        app = self.app
        app._testing = previous
        for conn in list(self._listening):
            with contextlib.suppress(ValueError):
                conn.remove_notify_handler(self._on_notify)
        self._listening = weakref.WeakSet()
        if self._dsn is not None:
            app.close()
            app._dsn = dsn
        error, self._inline_error = self._inline_error, None
        if error is not None and kind is None:
            raise error

    # -- running jobs

    def drain(
        self,
        queue: str | list[str] | None = None,
        now: dt.datetime | dt.timedelta | None = None,
        *,
        limit: int = DRAIN_LIMIT,
    ) -> Drained:
        """Run every job that is due, and those they make due, until none is left; what ran.

        Jobs run through the worker's own hot loop (the implementation in
        use) and executor, with the app's middleware: a failure is retried
        with its backoff, Snooze and Cancel act, timeouts apply. A retried or
        snoozed job is due again only once its run_at passes. `now` (a
        datetime, or a timedelta from the present) moves time forward for
        the drain: jobs due by then run, in the order they would have, their
        run_at moved back by the difference; with it, a job failing every
        time runs until it is discarded. `queue` drains one queue (or a list);
        by default every queue but those only kinds declared as handled
        elsewhere (`app.declare`) use, which are left to their service.
        Sync jobs run one at a time on this thread, threads or not in
        production (`--queues name:N`). More than `limit` jobs run raises:
        something requeues itself forever.
        """
        if isinstance(now, dt.timedelta):
            now = dt.datetime.now(dt.UTC) + now
        if now is not None and (now.tzinfo is None or now.utcoffset() is None):
            raise ValueError("now must carry a timezone (a naive datetime is ambiguous)")
        queues = [queue] if isinstance(queue, str) else (list(queue) if queue is not None else None)
        return _off_the_event_loop(lambda: self._drain(queues, now, limit))

    def _drain(self, queues: list[str] | None, now: dt.datetime | None, limit: int) -> Drained:
        totals = dict.fromkeys(("completed", "retried", "discarded", "cancelled", "snoozed"), 0)
        ran = 0
        executor = Executor()
        executor.worker = WORKER_ID
        saved = (getattr(_thread, "job", None), getattr(_thread, "executor", None))
        # The queues of kinds handled elsewhere alone (app.declare): the app's workers never serve them.
        app = self.app
        elsewhere = {s.queue for s in app.declared.values()} - {s.queue for s in app.jobs.values()}
        executor.bind()
        self._draining = True
        try:
            while True:
                # A fresh connection per round: the loop prepares its
                # statements under fixed names, once per session.
                with database.connect(self.app.dsn, autocommit=True) as conn:
                    sql = self.app.sql  # the statements of the app's schema
                    with psycopg.RawCursor(conn) as cur:
                        if now is not None:
                            (shift,) = cur.execute(sql.testing_shift_due, (now, queues)).fetchone() or (None,)
                            if shift is not None:  # the clock moved to the next job: less of it is left
                                now -= dt.timedelta(seconds=shift)
                        maintenance.schedule_once(conn, sql=sql)
                        due = [row[0] for row in cur.execute(sql.testing_queues_due, (queues,))]
                        if queues is None:
                            due = [queue for queue in due if queue not in elsewhere]
                        if not due:
                            break
                        # A worker's settings, after the kit's own statements:
                        # with seq scans off, the shift's would cost enough to be JIT-compiled.
                        cur.execute(sql.worker_session)
                    loop = core.BatchLoop(
                        conn,
                        self.app.runnable(),
                        executor,
                        WORKER_ID,
                        due,
                        batch_max=100,
                        overlap=False,
                        sql=sql,
                    )
                    loop.prepare()
                    try:
                        while n := loop.step():
                            ran += n
                            if ran > limit:
                                raise FastjobsError(
                                    f"drain ran {limit} jobs and more are due: does a job requeue"
                                    " itself (Snooze, an enqueue of its own kind) forever?"
                                )
                    finally:
                        loop.finish()
                    cancelled = loop.failed - loop.retried - loop.discarded
                    totals["completed"] += loop.completed
                    totals["retried"] += loop.retried
                    totals["discarded"] += loop.discarded
                    totals["cancelled"] += cancelled
                    totals["snoozed"] += loop.claimed - loop.completed - loop.failed
        finally:
            self._draining = False
            executor.close()
            _thread.job, _thread.executor = saved
        return Drained(**totals)

    def run_job(self, job: Job[..., Any] | str, /, **args: Any) -> Any:
        """Call one job's handler with `args` as a worker would pass them; its result.

        The args go through the checks and the JSON encoding of an enqueue
        and back, so an argument that cannot be stored raises TypeError here
        as it would in production, and the handler sees what it would get
        (a tuple arrives as a list). Middleware applies. No row is written;
        what the handler raises (Retry, Snooze, Cancel included) propagates.
        An async handler runs to completion (on an event loop of its own
        when called from one: `run_job_async` runs it on the caller's).
        """
        spec, decoded = self._prepare(job, args)
        context = JobContext(_RUN_JOB_ID, spec.kind, 1)
        if spec.is_async:
            return _off_the_event_loop(lambda: asyncio.run(_with_context(context, spec.target, decoded)))
        saved = getattr(_thread, "job", None)
        _thread.job = context
        try:
            return spec.target(**decoded)
        finally:
            _thread.job = saved

    async def run_job_async(self, job: Job[..., Any] | str, /, **args: Any) -> Any:
        """`run_job` on the running event loop (an async handler's resources may be bound to it)."""
        spec, decoded = self._prepare(job, args)
        context = JobContext(_RUN_JOB_ID, spec.kind, 1)
        if spec.is_async:
            return await _with_context(context, spec.target, decoded)
        return self.run_job(job, **args)

    def _prepare(self, job: Job[..., Any] | str, args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        kind = _kind(job)
        spec = self.app.runnable().get(kind)
        if spec is None:
            raise ValueError(f"no handler registered for job kind {kind!r} in this App")
        params = enqueue.insert_params(enqueue.options(kind, spec), args)
        with self.app.connection() as conn:
            return spec, _through_jsonb(conn, params.args)

    # -- looking at what was enqueued

    def enqueued(
        self,
        kind_or_job: Job[..., Any] | str | None = None,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        state: str | JobState | list[str] | list[JobState] | None = None,
    ) -> list[EnqueuedJob]:
        """The jobs matching every criterion given, oldest first.

        `args` matches when each of its keys is among the job's args with
        that value (compared after the JSON round trip the job's args made;
        for a kind with typed arguments, a value may be given as the enqueue
        took it, a dataclass or a Decimal, and matches the stored argument as
        its handler gets it; or in its stored JSON form).
        By default only jobs waiting to run (available, scheduled, retryable)
        are looked at; `state` names others.
        """
        return self._match(kind_or_job, args, queue, priority, state)[0]

    def assert_enqueued(
        self,
        kind_or_job: Job[..., Any] | str | None = None,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        count: int | None = None,
        state: str | JobState | list[str] | list[JobState] | None = None,
    ) -> list[EnqueuedJob]:
        """Fail unless a job matches (exactly `count` of them, if given); the matching jobs.

        The failure lists the jobs closest to what was expected.
        """
        __tracebackhide__ = True  # pytest shows the test's line, not the kit's
        found, candidates, wanted = self._match(kind_or_job, args, queue, priority, state)
        if (len(found) == count) if count is not None else found:
            return found
        expected = f"{count} job(s)" if count is not None else "a job"
        raise AssertionError(
            f"expected {expected} {wanted}, found {len(found)}" + _closest(candidates, found)
        )

    def refute_enqueued(
        self,
        kind_or_job: Job[..., Any] | str | None = None,
        *,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        state: str | JobState | list[str] | list[JobState] | None = None,
    ) -> None:
        """Fail if any job matches; the failure lists those that do."""
        __tracebackhide__ = True
        found, _, wanted = self._match(kind_or_job, args, queue, priority, state)
        if found:
            lines = "".join(f"\n  {_describe(job)}" for job in found[:_SHOWN])
            raise AssertionError(f"expected no job {wanted}, found {len(found)}:{lines}")

    def _match(
        self,
        kind_or_job: Job[..., Any] | str | None,
        args: Mapping[str, Any] | None,
        queue: str | None,
        priority: int | None,
        state: str | JobState | list[str] | list[JobState] | None,
    ) -> tuple[list[EnqueuedJob], list[EnqueuedJob], str]:
        states = [str(s) for s in ([state] if isinstance(state, str) else (state or PENDING))]
        for s in states:
            JobState(s)  # an unknown state fails here, naming it
        kind = _kind(kind_or_job) if kind_or_job is not None else None
        if kind is not None:
            # A kind this App could not enqueue (a typo) is refused as at enqueue: else
            # refute_enqueued("send_welcom") would pass whatever the code under test did.
            self.app._spec(kind)
        with self.app.connection() as conn, psycopg.RawCursor(conn) as cur:
            expected = (
                _through_jsonb(conn, _dumps(self._stored(kind, args), kind)) if args is not None else None
            )
            rows = cur.execute(self.app.sql.testing_jobs_in_states, (states,)).fetchall()
        jobs = [EnqueuedJob(*row) for row in rows]
        given = dict(args) if args is not None else None  # as the test wrote them
        spec = self.app.jobs.get(kind) if kind is not None else None
        same = _same_as_given(spec.args_schema if spec is not None else None, given)

        def misses(job: EnqueuedJob) -> int:
            return _missed(job, kind, expected, queue, priority, same)

        found = [job for job in jobs if misses(job) == 0]
        criteria = {"kind": kind, "args": given, "queue": queue, "priority": priority}
        wanted = ", ".join(f"{k}={v!r}" for k, v in criteria.items() if v is not None)
        wanted = f"({wanted}) in state {'/'.join(states)}" if wanted else f"in state {'/'.join(states)}"
        if not found:
            # Fewest criteria missed first (each argument is one), then the newest.
            jobs.sort(key=lambda job: (misses(job), -job.id))
        return found, jobs, wanted

    def _stored(self, kind: str | None, args: Mapping[str, Any]) -> dict[str, Any]:
        """`args` in the form an enqueue of `kind` stores them: each value through the kind's
        annotations (a dataclass, Decimal, set, datetime as the enqueue converted it); a value
        they refuse is taken as given, already in its stored JSON form ("10.50" for a Decimal)."""
        spec = self.app.jobs.get(kind) if kind is not None else None
        schema = spec.args_schema if spec is not None else None
        if schema is None:
            return dict(args)
        stored: dict[str, Any] = {}
        for name, value in args.items():
            try:
                stored.update(schema.encode({name: value}))
            except (TypeError, ValueError):
                stored[name] = value
        return stored

    # -- inline mode

    def inserted(self, conn: psycopg.Connection[Any] | None) -> None:
        """App's hook after an inline-mode enqueue: run the job now, or once `conn` commits."""
        if self._draining:
            return  # enqueued by a job the drain is running: it runs in this drain
        if conn is None or conn.autocommit or not _in_transaction(conn):
            self._run_inline()
            return
        # Inside the caller's transaction: a notification reaches sessions
        # listening (this one included) only if it commits, and psycopg hands
        # it to the handler while processing the COMMIT. A LISTEN made in a
        # transaction that rolls back is undone with it. The jobs run while
        # psycopg holds `conn`'s lock: a handler using this very connection
        # object would wait forever (docs/guides/testing.md says so).
        conn.execute(self.app.sql.listen_jobs)
        conn.execute(self.app.sql.testing_notify_commit)
        if conn not in self._listening:
            conn.add_notify_handler(self._on_notify)
            self._listening.add(conn)

    async def inserted_async(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        """`inserted` for an async enqueue."""
        if self._draining:
            return
        if conn is None or conn.autocommit or not _in_transaction(conn):
            self._run_inline()
            return
        await conn.execute(self.app.sql.listen_jobs)
        await conn.execute(self.app.sql.testing_notify_commit)
        if conn not in self._listening:
            conn.add_notify_handler(self._on_notify)
            self._listening.add(conn)

    def _on_notify(self, note: psycopg.Notify) -> None:
        if note.channel == self.app.sql.NOTIFY_CHANNEL and not self._draining and self.app._testing is self:
            try:
                self._run_inline()
            except Exception as exc:  # raised inside the caller's COMMIT, it would break their connection
                logger.exception("the inline run after a commit failed")
                self._inline_error = self._inline_error or exc

    def _run_inline(self) -> None:
        self.drain()


# The id `current_job()` shows inside run_job: the job has no row.
_RUN_JOB_ID = -1

# The most jobs a failed assertion lists.
_SHOWN = 5


def _in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE


def _off_the_event_loop(call: Callable[[], T]) -> T:
    """`call()`, on a thread of its own when this thread runs an event loop.

    The executor runs async handlers on an event loop of its own, which
    cannot run inside the test's; the test's loop waits meanwhile.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # called outside the except block: a handler's error must not chain this one
        return call()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="fastjobs-testing")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def _with_context(context: JobContext, target: Callable[..., Any], args: dict[str, Any]) -> Any:
    _async_job.set(context)  # this coroutine's task's context only
    return await target(**args)


def _kind(job: Any) -> str:
    if isinstance(job, str):
        return job
    kind = getattr(job, "kind", None)
    if not isinstance(kind, str):
        raise TypeError(f"name a job by its kind or the handle @app.job returned, not {job!r}")
    return kind


def _dumps(args: Mapping[str, Any], kind: str | None) -> str:
    try:
        return orjson.dumps(dict(args)).decode()
    except TypeError as exc:
        hint = "; name the job's kind for its annotations to convert them" if kind is None else ""
        raise TypeError(f"args={args!r} could never match: they cannot be stored ({exc}){hint}") from None


def _through_jsonb(conn: psycopg.Connection[Any], data: str) -> dict[str, Any]:
    """JSON object text as a worker gets it back from the jobs table's jsonb."""
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.testing_args_round_trip, (data,)).fetchone()
    assert row is not None
    value = orjson.loads(row[0])
    assert isinstance(value, dict)
    return value


def _same_as_given(
    args_schema: ArgsSchema | None, given: dict[str, Any] | None
) -> Callable[[str, Any], bool]:
    """Whether a stored argument, converted as its handler gets it, equals the test's value: a set
    matches whatever order it was stored in."""
    if args_schema is None or given is None:
        return lambda name, stored: False

    def same(name: str, stored: Any) -> bool:
        try:
            return bool(args_schema.decode(name, stored) == given[name])
        except Exception:  # it does not convert (InvalidArguments), or its __eq__ fails: no match
            return False

    return same


def _missed(
    job: EnqueuedJob,
    kind: str | None,
    args: dict[str, Any] | None,
    queue: str | None,
    priority: int | None,
    same: Callable[[str, Any], bool],
) -> int:
    """How many of the criteria `job` fails (an argument key each): an argument matches in its
    stored JSON form, or converted as its handler gets it (`same`)."""
    missed = (kind is not None and job.kind != kind) + (queue is not None and job.queue != queue)
    missed += priority is not None and job.priority != priority
    if args is not None:
        for key, value in args.items():
            if key not in job.args or (job.args[key] != value and not same(key, job.args[key])):
                missed += 1
    return int(missed)


def _closest(candidates: list[EnqueuedJob], found: list[EnqueuedJob]) -> str:
    """The jobs a failed assertion shows: those found, or the candidates closest first."""
    if found:
        return ":" + "".join(f"\n  {_describe(job)}" for job in found[:_SHOWN])
    if not candidates:
        return "; no job at all was in those states"
    lines = "".join(f"\n  {_describe(job)}" for job in candidates[:_SHOWN])
    more = f"\n  ... and {len(candidates) - _SHOWN} more" if len(candidates) > _SHOWN else ""
    return f"; the closest jobs that were enqueued:{lines}{more}"


def _describe(job: EnqueuedJob) -> str:
    return (
        f"#{job.id} {job.kind} args={job.args!r} queue={job.queue!r} priority={job.priority}"
        f" state={job.state} attempt={job.attempt}/{job.max_attempts}"
    )
