"""Plain types shared by every module: job states, the registered job spec, the outcome record."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, Protocol, TypedDict

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_PRIORITY",
    "DEFAULT_QUEUE",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "ArgsSchema",
    "JobSpec",
    "JobState",
    "KeyLimit",
    "Outcome",
    "OutcomeKind",
]

PRIORITY_MIN = -32768  # the column is a smallint
PRIORITY_MAX = 32767
MAX_ATTEMPTS_LIMIT = 32767
# A job's defaults (JobSpec's, `@app.job`'s and an enqueue's of an unregistered
# kind); the jobs table's column defaults in migrations/001 are the same
# (tests/test_migrations.py checks).
DEFAULT_QUEUE = "default"
DEFAULT_PRIORITY = 0
DEFAULT_MAX_ATTEMPTS = 25  # Sidekiq's and River's default: about three weeks of backoff


class JobState(enum.StrEnum):
    """The `fastjobs_state` enum of the jobs table."""

    AVAILABLE = "available"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    RETRYABLE = "retryable"
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"


class ArgsSchema(Protocol):
    """A handler's annotations compiled (fastjobs.typed.Schema): checks and converts its jobs' arguments."""

    def encode(self, args: Any, row: int | None = None) -> Any:
        """One job's arguments in their JSON form; TypeError or ValueError naming what does not fit."""

    def encode_rows(self, rows: Any) -> Any:
        """`encode` over an iterable of argument dicts, naming the row of a bad one."""

    def decode(self, name: str, value: Any) -> Any:
        """One stored argument as its handler gets it; InvalidArguments if it does not convert."""


@dataclass(frozen=True, slots=True)
class KeyLimit:
    """A kind's limits per key (`@app.job(concurrency_key=..., concurrency_limit=..., rate_limit=...)`),
    stored on each of its jobs at enqueue (fastjobs.keys)."""

    # What its jobs are counted by: an argument's name, a callable of the args (a dict), or None:
    # the kind as a whole.
    key: str | Callable[[dict[str, Any]], Any] | None
    concurrency: int | None  # at most this many of its jobs with one key running at once
    rate: float | None  # at most this many of its jobs with one key started per second


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A handler registered with `@app.job`, and the defaults of its jobs."""

    kind: str
    func: Callable[..., Any]
    queue: str = DEFAULT_QUEUE
    priority: int = DEFAULT_PRIORITY
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    timeout: float | None = None
    is_async: bool = False
    # Argument names the handler accepts; None when it takes **kwargs.
    params: frozenset[str] | None = None
    required: frozenset[str] = field(default_factory=frozenset)
    # Seconds to wait after failed attempt n, given a uniform random number in [0, 1).
    retry: Callable[[int, float], float] | None = None
    # Derive a unique key from the args: True (all of them) or these argument names.
    unique: bool | tuple[str, ...] = False
    # A cron expression: the leader enqueues this kind (with no args) at each tick.
    cron: str | None = None
    # The IANA time zone the cron expression is read in (None: UTC).
    tz: str | None = None
    # What the hot loops and the executor call instead of `func` when set: the
    # handler behind the app's middleware and argument conversion, built once
    # per worker by App.runnable (None: `func` itself, at no cost per job).
    call: Callable[..., Any] | None = None
    # The handler's annotations, checked at enqueue (None: it has none).
    args_schema: ArgsSchema | None = None
    # Seconds its jobs keep their outcome in fastjobs_results (None: not kept).
    keep_result: int | None = None
    # Its concurrency and rate limits per key or for the kind as a whole (None: none).
    limit: KeyLimit | None = None
    # Its jobs' fairness key: an argument's name, or a callable of the args dict (None: no key).
    fair_key: str | Callable[[dict[str, Any]], object] | None = None

    @property
    def target(self) -> Callable[..., Any]:
        """The callable a worker runs for this kind's jobs."""
        return self.func if self.call is None else self.call


# What happened to an attempt, as its record says: the names of fastjobs.abc.OUTCOMES (what the
# counters count), and a release, a job given back unstarted (counted nowhere).
OutcomeKind = Literal["completed", "retried", "discarded", "cancelled", "snoozed", "released"]


class Outcome(TypedDict):
    """One record of a batch's outcomes: an element of $2 of the finish statements (fastjobs.sql,
    _outcomes), which read id, attempt, state, delay, uncount and error and ignore `outcome`, there
    for the worker's counters and logs. The statement may end the job otherwise than `state` says:
    cancelled when that was requested, discarded after a failed last attempt."""

    outcome: OutcomeKind
    id: int
    attempt: int  # the attempt that produced it: the statement applies it only to that attempt
    state: str
    delay: float | None  # seconds from when the statement writes it; None keeps run_at
    uncount: int  # 1 gives the attempt back (snoozed, released)
    error: dict[str, Any] | None  # appended to the job's errors
    result: NotRequired[Any]  # a kept return value, as an orjson.Fragment (keep_result only)
