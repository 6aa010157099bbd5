"""The hot-path implementation, chosen once at import: C (`_core`) or the Python reference.

The C module drives psycopg's connection through libpq directly, which is only
sound when psycopg uses the same system libpq: its `c` or `python`
implementation, not `binary` (which bundles its own). FASTJOBS_IMPL=c|python
forces one; forcing `c` where it cannot run is an error, not a fallback.

Both modules are returned as `abc.Core`: that is where mypy checks each
against the contract (`_core.pyi` standing for the C module).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psycopg

from .abc import Core
from .errors import ConfigurationError

__all__ = ["FALLBACK", "IMPLEMENTATION", "core"]

# Why the Python reference runs though nobody asked for it (None otherwise). Not
# logged here, at import, before anyone could configure logging: `fastjobs` logs it.
FALLBACK: str | None = None


def _choose() -> Core:
    forced = os.environ.get("FASTJOBS_IMPL", "").strip().lower()
    if forced not in ("", "c", "python"):
        raise ConfigurationError(f"FASTJOBS_IMPL must be 'c' or 'python', not {forced!r}")
    if forced == "python":
        from . import _core_py

        return _core_py
    reason = None
    if psycopg.pq.__impl__ == "binary":
        reason = "psycopg's binary implementation bundles its own libpq"
    else:
        try:
            from . import _core

            return _core
        except ImportError as exc:
            reason = f"the C extension is not built ({exc})"
    if forced == "c":
        raise ConfigurationError(f"FASTJOBS_IMPL=c, but {reason}")
    global FALLBACK
    FALLBACK = f"running the Python reference hot path: {reason}"
    from . import _core_py

    return _core_py


if TYPE_CHECKING:
    from . import _core, _core_py
    from .abc import BatchLoop

    def _loops(c: _core.BatchLoop, py: _core_py.BatchLoop) -> list[BatchLoop]:
        return [c, py]  # a mismatch named attribute by attribute (the check above names only the class)


core = _choose()
IMPLEMENTATION: str = core.IMPLEMENTATION
