"""The batcher's pure pieces, without a collector, a loop or a clock: selection (fairness,
priority, token budget, deadlines), dispatch and admission as functions of their inputs."""

from __future__ import annotations

import asyncio
import gc
import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest

from service.engine.batcher import estimates
from service.engine.batcher.adaptive import AdaptivePolicy, target_rows
from service.engine.batcher.admission import (
    chunk_rows,
    chunks_of,
    estimated_wait_s,
    refusal,
    refusal_of_any,
)
from service.engine.batcher.clock import COMPACT_AT_LEAST, Deadlines
from service.engine.batcher.estimates import BatchTimes, size_class
from service.engine.batcher.policy import FixedPolicy, Target
from service.engine.batcher.queue import BatchQueue, Entry, Group
from service.engine.batcher.selection import (
    HIGH_PRIORITY_STREAK_LIMIT,
    NO_QUANTUM,
    Estimate,
    Limits,
    Plan,
    Quantum,
    Selector,
    finishes_late,
    is_full,
    lead_priority,
    pick_group,
    plan_batch,
)
from service.errors import DeadlineUnreachableError, OverloadedError
from service.types import Priority
from tests.fixtures import SteppedClock


def entry(
    rows: int = 1,
    *,
    group: Hashable = "g",
    priority: Priority = "normal",
    arrival_s: float = 0.0,
    deadline_s: float = 100.0,
    cost: int = 0,
) -> Entry:
    return Entry(
        None,
        0,
        None,
        rows=rows,
        cost=cost,
        group=group,
        priority=priority,
        arrival_s=arrival_s,
        deadline_s=deadline_s,
    )


def queue_of(*entries: Entry) -> BatchQueue:
    queue = BatchQueue()
    for each in entries:
        queue.add_all([each])
    return queue


def never_measured(group: Hashable, rows: int) -> float | None:
    return None


def test_a_group_is_full_by_rows_or_by_a_budget_of_even_one_token() -> None:
    [group] = queue_of(entry(2, cost=1))
    assert is_full(group, Limits(row_limit=2, max_batch_cost=0))
    assert not is_full(group, Limits(row_limit=3, max_batch_cost=0))
    assert is_full(group, Limits(row_limit=3, max_batch_cost=1))
    assert not is_full(group, Limits(row_limit=3, max_batch_cost=2))


def test_high_priority_leads_until_its_streak_while_normal_waits() -> None:
    assert lead_priority(HIGH_PRIORITY_STREAK_LIMIT - 1, normal_waiting=True) == "high"
    assert lead_priority(HIGH_PRIORITY_STREAK_LIMIT, normal_waiting=True) == "normal"
    assert lead_priority(HIGH_PRIORITY_STREAK_LIMIT, normal_waiting=False) == "high"


def test_the_group_of_the_last_batch_goes_after_the_others() -> None:
    queue = queue_of(entry(group="a", arrival_s=1.0), entry(group="b", arrival_s=2.0))
    groups = list(queue)
    assert pick_group(groups, "normal", last_group=None).key == "a"
    assert pick_group(groups, "normal", last_group="a").key == "b"
    assert pick_group(groups[:1], "normal", last_group="a").key == "a"  # alone: still runs


def test_the_lead_priority_picks_the_group_whose_such_request_came_first() -> None:
    queue = queue_of(
        entry(group="a", arrival_s=1.0),
        entry(group="b", arrival_s=2.0, priority="high"),
    )
    assert pick_group(list(queue), "high", last_group=None).key == "b"
    assert pick_group(list(queue), "normal", last_group=None).key == "a"


def test_a_batch_stops_a_lane_at_the_first_request_that_does_not_fit() -> None:
    [group] = queue_of(entry(2), entry(2), entry(1), entry(1, priority="high"))
    plan = plan_batch(group, ("high", "normal"), Limits(4, 0), never_measured, now_s=0.0)
    assert [e.rows for e in plan.batch] == [1, 2]
    assert plan.taken == {"high": 1, "normal": 1}


