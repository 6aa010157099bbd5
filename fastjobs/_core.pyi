# What Python sees of the C module `_core.pyx`; mypy checks it against fastjobs.abc.Core in impl.py.
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg

from .executor import Executor
from .planner import Planner
from .types import JobSpec

IMPLEMENTATION: str

def dump_args(kind: str, args: Any, params: frozenset[str] | None, required: frozenset[str]) -> bytes: ...
def encode_copy_rows(
    kind: str,
    rows: Iterator[Any],
    prefix: bytes,
    suffix: bytes,
    limit: int,
    params: frozenset[str] | None,
    required: frozenset[str],
) -> tuple[bytes, int]: ...

class BatchLoop:
    claimed: int
    completed: int
    failed: int
    retried: int
    discarded: int
    stale: int
    fast: int
    batch_min: int
    batch_max: int
    overlap: bool
    stopping: bool
    @property
    def planner(self) -> Planner: ...
    @property
    def size(self) -> int: ...
    @property
    def recheck(self) -> float: ...
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        specs: dict[str, JobSpec],
        executor: Executor,
        worker_id: str,
        queues: list[str],
        keep_completed: bool = False,
        batch_min: int = 1,
        batch_max: int = 1000,
        overlap: bool = True,
        progress: memoryview | None = None,
        front_claim_duty: float = ...,
        running: memoryview | None = None,
        counts: memoryview | None = None,
        whole_context: bool = False,
        fast_lane: bool = False,
        sql: ModuleType = ...,
    ) -> None: ...
    def prepare(self, plan_ahead: bool = False) -> None: ...
    def step(self) -> int: ...
    def finish(self) -> None: ...
    def due(self) -> float: ...
    def hand_back(self) -> bool: ...
