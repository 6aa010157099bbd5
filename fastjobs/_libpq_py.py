"""The Python loop's libpq calls: a statement sent, the socket waited on, its results read (`_core.pyx`
makes the same calls through its `cdef extern` block)."""

from __future__ import annotations

import select
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from . import outcomes
from .errors import LoopError

if TYPE_CHECKING:
    from ._core_py import BatchLoop


def _wait(pgconn: Any, write: bool = False) -> None:
    fd = pgconn.socket
    if write:
        select.select([fd], [fd], [])
    else:
        select.select([fd], [], [])


def _lost(self: BatchLoop) -> LoopError:
    """The error of a failed libpq call: libpq's message, without psycopg's prefix (as in C)."""
    self._in_flight = False
    return LoopError(self._pgconn.error_message.decode(errors="replace"))


def _prepare(self: BatchLoop, name: bytes, text: str) -> None:
    try:
        res = self._pgconn.prepare(name, text.encode())
    except psycopg.OperationalError:
        raise self._lost() from None
    if res.status != pq.ExecStatus.COMMAND_OK:
        raise LoopError(res.error_message.decode(errors="replace"))


def _send_prepared(self: BatchLoop, name: bytes, params: list[bytes]) -> None:
    try:
        self._pgconn.send_query_prepared(name, params, result_format=1)
        while self._pgconn.flush():
            _wait(self._pgconn, write=True)
            self._pgconn.consume_input()
    except psycopg.OperationalError:
        raise self._lost() from None


_DONE = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


def _simple(self: BatchLoop, text: str) -> None:
    """Run statements without parameters (the fast lane's BEGIN, COMMIT, ROLLBACK; sql.plan_ahead's)."""
    try:
        self._pgconn.send_query(text.encode())
        while self._pgconn.flush():
            _wait(self._pgconn, write=True)
            self._pgconn.consume_input()
        error = None
        while True:
            self._pgconn.consume_input()
            while self._pgconn.is_busy():
                _wait(self._pgconn)
                self._pgconn.consume_input()
            res = self._pgconn.get_result()
            if res is None:
                break
            if res.status not in _DONE and error is None:
                error = res.error_message.decode(errors="replace")
    except psycopg.OperationalError:
        raise self._lost() from None
    if error is not None:
        raise LoopError(error)


def _results(self: BatchLoop) -> tuple[Any, str | None, bool]:
    """The in-flight statement's result: (rows, None, _) or (None, error, whether an outcome is why)."""
    pgconn = self._pgconn
    result = None
    error = None
    isolatable = False
    try:
        pgconn.consume_input()
        while True:
            while pgconn.is_busy():
                _wait(pgconn)
                pgconn.consume_input()
            res = pgconn.get_result()
            if res is None:
                break
            if res.status == pq.ExecStatus.TUPLES_OK:
                result = res
            elif error is None:
                error = res.error_message.decode(errors="replace")
                state = res.error_field(pq.DiagnosticField.SQLSTATE) or b""
                isolatable = state[:2].decode() in outcomes.OUTCOME_ERROR_CLASSES
    except psycopg.OperationalError:
        raise self._lost() from None
    self._in_flight = False
    if error is None and result is None:
        error = pgconn.error_message.decode(errors="replace")
    return (None if error is not None else result), error, isolatable