def test_the_token_budget_limits_a_batch_but_not_its_first_request() -> None:
    [group] = queue_of(entry(1, cost=8), entry(1, cost=3))
    plan = plan_batch(group, ("normal",), Limits(8, 10), never_measured, now_s=0.0)
    assert [e.cost for e in plan.batch] == [8]
    [alone] = queue_of(entry(1, cost=50))
    assert len(plan_batch(alone, ("normal",), Limits(8, 10), never_measured, 0.0).batch) == 1


def test_a_request_too_late_even_alone_is_set_aside_and_one_that_would_be_late_waits() -> None:
    def half_a_second(group: Hashable, rows: int) -> float:
        return 0.5 * rows

    [group] = queue_of(
        entry(deadline_s=0.4, arrival_s=0.0),  # even alone: late
        entry(deadline_s=10.0, arrival_s=1.0),
        entry(deadline_s=0.9, arrival_s=2.0),  # two rows take 1 s: it would be late
    )
    plan = plan_batch(group, ("normal",), Limits(4, 0), half_a_second, now_s=0.0)
    assert [e.deadline_s for e in plan.late] == [0.4]
    assert [e.deadline_s for e in plan.batch] == [10.0]
    assert plan.taken == {"normal": 2}


def test_entries_whose_caller_left_are_taken_out_uncomputed() -> None:
    gone, kept = entry(arrival_s=0.0), entry(arrival_s=1.0)
    [group] = queue_of(gone, kept)
    plan = plan_batch(group, ("normal",), Limits(4, 0), never_measured, 0.0, lambda e: e is gone)
    assert plan.gone == [gone]
    assert plan.batch == [kept]


def test_a_plan_reads_the_estimate_of_a_smaller_size_class_after_a_lane_stops_at_a_large_one() -> (
    None
):
    """The plan reads an estimate again only when the grown rows leave the size class it
    read last, downwards too: a lane stopped at a 20-row request (too slow for the batch's
    deadline), the next lane's one row still joins as a batch of 2."""

    def slow_from_16_rows(group: Hashable, rows: int) -> float:
        return 5.0 if rows >= 16 else 0.01

    first = entry(priority="high", deadline_s=1.0)
    large = entry(20, priority="high", arrival_s=1.0)
    small = entry(arrival_s=2.0)
    [group] = queue_of(first, large, small)
    plan = plan_batch(group, ("high", "normal"), Limits(64, 0), slow_from_16_rows, 0.0)
    assert plan.batch == [first, small]
    assert plan.taken == {"high": 1, "normal": 1}


def test_the_adaptive_target_is_the_last_batch_or_the_load_held_within_the_row_limit() -> None:
    assert target_rows(last_batch_rows=3, expected=0, row_limit=8) == 3
    assert target_rows(last_batch_rows=3, expected=6, row_limit=8) == 6
    assert target_rows(last_batch_rows=3, expected=60, row_limit=8) == 8
    assert target_rows(last_batch_rows=0, expected=0, row_limit=8) == 1
    held = [6]
    adaptive = AdaptivePolicy(0.005, lambda: held[0])
    adaptive.taken([entry(2), entry(1)])
    assert adaptive.target(8) == Target(6, 8, look_again=True)
    held[0] = 0
    assert adaptive.target(8).rows == 3  # the last batch's rows
    assert FixedPolicy(0.005).target(8) == Target(8, 8)


def test_a_group_is_due_at_max_wait_and_after_a_refill_wait_only_when_none_is_ready() -> None:
    [group] = queue_of(entry(arrival_s=10.0))
    adaptive, fixed = AdaptivePolicy(0.5), FixedPolicy(0.5)
    target, limits = Target(4, 4), Limits(4, 0)
    assert adaptive.due_at_s(group, target, True, limits, never_measured) == 10.5  # none out
    adaptive.answered([entry()], now_s=10.1)  # its client is not back yet
    adaptive.returns.turnaround_s = 0.6
    assert adaptive.due_at_s(group, target, True, limits, never_measured) == pytest.approx(10.7)
    assert adaptive.due_at_s(group, target, False, limits, never_measured) == 10.5
    assert fixed.due_at_s(group, target, True, limits, never_measured) == 10.5
    assert adaptive.is_ready(group, Target(1, 4), limits)
    assert not fixed.is_ready(group, Target(1, 4), limits)


