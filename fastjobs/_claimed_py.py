"""The Python loop's reading of a claim's result: the claimed jobs, then the rows after them (a
stale outcome's, the slot row of a claim after the mark), and what the planner learns of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from . import outcomes
from .abc import (
    COL_ARGS,
    COL_ATTEMPT,
    COL_CREATED_AT,
    COL_ID,
    COL_KEEP_RESULT,
    COL_KIND,
    COL_MAX_ATTEMPTS,
    COL_META,
    COL_PRIORITY,
    COL_RUN_AT,
)

if TYPE_CHECKING:
    from ._core_py import BatchLoop, Row


def _int(value: bytes) -> int:
    return int.from_bytes(value, "big", signed=True)


def _claimed(self: BatchLoop, res: Any) -> int:
    """How many rows of `res` are claimed jobs; the stale outcomes after them are counted and
    logged, and the slot row a claim after the mark ends with (sql._slot_row) goes to the planner."""
    n = res.ntuples
    if n and res.get_value(n - 1, COL_KIND) is None and res.get_value(n - 1, COL_ARGS) is None:
        n -= 1
        slot, at = _int(res.get_value(n, COL_ATTEMPT)), _int(res.get_value(n, COL_RUN_AT))
        self.planner.slots(slot, at, self._sent_slot)
    elif self._sent_slot:  # a claim in one slot returns none while its slot is current
        self.planner.slots(0, 0, self._sent_slot)
    self._sent_slot = 0
    if n and res.get_value(n - 1, COL_KIND) is None:
        stale = []
        while n and res.get_value(n - 1, COL_KIND) is None:
            n -= 1
            state = orjson.loads(res.get_value(n, COL_ARGS)[1:])
            stale.append((_int(res.get_value(n, COL_ID)), _int(res.get_value(n, COL_ATTEMPT)), state))
            if state == "completed":
                self.completed -= 1
        self.stale += len(stale)
        outcomes.say_stale(stale[::-1])
    return int(n)


def _rows_of(self: BatchLoop, res: Any, n: int) -> list[Row]:
    """The first `n` rows of `res`, the claimed jobs, as the loop runs them (Row)."""
    rows: list[Row] = []
    for i in range(n):
        claimed = None
        if self._whole_context:
            meta, created = res.get_value(i, COL_META), _int(res.get_value(i, COL_CREATED_AT))
            claimed = (meta, created, _int(res.get_value(i, COL_RUN_AT)))
        rows.append(
            (
                _int(res.get_value(i, COL_ID)),
                res.get_value(i, COL_KIND).decode(),
                res.get_value(i, COL_ARGS),
                _int(res.get_value(i, COL_ATTEMPT)),
                _int(res.get_value(i, COL_MAX_ATTEMPTS)),
                _int(res.get_value(i, COL_RUN_AT)),
                claimed,
                res.get_value(i, COL_KEEP_RESULT) is not None,
            )
        )
    return rows


def _plan(self: BatchLoop, res: Any, rows: list[Row]) -> None:
    """Tell the planner what the claim found: how many, where it ended, whether one keeps its result.

    Where it ended: its lowest priority, and the latest run_at within it.
    """
    lowest, latest = 1 << 15, 0
    for i in range(len(rows)):
        priority, run_at = _int(res.get_value(i, COL_PRIORITY)), _int(res.get_value(i, COL_RUN_AT))
        if priority < lowest:
            lowest, latest = priority, run_at
        elif priority == lowest and run_at > latest:
            latest = run_at
    self.planner.claimed(len(rows), lowest, latest, any(row[7] for row in rows))
