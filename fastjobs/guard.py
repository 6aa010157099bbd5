"""The hot loops' guard: one thread per process that hands back what a slow handler's batch holds.

A batch runs its sync jobs one after another on the loop's thread, which is
inside the handler while it runs: only another thread can act meanwhile. The
guard asks every loop, each GUARD_TICK, to hand back what its running handler
holds past its bound (BatchLoop.hand_back: the jobs behind it, the fast
lane's transaction); the loop decides and acts on its own connection, which
its thread does not touch while a handler runs. Loops are held weakly: a loop
no longer used is forgotten.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .abc import GUARD_TICK

__all__ = ["suspended", "watch"]

if TYPE_CHECKING:
    from .abc import BatchLoop

logger = logging.getLogger(__name__)

_loops: weakref.WeakSet[BatchLoop] = weakref.WeakSet()
_lock = threading.Lock()
_pid = 0  # the process whose guard thread runs (a forked child starts its own)
_suspended = 0


@contextmanager
def suspended() -> Iterator[None]:
    """No hand-back while inside: for tests and tools that hold a fast batch open on purpose."""
    global _suspended
    with _lock:
        _suspended += 1
    try:
        yield
    finally:
        with _lock:
            _suspended -= 1


def watch(loop: BatchLoop) -> None:
    """Guard `loop` from now on (its prepare() calls this)."""
    global _pid
    with _lock:
        _loops.add(loop)
        if _pid != os.getpid():
            _pid = os.getpid()
            threading.Thread(target=_run, name="fastjobs-guard", daemon=True).start()


def _run() -> None:
    # Stop signals are the main thread's (see worker.Heartbeat.run).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
    while True:
        time.sleep(GUARD_TICK)
        if _suspended:
            continue
        for loop in list(_loops):
            try:
                loop.hand_back()
            except Exception:
                # The loop keeps the error for its thread (it raises it after the
                # handler returns); anything else is a bug to see, not to stop on.
                logger.exception("the guard could not hand back a slow batch")
