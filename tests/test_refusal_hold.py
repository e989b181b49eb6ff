"""Refusals for load held for connections that resend before their ``Retry-After``: pure
arithmetic on a stepped clock, no sleeps."""

from __future__ import annotations

from service.errors import InvalidInputError, OverloadedError, QueueFullError
from service.frontend import refusal_hold
from service.frontend.refusal_hold import RefusalHolds, hold_s, retry_after_s
from tests.fixtures import SteppedClock


def test_only_refusals_for_load_have_a_retry_after_to_enforce() -> None:
    assert retry_after_s(QueueFullError("full")) == 1.0
    assert retry_after_s(OverloadedError("late", retry_after_s=3)) == 3.0
    assert retry_after_s(InvalidInputError("bad")) is None


def test_a_hold_lasts_until_the_last_retry_after_ends_within_the_cap() -> None:
    assert hold_s(None, now_s=5.0, max_hold_s=2.0) == 0.0
    assert hold_s(5.75, now_s=5.0, max_hold_s=2.0) == 0.75
    assert hold_s(9.0, now_s=5.0, max_hold_s=2.0) == 2.0
    assert hold_s(4.0, now_s=5.0, max_hold_s=2.0) == 0.0  # it waited: answered at once


def test_a_client_that_resends_at_once_is_held_until_its_retry_after_ends() -> None:
    """Issue 23, finding 4: 64 clients resending every 429 at once made thousands of refusals
    a second, which took the CPU the forward needed. The first refusal on a connection is
    answered at once; the connection's next one, sent before its ``Retry-After`` passed, waits
    until it has: one refusal per client per ``Retry-After``."""
    clock = SteppedClock()
    clock.freeze()
    holds = RefusalHolds(max_hold_ms=2000, now=clock.now, draw=lambda: 1.0)
    greedy, patient, other = ("127.0.0.1", 4000), ("127.0.0.1", 4001), ("127.0.0.1", 4002)
    assert holds.refused(greedy, QueueFullError("full")) == 0.0
    assert holds.refused(patient, QueueFullError("full")) == 0.0
    assert holds.refused(greedy, QueueFullError("full")) == 1.0  # resent at once
    clock.advance(1.0)  # the held answer goes out; the greedy client resends at once again
    assert holds.refused(greedy, QueueFullError("full")) == 1.0
    clock.advance(0.5)
    assert holds.refused(patient, QueueFullError("full")) == 0.0  # waited its Retry-After
    assert holds.refused(other, InvalidInputError("bad")) == 0.0
    assert RefusalHolds(max_hold_ms=0, now=clock.now).refused(greedy, QueueFullError("x")) == 0


def test_holds_are_spread_so_the_clients_refused_together_do_not_come_back_together() -> None:
    clock = SteppedClock()
    clock.freeze()
    draws = iter([0.0, 0.5, 0.0, 0.5])
    holds = RefusalHolds(max_hold_ms=2000, now=clock.now, draw=lambda: next(draws))
    first, second = ("127.0.0.1", 1), ("127.0.0.1", 2)
    assert holds.refused(first, QueueFullError("full")) == 0.0
    assert holds.refused(second, QueueFullError("full")) == 0.0
    assert holds.refused(first, QueueFullError("full")) == refusal_hold.HELD_FRACTION
    assert holds.refused(second, QueueFullError("full")) == 0.75


def test_the_connections_remembered_are_bounded() -> None:
    clock = SteppedClock()
    clock.freeze()
    holds = RefusalHolds(max_hold_ms=2000, now=clock.now)
    for port in range(refusal_hold.MAX_CONNECTIONS + 10):
        holds.refused(("10.0.0.1", port), QueueFullError("full"))
    assert len(holds) <= refusal_hold.MAX_CONNECTIONS


def test_a_hold_ends_before_the_callers_own_deadline() -> None:
    """A gRPC call held past its deadline would see ``DEADLINE_EXCEEDED``, not the refusal."""
    share = refusal_hold.DEADLINE_SHARE_HELD
    assert hold_s(9.0, now_s=5.0, max_hold_s=2.0, time_left_s=1.0) == share
    assert hold_s(9.0, now_s=5.0, max_hold_s=2.0, time_left_s=10.0) == 2.0
    assert hold_s(9.0, now_s=5.0, max_hold_s=2.0, time_left_s=-1.0) == 0.0
    assert hold_s(None, now_s=5.0, max_hold_s=2.0, time_left_s=1.0) == 0.0