def test_chunks_fit_a_batch_by_rows_and_by_token_budget() -> None:
    assert chunk_rows(max_batch_size=8, max_batch_cost=0, cost_per_row=5) == 8
    assert chunk_rows(max_batch_size=8, max_batch_cost=20, cost_per_row=5) == 4
    assert chunk_rows(max_batch_size=8, max_batch_cost=20, cost_per_row=50) == 1


def test_the_estimated_wait_counts_full_and_partial_batches_of_each_group() -> None:
    queue = queue_of(*(entry() for _ in range(5)), entry(priority="high"))

    def tenth_per_row(group: Hashable, rows: int) -> float:
        return 0.1 * rows

    wait = estimated_wait_s(queue, "normal", 0.25, 4, 0, tenth_per_row)
    assert wait == pytest.approx(0.25 + 0.4 + 0.2)
    assert estimated_wait_s(queue, "high", -1.0, 4, 0, tenth_per_row) == pytest.approx(0.1)


@dataclass
class PerRow:
    """Durations of ``seconds`` a row now, and ``fastest_s`` a row at best (None: never
    measured)."""

    seconds: float | None
    fastest_s: float | None = None

    def estimate(self, group: Hashable, rows: int) -> float | None:
        return None if self.seconds is None else self.seconds * rows

    def fastest(self, group: Hashable, rows: int) -> float | None:
        quickest = self.seconds if self.fastest_s is None else self.fastest_s
        return None if quickest is None else quickest * rows


def waits(seconds: float) -> Callable[[Priority], float]:
    return lambda priority: seconds


def test_refusals_say_why_and_unmeasured_requests_are_never_refused() -> None:
    assert refusal([("g", 2)], 1.0, PerRow(None), waits(0.0), "normal") is None
    alone = refusal([("g", 2)], 1.5, PerRow(1.0), waits(0.0), "normal")
    assert isinstance(alone, DeadlineUnreachableError)
    behind = refusal([("g", 1)], 1.5, PerRow(1.0), waits(1.0), "normal")
    assert isinstance(behind, OverloadedError)
    assert behind.headers["Retry-After"] == "1"
    assert refusal([("g", 1)], 2.0, PerRow(1.0), waits(1.0), "normal") is None


@pytest.mark.parametrize("fastest_s", [None, 0.25])
@pytest.mark.parametrize(("left_s", "ahead_s"), [(1.0, 0.0), (3.0, 0.0), (3.0, 2.0), (9.0, 2.0)])
def test_a_request_of_one_chunk_is_refused_as_the_same_rows_in_two_chunks(
    fastest_s: float | None, left_s: float, ahead_s: float
) -> None:
    """One chunk and two whose estimates add up to the same: the same verdict, message and
    ``Retry-After``."""
    times = PerRow(1.0, fastest_s)
    one = refusal([("g", 2)], left_s, times, waits(ahead_s), "normal")
    two = refusal([("g", 1), ("g", 1)], left_s, times, waits(ahead_s), "normal")
    assert type(one) is type(two)
    if one is not None and two is not None:
        assert one.message == two.message
        assert one.headers == two.headers
    assert refusal([("g", 2)], left_s, PerRow(None), waits(ahead_s), "normal") is None


