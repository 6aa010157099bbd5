"""Retry policies: when a failed job runs again.

The default is River's and Sidekiq's shape: attempt**4 seconds (1 s, 16 s,
81 s, 4 min, 10 min, ... 4.5 days at the 25th), with +-10% jitter so a burst
of failures does not come back as a burst. A policy is a pure function of
the attempt number (1 for the first run) and a random number in [0, 1), so
it can be tested without a clock; override it per kind with `@app.job(retry=...)`.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "JITTER",
    "RetryPolicy",
    "default_backoff",
]

RetryPolicy = Callable[[int, float], float]

JITTER = 0.1


def default_backoff(attempt: int, rand: float) -> float:
    """Seconds to wait after failed attempt `attempt` (>= 1); `rand` is uniform in [0, 1)."""
    base = float(max(attempt, 1) ** 4)
    return base * (1.0 + JITTER * (2.0 * rand - 1.0))
