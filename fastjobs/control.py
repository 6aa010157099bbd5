"""Job control: cancel, retry, discard and inspect single jobs (the `fastjobs jobs` commands)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.rows import dict_row
from psycopg.types.datetime import TimestamptzLoader

from . import sql
from .errors import JobNotFound


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


def _inspecting(conn: psycopg.Connection[Any]) -> psycopg.RawCursor[dict[str, Any]]:
    """A cursor returning dicts whose timestamps may be text (see _LenientTimestamptzLoader)."""
    cur = psycopg.RawCursor(conn, row_factory=dict_row)
    cur.adapters.register_loader("timestamptz", _LenientTimestamptzLoader)
    return cur


def _state(cur: psycopg.RawCursor[Any], job_id: int) -> str:
    row = cur.execute(sql.job_state, (job_id,)).fetchone()
    if row is None:
        raise JobNotFound(f"no job with id {job_id}")
    return str(row[0])


def cancel(conn: psycopg.Connection[Any], job_id: int) -> str:
    """'cancelled' for a queued job, 'cancelling' for a running one, else its (final) state."""
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.job_cancel, (job_id,)).fetchone()
        if row is None:
            return _state(cur, job_id)
        return "cancelling" if row[0] == "running" else str(row[0])


def retry(conn: psycopg.Connection[Any], job_id: int) -> str:
    """A discarded, cancelled or completed job back to available now; returns the new state."""
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.job_retry, (job_id,)).fetchone()
        if row is None:
            state = _state(cur, job_id)
            raise ValueError(
                f"job {job_id} is {state}: only discarded, cancelled or completed jobs can be retried"
            )
        return str(row[0])


def discard(conn: psycopg.Connection[Any], job_id: int) -> str:
    """A job that is not running becomes discarded; returns the new state."""
    with psycopg.RawCursor(conn) as cur:
        row = cur.execute(sql.job_discard, (job_id,)).fetchone()
        if row is None:
            state = _state(cur, job_id)
            raise ValueError(f"job {job_id} is {state}: running or finished jobs cannot be discarded")
        return str(row[0])


def show(conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any]:
    """Every column of one job; a timestamp a datetime cannot hold comes as PostgreSQL's text."""
    with _inspecting(conn) as cur:
        row = cur.execute(sql.job_get, (job_id,)).fetchone()
    if row is None:
        raise JobNotFound(f"no job with id {job_id}")
    return row


def list_jobs(
    conn: psycopg.Connection[Any],
    *,
    queue: str | None = None,
    state: str | None = None,
    kind: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Jobs matching the filters, newest first; a run_at a datetime cannot hold comes as PostgreSQL's text."""
    with _inspecting(conn) as cur:
        return cur.execute(sql.job_list, (queue, state, kind, limit)).fetchall()