def test_before_its_rows_are_known_a_request_is_refused_only_when_the_work_ahead_is_too_long() -> (
    None
):
    """Asked before a body is parsed: the request's own forward is unknown (it may even be a
    shape not measured yet), so only the work ahead alone can refuse it; what it refuses,
    ``refusal`` would refuse too once the request is measured."""
    assert refusal_of_any(0.29, 0.3) is None
    assert refusal_of_any(0.3, 0.3) is None
    ahead = refusal_of_any(1.2, 0.3)
    assert isinstance(ahead, OverloadedError)
    assert ahead.headers["Retry-After"] == "2"
    assert "1200 ms of work, more than the 300 ms left" in ahead.message
    assert isinstance(refusal([("g", 1)], 0.3, PerRow(0.01), waits(1.2), "normal"), OverloadedError)


def test_a_shape_slowed_by_load_is_refused_429_with_retry_after_not_422() -> None:
    """Issue 23, finding 5: after an overload the estimate of a shape exceeded its deadline
    and every request of it was refused 422 ``deadline_unreachable`` without ``Retry-After``
    for up to 30 s, though the model answers it alone in 55-120 ms. 422 is for a forward too
    long even at its fastest; the rest is load, and is admitted again once the slow durations
    are stale."""
    clock = SteppedClock()
    clock.freeze()
    times = BatchTimes(clock.now)
    times.record("g", 1, 0.06)  # alone
    for _ in range(3):
        times.record("g", 1, 0.4)  # overloaded
    refused = refusal([("g", 1)], 0.3, times, waits(0.0), "normal")
    assert isinstance(refused, OverloadedError)
    assert refused.headers["Retry-After"] == "1"
    clock.advance(estimates.FRESH_FOR_S + 0.1)  # the load ended a few seconds ago
    assert refusal([("g", 1)], 0.3, times, waits(0.0), "normal") is None
    assert isinstance(
        refusal([("g", 2)], 0.3, PerRow(0.2, fastest_s=0.2), waits(0.0), "normal"),
        DeadlineUnreachableError,  # the forward itself is too long
    )


def test_the_quantum_cuts_a_batch_and_splits_a_request_of_many_long_rows() -> None:
    """Issue 23, finding 6: a full batch of 512-token rows took about 2 s, and a 3-token
    request waited for all of it. Under ``max_batch_ms`` a batch is cut to the rows expected
    within it (at least one) and a request of 32 such rows runs a quantum at a time."""
    quantum = Quantum(0.1, PerRow(0.06).estimate)  # a row takes 60 ms
    assert quantum.rows("long", total_rows=32, max_rows=32) == 1
    assert Quantum(0.25, PerRow(0.06).estimate).rows("long", 32, 32) == 3  # class 2: 180 ms
    assert Quantum(0.1, PerRow(0.001).estimate).rows("short", 32, 32) == 32
    assert Quantum(0.1, never_measured).rows("long", 32, 32) == 32
    assert Quantum(0.0, PerRow(0.06).estimate).rows("long", 32, 32) == 32  # no quantum
    assert Quantum(0.1, PerRow(0.06).estimate, max_chunks=4).rows("long", 32, 32) == 8
    [group] = queue_of(*(entry(group="long") for _ in range(4)))
    plan = plan_batch(group, ("normal",), Limits(32, 0, quantum), never_measured, now_s=0.0)
    assert len(plan.batch) == 1
    assert len(plan_batch(group, ("normal",), Limits(32, 0), never_measured, 0.0).batch) == 4


def test_a_slow_measurement_never_cuts_a_batch_below_one_longest_row() -> None:
    """With ``max_batch_ms`` on by default, a warm-up slowed by a loaded host measured
    128-token rows at 60 ms each, and they ran one per batch (``test_variable_length``).
    A batch may always hold one longest row's padded positions (``floor_cost``, 512 here):
    four 128-token rows, one 512-token row; the quantum cuts only beyond."""
    loaded = PerRow(0.06).estimate  # 60 ms a row, however short: measured under load
    quantum = Quantum(0.1, loaded, floor_cost=512)
    [medium] = queue_of(*(entry(group="128", cost=128) for _ in range(6)))
    plan = plan_batch(medium, ("normal",), Limits(32, 16_384, quantum), never_measured, 0.0)
    assert len(plan.batch) == 4  # the floor: 4 x 128 positions, not one row
    unfloored = Limits(32, 16_384, Quantum(0.1, loaded))
    assert len(plan_batch(medium, ("normal",), unfloored, never_measured, 0.0).batch) == 1
    [long] = queue_of(*(entry(group="512", cost=512) for _ in range(3)))
    plan = plan_batch(long, ("normal",), Limits(32, 16_384, quantum), never_measured, 0.0)
    assert len(plan.batch) == 1  # beyond the floor, the quantum still cuts
    # A request of many rows is split no finer than the floor either.
    assert quantum.rows("128", total_rows=32, max_rows=32, cost_per_row=128) == 4
    assert quantum.rows("512", total_rows=32, max_rows=32, cost_per_row=512) == 1
    assert quantum.rows("8", total_rows=32, max_rows=32, cost_per_row=8) == 32


