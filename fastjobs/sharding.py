"""The plan of `fastjobs run`: `--queues` parsed, and each queue's concurrency shared among workers."""

from __future__ import annotations

import difflib
import logging

from .errors import ConfigurationError
from .types import DEFAULT_QUEUE

__all__ = ["DEFAULT_CONCURRENCY", "parse_queues", "shard", "threaded_queues"]

logger = logging.getLogger("fastjobs.master")  # the name users filter on: the master plans


# A queue named without `:n` gets this much concurrency per worker process
# (its async jobs in flight at once; its sync jobs run one at a time per
# worker: threads are asked for, with `:n`, since they need thread-safe handlers).
DEFAULT_CONCURRENCY = 10


def parse_queues(spec: str | None, registered: list[str], processes: int) -> dict[str, int]:
    """`default:8,emails:2` -> {queue: concurrency}; a bare name gets DEFAULT_CONCURRENCY per process."""
    if not spec:
        return {q: processes * DEFAULT_CONCURRENCY for q in (registered or [DEFAULT_QUEUE])}
    queues: dict[str, int] = {}
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if not name:
            raise ConfigurationError(f"--queues: empty queue name in {spec!r}")
        if name in queues:
            raise ConfigurationError(f"--queues: queue {name!r} is named twice in {spec!r}")
        count = count.strip()
        if count:
            if not count.isdigit() or int(count) < 1:
                raise ConfigurationError(
                    f"--queues: concurrency of {name!r} must be a positive integer, not {count!r}"
                    " (queues are separated by commas: default:8,emails:2)"
                )
            queues[name] = int(count)
        else:
            queues[name] = processes * DEFAULT_CONCURRENCY
    unregistered = sorted(queues.keys() - set(registered)) if registered else []
    for name in unregistered:
        # Served all the same (a job may be enqueued with options(queue=...)), but a typo
        # would leave the queue it meant unserved while this one waits for nothing.
        close = difflib.get_close_matches(name, registered, n=1)
        logger.warning(
            "--queues: no job of this App is registered on queue %r%s (its queues: %s)",
            name,
            f"; did you mean {close[0]!r}?" if close else "",
            ", ".join(registered),
        )
    return queues


def threaded_queues(spec: str | None) -> frozenset[str]:
    """The queues `spec` gives a concurrency (`name:N`): their sync jobs run on threads.

    Call it on a spec parse_queues accepted.
    """
    if not spec:
        return frozenset()
    return frozenset(name.strip() for name, sep, _ in (p.partition(":") for p in spec.split(",")) if sep)


def shard(queues: dict[str, int], processes: int) -> list[dict[str, int]]:
    """Assign queues to worker processes: the rule `fastjobs run` documents and prints.

    Queues are placed largest concurrency first (ties by name). A queue of
    concurrency c is served by min(c, processes) workers, the least loaded
    ones (load = concurrency already assigned; ties by lower index), and its
    concurrency is split evenly among them, the remainder going one each to
    the lowest indexes. A worker's share bounds how many of that queue's
    async jobs it runs at once, and, for a queue in `threaded`, its sync jobs.
    """
    load = [0] * processes
    plan: list[dict[str, int]] = [{} for _ in range(processes)]
    for queue, concurrency in sorted(queues.items(), key=lambda kv: (-kv[1], kv[0])):
        k = min(concurrency, processes)
        chosen = sorted(sorted(range(processes), key=lambda i: (load[i], i))[:k])
        base, extra = divmod(concurrency, k)
        for n, index in enumerate(chosen):
            share = base + (1 if n < extra else 0)
            plan[index][queue] = share
            load[index] += share
    return plan
