"""The hot loops' per-batch policy, decided once for both: which queue, which lane, how many, from where.

Both loops (`_core` in C, `_core_py` in Python) keep the per-job work only
(libpq I/O, row decoding, calling handlers, shared-memory writes) and ask a
Planner at each claim and after each batch. The Planner holds no connection
and reads time only through its `clock`, so tests/test_planner.py drives it
with a fake clock and scripted claim results.

Its decisions (see docs/internals.md for the concepts):
- the queues' turn, and how many queues a claim that finds nothing tries;
- the lane: a queue takes the fast lane (sql.job_lock_many) when every kind
  on it may hold a transaction, once a batch of it on the state lane ran
  quick (proven), while its claims find a backlog (deep), and not within
  FAST_LANE_DEMOTE of a demotion;
- where a claim starts: after the queue's mark (where its last claim
  ended), or from the front of the claim index as often as costs the
  `duty` share of the loop's time (FRONT_CLAIM_DUTY); and which partitions a
  claim after the mark reads: slot 0 and the current rotating slot alone
  when no other slot can hold a job at or after the mark (slots);
- the size: twice what the queue's last claim found, halving at most
  (SIZE_DECAY), between batch_min and batch_max, capped by the pace of the
  queue's last batch (BATCH_SECONDS; whole waves for async and pooled jobs);
- whether to claim ahead (overlap), and how long outcomes still go by the
  statements that keep results (KEEPING_CLAIMS).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .abc import (
    BATCH_SECONDS,
    DEEP_CLAIM,
    FAST_LANE_DEMOTE,
    FRONT_CLAIM_DUTY,
    FRONT_CLAIM_MAX_WAIT,
    KEEPING_CLAIMS,
    MARK_RUN_AT_MAX,
    MARK_RUN_AT_MIN,
    SIZE_DECAY,
    SLOT_FRESH,
)
from .sql import CLAIM_MARK_MARGIN

if TYPE_CHECKING:
    from .types import JobSpec

__all__ = ["Claim", "Planner", "fast_queues", "takes_keys", "widths"]

# A claim to send: the queue's index, how many jobs, and the mark to claim
# after ((priority, run_at as binary timestamptz, and the rotating slot to
# claim in beside slot 0, or 0 for every slot); None: from the front).
Claim = tuple[int, int, "tuple[int, int, int] | None"]


def fast_queues(
    specs: Mapping[str, JobSpec], queues: Sequence[str], *, fast_lane: bool, keep_completed: bool
) -> list[bool]:
    """Per queue, whether it may take the fast lane at all: every kind on it sync without a timeout.
    Limits per key do not keep a queue off it (its lock counts keys as the state lane's claim does).

    Kept completed rows stay on the state lane, whose finish statement keeps them.
    """
    return [
        fast_lane
        and not keep_completed
        and all(not spec.is_async and spec.timeout is None for spec in specs.values() if spec.queue == queue)
        for queue in queues
    ]


def takes_keys(specs: Mapping[str, JobSpec]) -> bool:
    """Whether a loop's fast lane takes keyed jobs (sql.LOCK's keyed statements): when its app has a
    kind limited per key or as a whole. A loop without one takes none there (its state lane does,
    at the limits they carry), and its lock costs nothing for them."""
    return any(spec.limit is not None for spec in specs.values())


def widths(
    specs: Mapping[str, JobSpec], queues: Sequence[str], concurrency: int, threads: Mapping[bytes, int]
) -> list[int]:
    """Per queue, how many of its jobs a loop runs at once: its async kinds' `concurrency`, its
    threads, or one (sync jobs run one after the other)."""
    return [
        max(
            concurrency if any(s.is_async for s in specs.values() if s.queue == queue) else 1,
            threads.get(queue.encode(), 1),
        )
        for queue in queues
    ]


class Planner:
    """One loop's per-batch decisions over its queues (see the module's docstring)."""

    __slots__ = (
        "_caps",
        "_clock",
        "_deep",
        "_duty",
        "_event_at",
        "_fast",
        "_fast_ok",
        "_front_took",
        "_limit",
        "_marks",
        "_next_front",
        "_pooled",
        "_proven",
        "_queues",
        "_sent",
        "_sent_at",
        "_sizes",
        "_slot",
        "_slot_seen",
        "_slot_since",
        "_state_until",
        "_turn",
        "_widths",
        "batch_max",
        "batch_min",
        "demotions",
        "fair",
        "full",
        "index",
        "keeping",
        "keyed",
        "limited",
        "recheck",
        "size",
        "slow_jobs",
    )

    def __init__(
        self,
        fast_ok: list[bool],
        *,
        batch_min: int = 1,
        batch_max: int = 1000,
        duty: float = FRONT_CLAIM_DUTY,
        pooled: Callable[[int], bool] = lambda index: False,
        clock: Callable[[], float] = time.monotonic,
        widths: list[int] | None = None,
    ) -> None:
        n = len(fast_ok)
        self._queues = n
        self._fast_ok = fast_ok
        # The queue index's sync jobs run on the executor's threads (asked per claim: it may change).
        self._pooled = pooled
        self._clock = clock
        self._duty = duty
        # Per queue, the jobs the loop runs at once (see widths), and the queues with a concurrency
        # limit (set by the worker's heartbeat, sql.queue_limited): a claim of one takes at most a
        # wave, since a job claimed counts against the limit, started or not, and one loop
        # holding every place would run them one after the other while other workers wait.
        self._widths = widths if widths is not None else [1] * n
        self.limited: frozenset[int] = frozenset()
        # The queues ever given a keyed job (migration 012's mark, set by the worker at its start
        # and heartbeat, sql.queue_limited); None until told: every queue may have them.
        self.keyed: frozenset[int] | None = None
        # The queues marked fair (set with `limited`): their claims read every slot (slots).
        self.fair: frozenset[int] = frozenset()
        # The current rotating slot as the last claim after the mark saw it (0: unknown), since
        # when at the latest (the database's time, microseconds since 2000: the time of the first
        # claim that saw it), and when (the clock) a claim last saw it (slots).
        self._slot = 0
        self._slot_since = 0
        self._slot_seen = float("-inf")
        self._turn = 0
        self.batch_min = batch_min
        self.batch_max = batch_max
        # Per queue: until when it is demoted to the state lane; whether a
        # batch of it on the state lane ran in under half BATCH_SECONDS (a
        # long sync job that polls current_job().cancelled must not hold a
        # lock its cancel waits for); whether no fast claim of it came back
        # empty since a full one (DEEP_CLAIM: the fast lane saves a write per
        # job at two more round trips a claim, a gain on a backlog only).
        self._state_until = [0.0] * n
        # Per queue, the engine's own events the worker's heartbeat carries to the cluster view
        # (events()): its jobs that outran their bound, whose batch the guard handed back; its
        # demotions to the state lane; and when the last of them happened (time.time()).
        self.slow_jobs = [0] * n
        self.demotions = [0] * n
        self._event_at = [0.0] * n
        self._proven = [False] * n
        self._deep = [True] * n
        # Per queue: where its last claim ended, and when a claim from the front is due.
        self._marks: list[tuple[int, int] | None] = [None] * n
        self._next_front = [0.0] * n
        # Per queue, what its last claim from the front took: the duty rations by the lesser of
        # that and the claim's own, so one slow claim does not put the next off 49 times as long.
        # The first is cold (plans, caches: 26 ms against 1.5 ms warm, seen under load), so the
        # second comes at once and rations by its own time.
        self._front_took = [0.0] * n
        # Per queue: the next claim's size, and the pace cap of its last batch.
        # One size for all made an empty queue's claim halve a busy one's.
        self._sizes = [batch_min] * n
        self._caps = [batch_max] * n
        # The claim in flight: (queue index, from the front, when sent), its lane and size.
        self._sent: tuple[int, bool, float] = (0, True, 0.0)
        self._sent_at = float("-inf")  # when the claim in flight was sent (_sent's time is rationed)
        self._fast = False
        self._limit = 0
        self.index = 0  # the queue of the claim sent last
        self.size = batch_min  # the size the last claim chose for its queue
        self.full = False  # the last claim found as many jobs as it asked for
        self.recheck = float("inf")  # seconds until an idle loop should claim from the front
        self.keeping = 0  # claims left whose outcomes go by the _results statements

    @property
    def any_fast(self) -> bool:
        """Whether any queue may take the fast lane (its statements are prepared only then)."""
        return any(self._fast_ok)

    def fast_for(self, index: int) -> bool:
        """Whether the next claim of queue `index` takes the fast lane."""
        if (
            not (self._fast_ok[index] and self._proven[index] and self._deep[index])
            or self._state_until[index] > self._clock()
            or index in self.limited
        ):
            return False
        return not self._pooled(index)

    def keyless(self, index: int) -> bool:
        """Whether queue `index` was never given a keyed job: its state-lane claims and completions may
        go by the statements that take keyless jobs only (sql.COMPLETE, sql.CLAIM_ONLY)."""
        return self.keyed is not None and index not in self.keyed

    def lane(self) -> bool:
        """The next claim's lane (of the queue whose turn it is): True for the fast lane.

        Decided here for next() to take, so a demotion that ends in between
        cannot give the claim one lane and its accounting the other.
        """
        self._fast = fast = self.fast_for(self._turn % self._queues)
        return fast

    def tries(self, outcomes: bool) -> int:
        """How many claims a loop with nothing to run makes before it sleeps.

        Each queue once; one more when outcomes go along: the claim shares its
        statement's snapshot with them, so it cannot see a job they made
        available (Retry(0), Snooze(0)).
        """
        return self._queues + (1 if outcomes else 0)

    def again(self) -> bool:
        """After a fast claim that found nothing: whether to claim the same queue at once on the
        state lane (True, and its turn is given back), instead of counting it as an empty try.

        Its jobs may all be taken, or may not run on the fast lane: a queue
        with a concurrency limit has none there (sql._Choice.where), and a
        loop that slept on it would sleep while its jobs wait.
        """
        if not self._fast or self._deep[self.index]:
            return False
        self._turn -= 1
        return not self.lane()

    def ahead(self, overlap: bool, stopping: bool) -> bool:
        """Whether to send the next claim before this batch runs.

        Only from a deep queue (the last claim came back full): on a shallow
        one it would mostly return nothing, one more round trip per wake-up;
        nor when the next claim takes the fast lane (its transaction), nor of a
        queue with a concurrency limit (jobs claimed ahead hold places that
        other workers could run at once). When True, the claim to send is
        next()'s, on the state lane.
        """
        return (
            overlap
            and self.full
            and not stopping
            and self._turn % self._queues not in self.limited
            and not self.lane()
        )

    def next(self) -> Claim:
        """The next claim, on the lane lane() chose: the queue whose turn it is, its size, from where
        (and in which slots: _slot_for)."""
        index = self._turn % self._queues
        self._turn += 1
        limit = min(self._sizes[index], self.batch_max)
        if index in self.limited:
            limit = min(limit, self._widths[index])
        now = self._clock()
        mark = self._marks[index]
        if mark is not None and now >= self._next_front[index]:
            mark = None
        self._sent = (index, mark is None, now)
        self._sent_at = now
        self._limit = limit
        self.index = index
        if mark is None:
            return index, limit, None
        return index, limit, (*mark, self._slot_for(index, mark[1], now))

    def _slot_for(self, index: int, run_at: int, now: float) -> int:
        """The rotating slot a claim of queue `index` after a mark at `run_at` may read alone beside
        slot 0, or 0 for every slot.

        A row goes into a rotating slot while that slot is current, with a run_at from its insert's
        transaction (the table's default: now()), so a slot no longer current holds rows from before
        the moment the slot after it became current, and no later than when this loop first saw
        that one current. So once the mark, less its margin, is at or after the moment this loop
        first saw the current slot, no other rotating slot holds a row the claim would take, unless
        its run_at was written in place since (a Retry(0), a promoted retry): those wait for a claim
        from the front, as jobs behind the mark do. Not for a queue marked fair (its claims start at
        each key's front, in any slot), nor on what a claim saw more than SLOT_FRESH ago.
        """
        if (
            self._slot
            and index not in self.fair
            and now - self._slot_seen <= SLOT_FRESH
            and run_at - CLAIM_MARK_MARGIN >= self._slot_since
        ):
            return self._slot
        return 0

    def slots(self, current: int, at: int, sent: int) -> None:
        """A claim after the mark saw rotating slot `current` current at the database's time `at`
        (microseconds since 2000, read after the slot: at or after the moment it became current);
        it was sent for slot `sent` alone beside slot 0 (0: every slot). `current` 0: the claim
        returned no slot row, which a claim in one slot returns only when another is current, so
        its slot still was (the loops call this after every claim in one slot, and after every
        claim with a slot row).

        A claim sent for a slot no longer current missed the jobs inserted since into the current
        one: an idle loop claims again at once (recheck), after the mark, which then reads every
        slot until the mark passes the moment this loop first saw the new one. A sight dates from
        when its claim was sent (a claim sent ahead comes back a batch later).
        """
        seen = self._sent_at
        if not current:
            if sent == self._slot:
                self._slot_seen = max(self._slot_seen, seen)
            return
        if current != self._slot or seen - self._slot_seen > SLOT_FRESH:
            self._slot, self._slot_since = current, at
        self._slot_seen = max(self._slot_seen, seen)
        if sent and sent != current:
            self.recheck = 0.0

    def claimed(self, n: int, lowest: int, latest: int, keeps: bool) -> None:
        """The claim sent last found `n` jobs; `lowest` priority and the `latest` run_at among those.

        Marks where it ended (a run_at a second or more inside timestamptz's
        range only: the claim after it subtracts its margin), schedules the
        next claim from the front, and sizes the queue's next claim.
        """
        index, from_front, sent = self._sent
        now = self._clock()
        if n:
            self._marks[index] = (lowest, latest) if MARK_RUN_AT_MIN < latest < MARK_RUN_AT_MAX else None
        if from_front:
            took = now - sent
            wait = min(took, self._front_took[index]) * (1.0 - self._duty) / self._duty
            self._front_took[index] = took
            self._next_front[index] = now + min(wait, FRONT_CLAIM_MAX_WAIT)
        elif not n:
            # An empty claim after the mark may have missed a job behind it:
            # an idle loop claims from the front as soon as that is due (the
            # soonest over the queues tried wins; the loop resets it per step).
            self.recheck = min(self.recheck, max(0.0, self._next_front[index] - now))
        if keeps:
            self.keeping = KEEPING_CLAIMS
        elif self.keeping:
            self.keeping -= 1
        limit = self._limit
        if self._fast:
            # An empty fast claim (three round trips, the state lane's one)
            # sends the queue to the state lane until a claim comes back full.
            self._deep[index] = n > 0
            if not n:
                return
        elif n >= limit >= min(DEEP_CLAIM, self.batch_max):
            self._deep[index] = True
        self.full = n >= limit
        self.size = self._sizes[index] = min(
            self.batch_max, self._caps[index], max(self.batch_min, 2 * n, self._sizes[index] // SIZE_DECAY)
        )

    def ran(self, index: int, n: int, seconds: float, wave: int, pooled: bool, in_flight: bool) -> None:
        """A state-lane batch of queue `index` ran `n` jobs in `seconds`.

        Slow jobs get small batches, so siblings share a deep queue of them;
        async jobs and pooled sync ones run a wave at a time (`wave`: the
        concurrency they were given) and a wave takes the time of one job, so
        they are capped in whole waves, never below one. A claim sent ahead
        (`in_flight`) is rationed by the loop's wait for it, not by the
        handlers' time it spent in flight.
        """
        if in_flight:
            sent_index, from_front, sent = self._sent
            self._sent = (sent_index, from_front, sent + seconds)
        cap = int(BATCH_SECONDS * n / max(seconds, 1e-9))
        if seconds < BATCH_SECONDS / 2 and not wave and not pooled:
            self._proven[index] = True
        if wave:
            cap = max(wave, (cap + wave // 2) // wave * wave)
        self._caps[index] = max(self.batch_min, cap)

    def ran_fast(self, index: int, n: int, seconds: float) -> None:
        """A fast-lane batch of queue `index` ran `n` jobs in `seconds`: sized for half BATCH_SECONDS.

        So no transaction stays open much longer than one job over its deadline.
        """
        self._caps[index] = max(self.batch_min, int(BATCH_SECONDS / 2 * n / max(seconds, 1e-9)))

    def deadline(self) -> float:
        """When a fast batch starting now stops starting jobs (the rest stay available, untouched)."""
        return self._clock() + BATCH_SECONDS

    def demote(self, index: int) -> None:
        """Send queue `index` to the state lane for a while; its next claim is from the front.

        The jobs its fast batch gave back (or rolled back) are behind the mark
        that batch set: a claim after it would leave them for the next claim
        from the front, seconds away when the index is full of dead entries.
        """
        self._state_until[index] = self._clock() + FAST_LANE_DEMOTE
        self._proven[index] = False
        self._marks[index] = None
        self.demotions[index] += 1
        self._event_at[index] = time.time()

    def handed_back(self, index: int) -> None:
        """A job of queue `index` outran its bound: the guard hands back what its batch holds."""
        self.slow_jobs[index] += 1
        self._event_at[index] = time.time()

    def events(self, queues: Sequence[str]) -> list[dict[str, Any]]:
        """Per queue of `queues` (this planner's, in order) with any: its slow jobs and demotions so
        far, the seconds since the last, and the seconds it still takes the state lane for them."""
        now, clock = time.time(), self._clock()
        return [
            {
                "queue": queue,
                "slow_jobs": self.slow_jobs[i],
                "demotions": self.demotions[i],
                "last_ago": round(now - self._event_at[i], 3),
                "state_lane_left": round(max(self._state_until[i] - clock, 0.0), 3),
            }
            for i, queue in enumerate(queues)
            if self._event_at[i]
        ]

    def unmark(self, index: int) -> None:
        """Queue `index`'s next claim is from the front: jobs were released behind its mark."""
        self._marks[index] = None