def test_round_robin_lets_a_short_group_in_between_quanta_of_a_long_one() -> None:
    queue = queue_of(*(entry(group="long", arrival_s=0.0) for _ in range(8)))
    queue.add_all([entry(group="short", arrival_s=0.05)])
    selector = Selector()
    limits = Limits(32, 0, Quantum(0.1, PerRow(0.06).estimate))
    groups = [selector.take(queue, list(queue), limits, never_measured, 0.1)[0].group]
    groups += [selector.take(queue, list(queue), limits, never_measured, 0.2)[0].group]
    assert groups == ["long", "short"]


async def test_deadlines_of_answered_requests_do_not_pile_up() -> None:
    """Answered entries leave the heap when it is compacted, not only at their deadline:
    at thousands of requests per second and a 5 s timeout the heap would hold them all."""
    clock = SteppedClock()
    expired: list[Entry] = []
    deadlines = Deadlines(clock, expired.extend)
    for _ in range(3 * COMPACT_AT_LEAST):
        answered = entry(deadline_s=clock.now() + 60.0)
        deadlines.add_all([answered])
        answered.done = True
    assert len(deadlines) <= COMPACT_AT_LEAST
    late = entry(deadline_s=clock.now() + 1.0)
    deadlines.add_all([late])
    clock.advance(2.0)
    await asyncio.sleep(0)
    assert expired == [late]
    deadlines.close()


async def test_answered_frames_behind_another_front_ends_deadlines_do_not_pile_up() -> None:
    """A front end whose deadlines all come after another's: its frames never reach the
    heap's head while the other has a request waiting, so only compaction lets go of them.
    Compaction counts entries, not frames: at 64 requests a frame, 1,024 frames of answered
    entries (65,536) stayed alive, walked by every full garbage collection."""
    clock = SteppedClock()
    deadlines = Deadlines(clock, lambda expired: None)
    waiting = entry(deadline_s=10.0)  # the first front end's request, never answered here
    deadlines.add_all([waiting])
    gc.collect()
    alive_before = _entries_alive()
    for _ in range(2_000):
        frame = [entry(deadline_s=1_000.0) for _ in range(64)]
        deadlines.add_all(frame)
        for answered in frame:
            answered.done = True
    del frame, answered
    gc.collect()
    kept = _entries_alive() - alive_before
    assert kept <= 2 * COMPACT_AT_LEAST + 64
    assert len(deadlines) == kept + 1  # and the waiting one
    deadlines.close()


def _entries_alive() -> int:
    return sum(1 for each in gc.get_objects() if type(each) is Entry)


def test_after_a_streak_of_high_batches_the_oldest_normal_requests_lead_from_any_group() -> None:
    """Anti-starvation looks at every group, not only the groups due."""
    normal, high = entry(group="n", arrival_s=0.0), entry(group="h", priority="high")
    queue = queue_of(normal, high)
    selector = Selector()
    selector.high_streak = HIGH_PRIORITY_STREAK_LIMIT
    due = [group for group in queue if group.key == "h"]
    assert selector.take(queue, due, Limits(4, 0), never_measured, 0.0) == [normal]
    assert selector.high_streak == 0
    assert selector.last_group == "n"


