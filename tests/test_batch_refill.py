"""The adaptive policy's refill wait: how long it waits for the clients a batch answered."""

from __future__ import annotations

import pytest

from service.engine.batcher.adaptive import (
    REFILL_CAP_FACTOR,
    AdaptivePolicy,
    Returns,
    next_turnaround_s,
    refill_until_s,
)
from service.engine.batcher.policy import Target
from service.engine.batcher.queue import Entry
from service.engine.batcher.selection import Limits, Quantum
from tests.test_batch_selection import entry, never_measured, queue_of


def from_source(source: str) -> Entry:
    answered = entry()
    answered.source = source
    return answered


def test_the_wait_is_max_wait_or_the_turnaround_while_clients_are_out_within_a_cap() -> None:
    assert refill_until_s(10.0, outstanding=0, turnaround_s=0.3, max_wait_s=0.1) == 10.1
    assert refill_until_s(10.0, outstanding=3, turnaround_s=0.0, max_wait_s=0.1) == 10.1
    assert refill_until_s(10.0, outstanding=3, turnaround_s=0.3, max_wait_s=0.1) == 10.3
    capped = refill_until_s(10.0, outstanding=3, turnaround_s=9.0, max_wait_s=0.1)
    assert capped == pytest.approx(10.0 + REFILL_CAP_FACTOR * 0.1)


def test_the_turnaround_follows_complete_returns_and_rises_on_late_ones() -> None:
    assert next_turnaround_s(0.0, 0.2, complete=True) == 0.2  # the first one is the estimate
    assert next_turnaround_s(0.2, 0.1, complete=True) == pytest.approx(0.175)
    assert next_turnaround_s(0.2, 0.6, complete=True) == pytest.approx(0.3)
    # Not all back yet when the next batch was answered: at least that long.
    assert next_turnaround_s(0.2, 0.1, complete=False) == 0.2
    assert next_turnaround_s(0.2, 0.6, complete=False) == pytest.approx(0.3)


def test_returns_count_the_clients_of_the_last_batch_by_front_end() -> None:
    returns = Returns()
    returns.arrived("a", 5, now_s=1.0)  # nothing answered yet: nobody owed
    assert returns.outstanding == 0
    returns.answered([from_source("a"), from_source("a"), from_source("b")], now_s=2.0)
    assert returns.outstanding == 3
    returns.arrived("a", 5, now_s=2.1)  # more than it was answered: two of them are back
    assert returns.outstanding == 1
    returns.arrived("c", 1, now_s=2.2)  # another front end's client is not one of them
    assert returns.outstanding == 1
    assert returns.until_s(max_wait_s=0.1) == pytest.approx(2.1)  # no turnaround known yet
    returns.arrived("b", 1, now_s=2.3)
    assert returns.outstanding == 0
    assert returns.turnaround_s == pytest.approx(0.3)  # all back 0.3 s after the answer

    returns.answered([from_source("a"), from_source("b")], now_s=3.0)
    assert returns.until_s(max_wait_s=0.1) == pytest.approx(3.3)
    returns.arrived("b", 1, now_s=3.05)
    returns.answered([from_source("a")], now_s=3.5)  # "a" not back 0.5 s after: later
    assert returns.turnaround_s == pytest.approx(0.3 + 0.25 * 0.2)


def test_the_refill_wait_never_makes_the_head_of_a_group_late() -> None:
    [group] = queue_of(entry(arrival_s=10.0, deadline_s=10.4))
    adaptive = AdaptivePolicy(0.1)
    adaptive.answered([from_source("a")], now_s=10.0)
    adaptive.returns.turnaround_s = 0.3  # the refill wait ends at 10.3

    def due_at_s(run_s: float) -> float:
        return adaptive.due_at_s(group, Target(2, 4), True, Limits(4, 0), lambda g, r: run_s)

    assert due_at_s(0.0) == pytest.approx(10.3)
    # A batch that takes 0.2 s must start by 10.2 to answer its head by 10.4.
    assert due_at_s(0.2) == pytest.approx(10.2)
    # Never before the head's own max_wait, as without a refill wait.
    assert due_at_s(0.35) == pytest.approx(10.1)
    assert adaptive.due_at_s(group, Target(2, 4), True, Limits(4, 0), never_measured) == (
        pytest.approx(10.3)
    )


def test_the_refill_wait_is_capped_at_four_max_waits() -> None:
    assert refill_until_s(10.0, outstanding=1, turnaround_s=9.0, max_wait_s=0.1) == (
        pytest.approx(10.4)
    )


def test_a_complete_return_quicker_than_the_estimate_lowers_it() -> None:
    returns = Returns()
    returns.turnaround_s = 0.3
    returns.answered([from_source("a")], now_s=1.0)
    returns.arrived("a", 1, now_s=1.1)
    assert returns.turnaround_s == pytest.approx(0.3 + 0.25 * (0.1 - 0.3))


def test_each_front_end_owes_the_clients_its_requests_of_the_last_batch() -> None:
    returns = Returns()
    returns.answered([from_source("a"), from_source("a"), from_source("b")], now_s=1.0)
    for outstanding in (2, 1, 1):  # the third from "a" is not one of those answered
        returns.arrived("a", 1, now_s=1.1)
        assert returns.outstanding == outstanding


def test_the_policy_counts_the_clients_back_and_splits_only_on_word_from_the_front_ends() -> None:
    adaptive = AdaptivePolicy(0.1, instances=2)
    assert adaptive.target(8) == Target(1, 8, look_again=True)  # no word: no split
    adaptive.answered([from_source("a")], now_s=1.0)
    adaptive.arrived("a", 1, now_s=1.05)
    assert adaptive.returns.outstanding == 0
    one_held = AdaptivePolicy(0.1, lambda: 1, instances=2)
    assert one_held.target(8) == Target(1, 1, look_again=True)


def test_the_refill_wait_is_bounded_by_the_earliest_deadline_of_either_lane() -> None:
    [group] = queue_of(
        entry(arrival_s=10.0, deadline_s=20.0, priority="high"),
        entry(arrival_s=10.0, deadline_s=10.4),
    )
    adaptive = AdaptivePolicy(0.1)
    adaptive.answered([from_source("a")], now_s=10.0)
    adaptive.returns.turnaround_s = 0.3
    due_s = adaptive.due_at_s(group, Target(4, 4), True, Limits(4, 0), lambda g, r: 0.2)
    assert due_s == pytest.approx(10.2)


def test_no_refill_wait_where_the_quantum_would_not_let_one_more_row_join() -> None:
    """A batch of 3 rows would run past the quantum, one of 2 would not: a group of 2 waits
    for no refill; one costing exactly the floor once grown by its average row does."""

    def seconds(group: object, rows: int) -> float:
        return 0.05 if rows <= 2 else 0.2

    adaptive = AdaptivePolicy(0.1)
    adaptive.answered([from_source("a")], now_s=10.0)
    adaptive.returns.turnaround_s = 0.3
    target = Target(4, 4)
    [two] = queue_of(entry(arrival_s=10.0), entry(arrival_s=10.0))
    limits = Limits(4, 0, Quantum(0.1, seconds))
    assert adaptive.due_at_s(two, target, True, limits, never_measured) == pytest.approx(10.1)
    [costly] = queue_of(*(entry(arrival_s=10.0, cost=cost) for cost in (3, 3, 4)))
    floored = Limits(4, 0, Quantum(0.1, seconds, floor_cost=13))  # 10 + 10 // 3 = 13
    assert adaptive.due_at_s(costly, target, True, floored, never_measured) == (pytest.approx(10.3))
