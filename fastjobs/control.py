"""Job control: cancel, retry, discard and inspect single jobs (the `fastjobs jobs` commands)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import sql
from .errors import JobNotFound


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
    """Every column of one job."""
    with psycopg.RawCursor(conn, row_factory=dict_row) as cur:
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
    """Jobs matching the filters, newest first."""
    with psycopg.RawCursor(conn, row_factory=dict_row) as cur:
        return cur.execute(sql.job_list, (queue, state, kind, limit)).fetchall()