def test_a_plan_asks_each_size_class_once_and_decides_as_asking_each_time() -> None:
    """A batch of 64 one-row requests grows through 7 size classes: its plan asks the
    estimates (they are by size class, as ``BatchTimes``'s) 7 times, not once an entry."""
    times = BatchTimes(lambda: 0.0)
    for rows in (1, 8, 64):
        times.record("g", rows, 0.001 * rows)
    asked: list[int] = []

    def counted(group: Hashable, rows: int) -> float | None:
        asked.append(rows)
        return times.estimate(group, rows)

    deadlines = [10.0] * 40 + [0.05] + [10.0] * 30  # the 41st: 48 rows (~0.06 s) are late
    [group] = queue_of(*(entry(deadline_s=deadline_s) for deadline_s in deadlines))
    quantum = Quantum(1.0, times.fastest)
    plan = plan_batch(group, ("normal",), Limits(64, 0, quantum), counted, now_s=0.0)
    # 41 rows (class 6, scaled from 64 rows: 0.064 s) would end past 0.05 s: it waits.
    assert len(plan.batch) == 40
    assert plan.taken == {"normal": 40}
    assert len({size_class(rows) for rows in asked}) == len(asked)


def _plan_one_rule_at_a_time(
    group: Group, order: tuple[Priority, ...], limits: Limits, estimate: Estimate, now_s: float
) -> Plan:
    """The plan as its rules read, each asked as a function (``Quantum.allows``,
    ``finishes_late``) of the estimates themselves: what ``plan_batch``, which asks each size
    class once, must equal."""
    plan = Plan()
    rows = cost = 0
    finish_by_s = math.inf
    for priority in order:
        taken = 0
        for each in group.lanes[priority]:
            if each.abandoned:
                plan.gone.append(each)
            elif not plan.batch and finishes_late(each, each.rows, math.inf, estimate, now_s):
                plan.late.append(each)
            elif plan.batch and not (
                rows + each.rows <= limits.row_limit
                and not (limits.max_batch_cost and cost + each.cost > limits.max_batch_cost)
                and limits.quantum.allows(each.group, rows + each.rows, cost + each.cost)
                and not finishes_late(each, rows + each.rows, finish_by_s, estimate, now_s)
            ):
                break
            else:
                plan.batch.append(each)
                rows, cost = rows + each.rows, cost + each.cost
                finish_by_s = min(finish_by_s, each.deadline_s)
            taken += 1
        plan.taken[priority] = taken
    return plan


@pytest.mark.parametrize("seed", range(40))
def test_a_plan_equals_its_rules_asked_one_at_a_time(seed: int) -> None:
    """Random lanes (rows, costs, deadlines, priorities), limits (rows, token budget, a
    quantum with a floor or none) and estimates: the plan is the rules' plan."""
    rng = random.Random(seed)
    times = BatchTimes(lambda: 0.0)
    for rows in rng.sample([1, 2, 5, 8, 16, 33, 64], 3):
        times.record("g", rows, rng.uniform(0.0005, 0.002) * rows)
    entries = [
        entry(
            rng.choice([1, 1, 1, 2, 3, 7, 20]),
            priority=rng.choice(["normal", "normal", "high"]),
            arrival_s=index * 0.001,
            deadline_s=rng.choice([100.0, 100.0, 0.02, 0.05, 0.2]),
            cost=rng.choice([0, 8, 32, 128]),
        )
        for index in range(rng.randint(1, 90))
    ]
    [group] = queue_of(*entries)
    quantum = rng.choice(
        [NO_QUANTUM, Quantum(0.03, times.fastest), Quantum(0.01, times.fastest, floor_cost=64)]
    )
    limits = Limits(rng.choice([8, 32, 64]), rng.choice([0, 256, 2048]), quantum)
    order: tuple[Priority, ...] = rng.choice([("high", "normal"), ("normal", "high")])
    now_s = rng.choice([0.0, 0.01])
    planned = plan_batch(group, order, limits, times.estimate, now_s, lambda each: each.abandoned)
    expected = _plan_one_rule_at_a_time(group, order, limits, times.estimate, now_s)
    assert planned == expected


