"""What the master does for every process it forks: fork with signals held, die with it, restart with backoff.

The workers, the leader (`fastjobs.master`) and the metrics process
(`fastjobs.metrics`) are forked, supervised and restarted the same way;
only what runs in the child and what its exit means differ.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

__all__ = [
    "EXIT_BOOT_ERROR",
    "EXIT_CRASH",
    "EXIT_OK",
    "RESTART_BACKOFF_MAX",
    "STABLE_AFTER",
    "Backoff",
    "die_with",
    "fork",
    "how_it_ended",
]

EXIT_OK = 0
EXIT_CRASH = 1
# A child that could not start (bad configuration, schema missing): restarting
# it would fail the same way, so the whole master stops with it rather than
# restart-looping.
EXIT_BOOT_ERROR = 3

RESTART_BACKOFF_MAX = 30.0
STABLE_AFTER = 30.0  # a child that lived this long resets its backoff

logger = logging.getLogger(__name__)


def fork(held: Iterable[signal.Signals], main: Callable[[], int]) -> int:
    """Fork; the child runs `main` and exits with its code (EXIT_CRASH if it raises); the parent gets the pid.

    The signals `held` stay blocked across the fork: one arriving before the
    child has set its own dispositions would run the parent's handler in the
    child and be lost. The parent unblocks them; `main` does so in the child.
    """
    held = set(held)
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        return pid
    code = EXIT_CRASH
    try:
        code = main()
    except BaseException:
        logger.exception("process %d crashed", os.getpid())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def die_with(parent: int, sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when `parent` dies (Linux), or send it now if it has."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


class Backoff:
    """When to restart a child that exited: at once after a run of STABLE_AFTER seconds or more,
    else 0.5 s after its start, doubling with each quick exit up to RESTART_BACKOFF_MAX."""

    def __init__(self) -> None:
        self.started = 0.0
        self.failures = 0

    def start(self) -> None:
        self.started = time.monotonic()

    def delay(self) -> float:
        """Note an exit now; the seconds to wait before the restart."""
        lived = time.monotonic() - self.started
        self.failures = 0 if lived >= STABLE_AFTER else self.failures + 1
        return min(RESTART_BACKOFF_MAX, 0.5 * 2 ** (self.failures - 1)) if self.failures else 0.0


def how_it_ended(code: int) -> str:
    """`os.waitstatus_to_exitcode`'s code in words."""
    return f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
