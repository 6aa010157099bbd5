"""The hot loops' guard: one thread per process that hands back what a slow handler's batch holds.

A batch runs its sync jobs one after another on the loop's thread, which is
inside the handler while it runs: only another thread can act meanwhile. The
guard sleeps to the earliest moment a loop's handler may outrun its bound
(BatchLoop.due), or GUARD_IDLE, then asks each loop past it to hand back what
it holds (BatchLoop.hand_back: the jobs behind it, the fast lane's
transaction); the loop decides and acts on its own connection, which its
thread does not touch while a handler runs. A fast batch, whose deadline may
come sooner than the guard wakes, says when it starts (alert). Loops are held
weakly: a loop no longer used is forgotten.
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

from .abc import GUARD_IDLE

__all__ = ["alert", "suspended", "watch"]

if TYPE_CHECKING:
    from .abc import BatchLoop

logger = logging.getLogger(__name__)

_loops: weakref.WeakSet[BatchLoop] = weakref.WeakSet()
_lock = threading.Lock()
_pid = 0  # the process whose guard thread runs (a forked child starts its own)
_suspended = 0
_alert = threading.Event()
# Until when (time.monotonic()) the guard sleeps; infinite while it reads the loops, so that a
# batch starting meanwhile alerts it.
_asleep_until = 0.0


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


def alert(deadline: float) -> None:
    """A fast batch began that must be handed over at `deadline` (time.monotonic()) if a handler
    still runs then: wake the guard if it would sleep past it. A float comparison per batch."""
    if deadline < _asleep_until:
        _alert.set()


def _run() -> None:
    global _asleep_until
    # Stop signals are the main thread's (see worker.Heartbeat.run).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
    while True:
        _asleep_until = float("inf")
        _alert.clear()
        now = time.monotonic()
        wake = now + GUARD_IDLE
        for loop in list(_loops):
            due = loop.due()
            if not due:
                continue
            if due > now:
                wake = min(wake, due)
                continue
            if _suspended:
                continue
            try:
                # Past its bound: it acts, or holds nothing to give (looked at again in GUARD_IDLE).
                loop.hand_back()
            except Exception:
                # The loop keeps the error for its thread (it raises it after the
                # handler returns); anything else is a bug to see, not to stop on.
                logger.exception("the guard could not hand back a slow batch")
        _asleep_until = wake
        _alert.wait(max(0.0, wake - time.monotonic()))