def test_a_frame_queued_at_once_is_queued_as_one_by_one() -> None:
    """``BatchQueue.add_all`` (a frame's entries of one group): the same lanes, in order, and
    the same totals as each added alone."""
    rng = random.Random(7)
    frame = [
        entry(rng.randint(1, 9), priority=rng.choice(["normal", "high"]), cost=rng.randint(0, 64))
        for _ in range(50)
    ]
    at_once, one_by_one = BatchQueue(), BatchQueue()
    at_once.add_all([entry(3, priority="high", cost=5)])  # a group already queued
    one_by_one.add_all([entry(3, priority="high", cost=5)])
    [grown] = at_once.add_all(frame[:30])
    assert at_once.add_all(frame[30:]) == [grown]
    copies = [entry(each.rows, priority=each.priority, cost=each.cost) for each in frame]
    for each in copies:
        one_by_one.add_all([each])
    [group], [expected] = list(at_once), list(one_by_one)
    assert (group.rows, group.cost, group.high_rows) == (
        expected.rows,
        expected.cost,
        expected.high_rows,
    )
    for priority in ("normal", "high"):
        lane = [(each.rows, each.cost) for each in group.lanes[priority]]
        assert lane == [(each.rows, each.cost) for each in expected.lanes[priority]]
    assert at_once.entries == one_by_one.entries == 51
    assert all(each.queued for each in frame)


def test_the_oldest_head_picks_the_group_whatever_the_order_groups_were_queued() -> None:
    queue = queue_of(entry(group="a", arrival_s=2.0), entry(group="b", arrival_s=1.0))
    assert pick_group(list(queue), "normal", last_group=None).key == "b"
    assert pick_group(list(queue), "high", last_group=None).key == "b"  # none high: oldest


def test_the_quantums_rules_at_their_edges() -> None:
    """A batch expected to end exactly at the quantum runs; without a floor even a batch of
    one position is held to the quantum; chunks are the most rows within it, enough for
    ``max_chunks`` (rounded up), and a one-row request is never cut."""

    def tenth_up_to_3_rows(group: Hashable, rows: int) -> float:
        return 0.1 if rows <= 3 else 1.0

    quantum = Quantum(0.1, tenth_up_to_3_rows)
    assert quantum.rows("g", total_rows=8, max_rows=8) == 3
    assert quantum.rows("g", total_rows=1, max_rows=8) == 8
    assert not Quantum(0.1, PerRow(1.0).estimate).allows("g", 1, cost=1)
    assert Quantum(0.1, PerRow(0.06).estimate, max_chunks=4).rows("g", 30, 32) == 8
    floored = Quantum(0.1, PerRow(1.0).estimate, floor_cost=512)
    assert floored.floor_rows(1024) == 1  # one row, however long
    assert floored.rows("g", total_rows=32, max_rows=32) == 1  # no cost given: no floor rows


def test_a_request_that_fits_one_chunk_is_itself_and_unmeasured_groups_wait_nothing() -> None:
    payload = [1, 2, 3]
    assert chunks_of(payload, 3, max_batch_size=3, max_batch_cost=0, cost_per_row=0)[0] is payload
    assert chunks_of(payload, 3, 2, 0, 0) == [[1, 2], [3]]
    queue = queue_of(*(entry() for _ in range(5)))
    assert estimated_wait_s(queue, "normal", 0.0, 4, 0, never_measured) == 0.0


def test_taking_a_batch_takes_its_rows_cost_and_high_rows_out_of_the_totals() -> None:
    queue = queue_of(entry(2, cost=5), entry(1, cost=3, priority="high"), entry(4, cost=7))
    [group] = list(queue)
    queue.pop_heads(group, "normal", 1)
    queue.pop_heads(group, "high", 1)
    assert (group.rows, group.cost, group.high_rows, queue.entries) == (4, 7, 0, 1)
