"""The per-batch policy without a database: a fake clock and scripted claim results drive a Planner.

Both hot loops ask the planner (fastjobs.planner); tests/test_twins.py checks
that they ask it alike, over many batches, against a real PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import pytest

from fastjobs import App
from fastjobs.abc import (
    BATCH_SECONDS,
    DEEP_CLAIM,
    FAST_LANE_DEMOTE,
    FRONT_CLAIM_MAX_WAIT,
    KEEPING_CLAIMS,
    MARK_RUN_AT_MAX,
    SIZE_DECAY,
    SLOT_FRESH,
)
from fastjobs.planner import Planner, fast_queues, widths
from fastjobs.sql import CLAIM_MARK_MARGIN

HOUR_US = 3_600_000_000  # a run_at well inside timestamptz's range


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def planner(
    queues: int = 1, *, fast: bool = False, pooled: set[int] | None = None, **kwargs: Any
) -> tuple[Planner, Clock]:
    clock = Clock()
    held = pooled if pooled is not None else set()
    return Planner([fast] * queues, pooled=lambda index: index in held, clock=clock, **kwargs), clock


def claim(
    p: Planner, clock: Clock, found: int, *, spent: float = 0.001, priority: int = 0
) -> tuple[Any, ...]:
    """The loop's part of one claim on the planner's lane: send it, wait `spent`, find `found` jobs."""
    fast = p.lane()
    index, limit, mark = p.next()
    clock.now += spent
    n = min(found, limit)
    p.claimed(n, priority, HOUR_US, False)
    return fast, index, limit, mark, n


def grow(p: Planner, clock: Clock) -> int:
    """Claims of a deep queue until its size stops growing; the size reached."""
    size = -1
    while size != p.size:
        size = p.size
        claim(p, clock, 100_000)
        claim(p, clock, 100_000)
    return p.size


def test_a_claim_asks_twice_what_the_last_found_halving_at_most_between_min_and_max() -> None:
    p, clock = planner(batch_min=2, batch_max=64)
    sizes = []
    for found in [1000, 1000, 1000, 1000, 1000, 0, 0, 0, 0, 0, 1]:
        _, _, limit, _, _ = claim(p, clock, found)
        sizes.append((limit, p.size))
    assert [limit for limit, _ in sizes] == [2, 4, 8, 16, 32, 64, 64 // SIZE_DECAY, 16, 8, 4, 2]
    assert sizes[-1][1] == 2  # twice the 1 it found
    assert grow(p, clock) == 64
    p.batch_max = 5  # the worker's careful mode shrinks it between claims
    assert claim(p, clock, 1000)[2] == 5


def test_each_queue_keeps_its_own_size_and_pace_cap() -> None:
    """An empty queue's claims must not halve a busy queue's size (it was then claimed 1-2 jobs at a time)."""
    p, clock = planner(2, batch_max=1000)
    for _ in range(6):
        claim(p, clock, 1000)  # queue 0: busy
        claim(p, clock, 0)  # queue 1: empty
    assert claim(p, clock, 1000)[1:3] == (0, 64)
    assert claim(p, clock, 0)[1:3] == (1, 1)
    # The pace of a queue's batch caps its own next sizes only.
    p.ran(0, 64, BATCH_SECONDS * 4, 0, False, False)  # 64 jobs in 4 batches' time: 16 fit in one
    claim(p, clock, 1000)
    assert p.size == 16
    assert claim(p, clock, 5)[2] == 1 and p.size == 2  # queue 1 doubles from its own size


def test_slow_jobs_get_small_batches_and_waves_whole_ones() -> None:
    p, clock = planner(batch_min=1, batch_max=1000)
    assert grow(p, clock) == 1000
    p.ran(0, 10, BATCH_SECONDS * 10, 0, False, False)  # 1 job per BATCH_SECONDS
    claim(p, clock, 1000)
    assert p.size == 1
    p.ran(0, 19, BATCH_SECONDS * 2, 10, False, False)  # 19 jobs on 10 threads: whole waves, the nearest
    assert grow(p, clock) == 10
    p.ran(0, 10, BATCH_SECONDS * 50, 10, False, False)  # a wave of slow async jobs: never below one wave
    assert grow(p, clock) == 10


def test_queues_take_turns_and_an_idle_loop_tries_each_once_or_once_more_with_outcomes() -> None:
    p, clock = planner(3)
    assert [claim(p, clock, 0)[1] for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert p.tries(False) == 3 and p.tries(True) == 4


def test_claims_go_after_the_mark_until_a_claim_from_the_front_is_due_by_its_duty() -> None:
    p, clock = planner(duty=0.02)
    _, _, _, mark, _ = claim(p, clock, 10, spent=0.05, priority=2)
    assert mark is None  # no mark yet: from the front
    # The first claim from the front is cold (plans, caches) and rations nothing: the next is due at once.
    _, _, _, mark, _ = claim(p, clock, 10, spent=0.01, priority=3)
    assert mark is None
    # That one took 10 ms: the next is due 10 * 0.98 / 0.02 = 490 ms later.
    _, _, _, mark, _ = claim(p, clock, 10, spent=0.001, priority=5)
    assert mark == (3, HOUR_US, 0)  # in every slot: the planner knows of none yet
    clock.now += 0.48
    assert claim(p, clock, 10)[3] == (5, HOUR_US, 0)  # the mark moves with each claim
    clock.now += 0.01
    assert claim(p, clock, 10)[3] is None
    # That one took 1 ms: due 49 ms later. One slow claim from the front is rationed by the lesser
    # of its time and the last one's (1 ms again), two in a row by theirs, at most FRONT_CLAIM_MAX_WAIT.
    clock.now += 0.05
    assert claim(p, clock, 10, spent=10.0)[3] is None
    clock.now += 0.04
    assert claim(p, clock, 10)[3] is not None
    clock.now += 0.01
    assert claim(p, clock, 10, spent=10.0)[3] is None
    clock.now += FRONT_CLAIM_MAX_WAIT - 0.01
    assert claim(p, clock, 10)[3] is not None
    clock.now += 0.02
    assert claim(p, clock, 10)[3] is None


def test_a_claim_after_the_mark_reads_one_slot_once_the_mark_passes_the_loop_s_first_sight_of_it() -> None:
    """The slot row of a claim after the mark (Planner.slots) tells the current rotating slot and a time
    at or after it became current: once the mark, less its margin, is at or after the first time this
    loop saw that slot, the claims after it read slot 0 and that slot alone; never on an old sight, nor
    for a queue marked fair; and a claim sent for a slot no longer current is made again at once.
    A claim in one slot that returns no slot row saw its slot current."""
    p, clock = planner(2, duty=1e-9)  # claims from the front FRONT_CLAIM_MAX_WAIT apart

    def after(index: int, run_at: int) -> int:
        """Claim queue `index` after its mark and find a job at `run_at`; the slot the claim read alone."""
        while p.next()[0] != index:  # its turn
            pass
        p._turn -= 1
        p.lane()
        _, _, mark = p.next()
        assert mark is not None
        p.claimed(1, 0, run_at, False)
        return mark[2]

    for _ in range(4):  # from the front, the first ones (cold, then rationed), for both queues
        claim(p, clock, 10, spent=0.01)
    assert after(0, HOUR_US) == 0  # no slot seen yet: every slot
    p.slots(3, HOUR_US - CLAIM_MARK_MARGIN, 0)  # slot 3, current by then at the latest
    assert after(0, HOUR_US + 1) == 3  # the mark (HOUR_US) less its margin is at the sight
    p.slots(3, HOUR_US, 3)  # seen again later: the first sight stands
    assert after(0, HOUR_US + 2) == 3
    p.fair = frozenset({1})
    assert after(1, HOUR_US) == 0  # a fair queue's claims start at each key's front, in any slot
    clock.now += SLOT_FRESH + 0.01
    assert after(0, HOUR_US + 3) == 0  # too long since a claim saw it: four rotations may have passed
    p.slots(3, HOUR_US, 0)  # the first sight is now this one
    assert after(0, HOUR_US + 4) == 0
    assert after(0, HOUR_US + CLAIM_MARK_MARGIN) == 0
    assert after(0, HOUR_US + CLAIM_MARK_MARGIN + 1) == 3
    # A rotation: the claim sent for slot 3 saw slot 4 current, so it may have missed jobs there.
    p.recheck = float("inf")
    p.slots(4, HOUR_US + CLAIM_MARK_MARGIN + 2, 3)
    assert p.recheck == 0.0  # an idle loop claims again at once, in every slot
    assert after(0, HOUR_US + CLAIM_MARK_MARGIN + 3) == 0
    p.recheck = float("inf")
    p.slots(4, HOUR_US + 10 * CLAIM_MARK_MARGIN, 0)
    assert p.recheck == float("inf")  # a claim in every slot missed nothing
    assert after(0, HOUR_US + 3 * CLAIM_MARK_MARGIN) == 0  # its mark is before the first sight of 4
    assert after(0, HOUR_US + 3 * CLAIM_MARK_MARGIN) == 4
    # A claim in one slot returns no slot row while its slot is current: that is a sight of it too.
    for _ in range(3):
        p.slots(0, 0, 4)
        clock.now += SLOT_FRESH * 0.6
        assert after(0, HOUR_US + 4 * CLAIM_MARK_MARGIN) == 4
    clock.now += SLOT_FRESH * 0.6
    assert after(0, HOUR_US + 4 * CLAIM_MARK_MARGIN) == 0  # no sight since the last claim's


def test_a_mark_keeps_the_lowest_priority_and_its_latest_run_at_inside_timestamptz() -> None:
    p, clock = planner()
    p.lane()
    p.next()
    clock.now += 0.001
    p.claimed(4, 2, MARK_RUN_AT_MAX, False)  # run_at at the range's edge: the claim after it would overflow
    assert p.next()[2] is None
    clock.now += 0.001
    p.claimed(4, 2, 7, False)
    assert p.next()[2] == (2, 7, 0)
    p.claimed(0, 0, 0, False)  # an empty claim keeps the mark
    assert p.next()[2] == (2, 7, 0)


def test_an_empty_claim_after_the_mark_asks_an_idle_loop_to_recheck_from_the_front_when_due() -> None:
    p, clock = planner(2, duty=0.5)
    claim(p, clock, 3, spent=2.0)  # queue 0 from the front, cold: the next from the front due at once
    claim(p, clock, 3, spent=0.5)  # queue 1 likewise
    claim(p, clock, 3, spent=2.0)  # queue 0 from the front: the next from the front due 2 s later
    claim(p, clock, 3, spent=0.5)  # queue 1: due 0.5 s later
    assert p.recheck == float("inf")
    clock.now += 0.25
    assert claim(p, clock, 0, spent=0.0)[3] is not None  # queue 0 after its mark: empty
    assert p.recheck == pytest.approx(1.25)
    assert claim(p, clock, 0, spent=0.0)[3] is not None  # queue 1: due sooner, and the soonest wins
    assert p.recheck == pytest.approx(0.25)
    assert claim(p, clock, 0, spent=0.0)[3] is not None  # queue 0 again: the soonest still wins
    assert p.recheck == pytest.approx(0.25)
    p.recheck = float("inf")  # what the loop does at each step


def test_a_claim_sent_ahead_is_rationed_by_the_wait_for_it_not_the_handlers_time() -> None:
    p, clock = planner(duty=0.5)
    claim(p, clock, 10, spent=1.0)
    clock.now += 1.0
    assert p.next()[2] is None  # sent ahead, from the front (the first, cold, rationed nothing)
    clock.now += 2.0  # the batch's handlers run while it is in flight
    p.ran(0, 10, 2.0, 0, False, True)
    clock.now += 0.1
    p.claimed(10, 0, HOUR_US, False)
    # Its cost was 0.1 s, not 2.1 s: the next claim from the front is due 0.1 s later.
    clock.now += 0.11
    assert p.next()[2] is None


def test_a_queue_takes_the_fast_lane_once_proven_quick_while_its_claims_find_a_backlog() -> None:
    p, clock = planner(fast=True, batch_max=1000)
    assert claim(p, clock, 1000)[0] is False  # not proven yet
    p.ran(0, 1000, BATCH_SECONDS, 0, False, False)  # a batch that took a whole BATCH_SECONDS proves nothing
    assert claim(p, clock, 1000)[0] is False
    p.ran(0, 1000, BATCH_SECONDS / 4, 0, False, False)
    assert claim(p, clock, 1000)[0] is True
    assert claim(p, clock, 0)[0] is True  # an empty fast claim: the backlog is gone
    assert claim(p, clock, 0)[0] is False
    # A full state-lane claim shows a backlog again only when it asked for DEEP_CLAIM jobs or more.
    while p.size < DEEP_CLAIM:
        assert claim(p, clock, p.size)[0] is False
    fast, _, limit, _, n = claim(p, clock, 1000)
    assert not fast and n == limit >= DEEP_CLAIM
    assert claim(p, clock, 1000)[0] is True


def test_an_empty_fast_claim_keeps_the_size_and_a_small_full_claim_is_no_backlog() -> None:
    p, clock = planner(fast=True, batch_min=1, batch_max=1000)
    p.ran(0, 1, 0.001, 0, False, False)
    for _ in range(4):
        claim(p, clock, 1000)
    size = p.size
    assert claim(p, clock, 0)[0] is True and p.size == size
    # Shrink to a small size on the state lane: a claim of 1 that finds 1 is no backlog.
    for _ in range(10):
        claim(p, clock, 0)
    assert p.size == 1
    assert claim(p, clock, 1)[0] is False
    assert claim(p, clock, 2)[0] is False  # full, but 2 < DEEP_CLAIM


def test_a_demoted_queue_takes_the_state_lane_from_the_front_until_it_proves_quick_again() -> None:
    p, clock = planner(fast=True)
    p.ran(0, 1, 0.001, 0, False, False)
    claim(p, clock, 10)
    assert p.lane() is True
    p.next()
    p.claimed(10, 0, HOUR_US, False)
    p.demote(0)
    fast, _, _, mark, _ = claim(p, clock, 10)
    assert not fast and mark is None  # its released jobs lie behind the mark
    p.ran(0, 1, 0.001, 0, False, False)
    clock.now += FAST_LANE_DEMOTE - 1
    assert claim(p, clock, 1000)[0] is False
    clock.now += 2
    assert claim(p, clock, 1000)[0] is True
    assert p.deadline() == clock.now + BATCH_SECONDS


def test_pooled_async_and_unknown_queues_never_take_the_fast_lane() -> None:
    p, clock = planner(2, fast=True, pooled={1})
    for index in (0, 1):
        p.ran(index, 1, 0.001, 0, False, False)
    assert [claim(p, clock, 1000)[0] for _ in range(4)] == [True, False, True, False]
    # A batch run as waves (async, threads) proves nothing.
    q, clock = planner(fast=True)
    q.ran(0, 1, 0.001, 5, False, False)
    q.ran(0, 1, 0.001, 0, True, False)
    assert claim(q, clock, 1000)[0] is False

    app = App("postgresql://unused")
    app.job("sync", queue="a")(lambda: None)
    app.job("timed", queue="b", timeout=5)(lambda: None)

    @app.job("later", queue="c")
    async def later() -> None:
        pass

    specs = dict(app.jobs)
    assert fast_queues(specs, ["a", "b", "c", "d"], fast_lane=True, keep_completed=False) == [
        True,
        False,
        False,
        True,  # no kind registered on it: every job of it is an unknown kind's failure
    ]
    assert fast_queues(specs, ["a"], fast_lane=True, keep_completed=True) == [False]
    assert fast_queues(specs, ["a"], fast_lane=False, keep_completed=False) == [False]


def test_claim_ahead_only_from_a_deep_queue_on_the_state_lane() -> None:
    p, clock = planner(fast=True, batch_max=1000)
    claim(p, clock, 1)  # found all it asked for: full
    assert p.ahead(True, False) and not p.ahead(False, False) and not p.ahead(True, True)
    p.next()
    p.claimed(0, 0, 0, False)  # came back short
    assert not p.ahead(True, False)
    p.ran(0, 1, 0.001, 0, False, False)
    claim(p, clock, 1000)
    assert p.lane() is True and not p.ahead(True, False)  # the next claim takes the fast lane


def test_outcomes_go_by_the_keeping_statements_for_a_window_after_a_claim_that_keeps_a_result() -> None:
    p, _ = planner()
    assert p.keeping == 0
    p.next()
    p.claimed(3, 0, HOUR_US, True)
    window = []
    for _ in range(KEEPING_CLAIMS + 1):
        window.append(p.keeping)
        p.next()
        p.claimed(0, 0, 0, False)
    assert window == list(range(KEEPING_CLAIMS, -1, -1))


def test_a_fast_batch_is_sized_for_half_a_batch_s_time() -> None:
    p, clock = planner(fast=True, batch_max=1000)
    p.ran_fast(0, 100, BATCH_SECONDS)  # 100 jobs took a whole BATCH_SECONDS: 50 fit in half
    assert grow(p, clock) == 50


def test_a_queue_with_a_concurrency_limit_is_claimed_a_wave_at_a_time_on_the_state_lane() -> None:
    clock = Clock()
    p = Planner([True, True], batch_max=1000, clock=clock, widths=[1, 8])
    for index in (0, 1):
        p.ran(index, 1000, 0.001, 0, False, False)
    grow(p, clock)
    assert claim(p, clock, 100_000)[0] is True and p.size > 8
    p.limited = frozenset({0, 1})  # what the worker's heartbeat sets
    assert sorted(claim(p, clock, 100_000)[:3] for _ in range(2)) == [(False, 0, 1), (False, 1, 8)]
    assert p.full and not p.ahead(True, False)  # jobs claimed ahead would hold places idle
    p.limited = frozenset()
    assert claim(p, clock, 100_000)[0] is True


def test_a_claim_s_widths_are_its_threads_or_its_async_concurrency() -> None:
    app = App("postgresql://unused")
    app.job("sync", queue="a")(lambda: None)
    app.job("threaded", queue="b")(lambda: None)

    @app.job("later", queue="c")
    async def later() -> None:
        pass

    assert widths(dict(app.jobs), ["a", "b", "c"], 50, {b"b": 4}) == [1, 4, 50]


def test_the_planner_counts_slow_jobs_and_demotions_per_queue_for_the_heartbeat() -> None:
    p, clock = planner(queues=3)
    assert p.events(["a", "b", "c"]) == []  # nothing happened: the heartbeat carries nothing
    p.handed_back(1)
    p.demote(1)  # a fast-lane hand-over: a slow job and a demotion
    p.demote(2)
    clock.now += 20.0
    found = {e["queue"]: e for e in p.events(["a", "b", "c"])}
    assert sorted(found) == ["b", "c"]
    assert (found["b"]["slow_jobs"], found["b"]["demotions"]) == (1, 1)
    assert (found["c"]["slow_jobs"], found["c"]["demotions"]) == (0, 1)
    assert found["b"]["state_lane_left"] == pytest.approx(FAST_LANE_DEMOTE - 20.0)
    assert 0 <= found["c"]["last_ago"] < 5  # wall time: the heartbeat sends how long ago
    clock.now += FAST_LANE_DEMOTE
    assert all(e["state_lane_left"] == 0 for e in p.events(["a", "b", "c"]))
