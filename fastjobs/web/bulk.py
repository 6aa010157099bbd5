"""The dashboard's operations by filter: retry, cancel, discard or delete every job a filter matches.

The jobs are those of `fastjobs jobs retry|cancel|discard --state/--queue/...`,
through the same code: a selection (control.select), counted a bounded page
per statement (control.count), then each job through the same single-job
operation (control.act_by_filter: pages of control.SELECT_PAGE ids, each job
in a transaction of its own), from a thread of the server, so a page can
show how far it is. No job enqueued after the selection is acted on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import psycopg

from .. import control
from .reads import Filters

__all__ = ["MAX_ERRORS", "MAX_OPERATIONS", "Connect", "Operation", "Operations"]

logger = logging.getLogger(__name__)

# The messages of jobs that could not be acted on, kept per operation (the rest are counted).
MAX_ERRORS = 20
# The operations a server remembers (the oldest finished ones are forgotten first).
MAX_OPERATIONS = 50


@dataclass(slots=True)
class Operation:
    """One operation by filter and how far it is; read by the progress page while its thread runs."""

    id: int
    action: str
    filters: Filters
    started: float = field(default_factory=time.time)
    selected: int | None = None  # jobs matched (None: still selecting)
    done: int = 0  # jobs acted on so far, whatever the outcome
    states: dict[str, int] = field(default_factory=dict)  # the jobs' states after, counted
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    finished: float | None = None
    stop: bool = False  # asked to stop: the jobs not yet reached are left as they are
    crashed: str | None = None

    @property
    def running(self) -> bool:
        return self.finished is None


Connect = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


class Operations:
    """The operations of one dashboard: started, run on threads, looked up by id."""

    def __init__(self, connect: Connect, catalogue: Callable[[], ModuleType]) -> None:
        self._connect = connect
        self._sql = catalogue  # the statements of the app's schema (App.sql), as of each operation
        self._lock = threading.Lock()
        self._ids: Iterator[int] = itertools.count(1)
        self._operations: dict[int, Operation] = {}

    def start(self, action: str, filters: Filters) -> Operation:
        if action not in control.ACTS_ON:
            raise ValueError(f"no operation {action!r}: one of {', '.join(control.ACTS_ON)}")
        with self._lock:
            operation = Operation(next(self._ids), action, filters)
            self._operations[operation.id] = operation
            done = [o.id for o in self._operations.values() if not o.running]
            for old in done[: max(len(self._operations) - MAX_OPERATIONS, 0)]:
                del self._operations[old]
        threading.Thread(
            target=self._run, args=(operation,), name=f"fastjobs-web-{action}", daemon=True
        ).start()
        return operation

    def get(self, operation_id: int) -> Operation | None:
        with self._lock:
            return self._operations.get(operation_id)

    def _run(self, op: Operation) -> None:
        f = op.filters
        states = control.ACTS_ON[op.action]
        if f.state is not None:
            states = states & {f.state}
        sql = self._sql()
        try:
            with self._connect() as conn:
                selection = control.select(conn, states, queue=f.queue, kind=f.kind, args=f.args, sql=sql)
                op.selected = control.count(conn, selection, sql)
                logger.info("dashboard: %s of %d jobs (%s)", op.action, op.selected, f.describe())
                for acted in control.act_by_filter(conn, op.action, selection, sql):
                    if acted.state is None:
                        op.failed += 1
                        if len(op.errors) < MAX_ERRORS:
                            op.errors.append(acted.error)
                    else:
                        op.states[acted.state] = op.states.get(acted.state, 0) + 1
                    op.done += 1
                    if op.stop:
                        break
        except Exception as exc:  # the database went away: said on the page and in the log
            logger.exception("dashboard: %s by filter (%s) failed", op.action, f.describe())
            op.crashed = f"{type(exc).__name__}: {exc}"
        finally:
            op.finished = time.time()
