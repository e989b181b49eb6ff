"""The batcher's clock and its deadlines: one heap, one timer, entries expiring together."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from service.engine.batcher.clock import COMPACT_AT_LEAST, Deadlines, MonotonicClock
from tests.fixtures import SteppedClock

NOW_S = 1000.0


@dataclass(eq=False)
class Work:
    """What a deadline watches (``queue.Entry``'s two fields)."""

    deadline_s: float
    done: bool = False


@pytest.fixture
def clock() -> SteppedClock:
    clock = SteppedClock()
    clock.freeze(NOW_S)
    return clock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_monotonic_clock_schedules_by_the_delay_on_the_running_loop() -> None:
    clock = MonotonicClock()
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()
    soon = clock.call_at(clock.now() + 0.5, fired.set)
    assert isinstance(soon, asyncio.TimerHandle)
    assert soon.when() - loop.time() == pytest.approx(0.5, abs=0.05)
    soon.cancel()
    past = clock.call_at(clock.now() - 10.0, fired.set)  # due already: on the next turn
    assert isinstance(past, asyncio.TimerHandle)
    assert past.when() <= loop.time()
    async with asyncio.timeout(5):
        await fired.wait()


async def test_entries_expire_at_their_deadline_exactly_and_together(clock: SteppedClock) -> None:
    expired: list[list[Work]] = []
    deadlines = Deadlines[Work](clock, expired.append)
    assert len(deadlines) == 0
    frame = [Work(NOW_S + 1.0), Work(NOW_S + 1.0)]
    later = [Work(NOW_S + 2.0)]
    deadlines.add_all(frame)
    deadlines.add_all(later)
    assert len(deadlines) == 3
    assert clock.armed == [NOW_S + 1.0]  # one timer, for the earliest
    clock.advance(0.5)
    await settle()
    assert expired == []
    clock.advance(0.5)  # exactly at the deadline
    await settle()
    assert expired == [frame]
    assert len(deadlines) == 1
    assert clock.armed == [NOW_S + 2.0]
    clock.advance(1.0)
    await settle()
    assert expired == [frame, later]
    assert len(deadlines) == 0
    assert clock.armed == []


async def test_an_earlier_deadline_rearms_the_one_timer(clock: SteppedClock) -> None:
    expired: list[list[Work]] = []
    deadlines = Deadlines[Work](clock, expired.append)
    deadlines.add_all([Work(NOW_S + 5.0)])
    deadlines.add_all([Work(NOW_S + 9.0)])
    assert clock.armed == [NOW_S + 5.0]
    soonest = Work(NOW_S + 1.0)
    deadlines.add_all([soonest])
    assert clock.armed == [NOW_S + 1.0]
    clock.advance(1.0)
    await settle()
    assert expired == [[soonest]]
    deadlines.close()
    assert clock.armed == []


async def test_an_item_whose_entries_differ_expires_each_at_its_own_deadline(
    clock: SteppedClock,
) -> None:
    expired: list[list[Work]] = []
    deadlines = Deadlines[Work](clock, expired.append)
    soon, later, answered = Work(NOW_S + 1.0), Work(NOW_S + 3.0), Work(NOW_S + 1.0, done=True)
    deadlines.add_all([soon, later, answered])
    clock.advance(1.0)
    await settle()
    assert expired == [[soon]]
    assert len(deadlines) == 1  # the later one, back in the heap; the answered one let go
    clock.advance(2.0)
    await settle()
    assert expired == [[soon], [later]]


async def test_answered_items_at_the_head_are_let_go_of_when_the_next_comes(
    clock: SteppedClock,
) -> None:
    deadlines = Deadlines[Work](clock, lambda expired: None)
    first, second = [Work(NOW_S + 1.0)], [Work(NOW_S + 2.0), Work(NOW_S + 2.0)]
    deadlines.add_all(first)
    deadlines.add_all(second)
    for work in first + second:
        work.done = True
    deadlines.add_all([Work(NOW_S + 9.0)])
    assert len(deadlines) == 1
    deadlines.close()


async def test_the_heap_is_compacted_by_entries_and_keeps_its_order(clock: SteppedClock) -> None:
    """Compacted once it holds ``COMPACT_AT_LEAST`` entries, or twice what it held after the
    last compaction; the entries still waiting keep their order (the earliest expires first)."""
    expired: list[list[Work]] = []
    deadlines = Deadlines[Work](clock, expired.append)

    def answered(count: int) -> None:
        for _ in range(count):
            deadlines.add_all([Work(NOW_S + 100.0, done=True)])

    waiting = Work(NOW_S + 50.0)  # never answered: the head, so nothing behind it is let go
    deadlines.add_all([waiting])
    answered(COMPACT_AT_LEAST - 1)
    assert len(deadlines) == COMPACT_AT_LEAST  # compacted when the next one comes
    live = [Work(NOW_S + 10.0 + (index * 7919) % 3_000) for index in range(3_000)]
    deadlines.add_all(live[:1])
    assert len(deadlines) == 2
    for work in live[1:]:
        deadlines.add_all([work])
    answered(COMPACT_AT_LEAST - 3_001)
    assert len(deadlines) == COMPACT_AT_LEAST
    answered(1)  # compacted to the 3,001 waiting: next at twice that
    assert len(deadlines) == 3_002
    answered(6_002 - 3_002)
    assert len(deadlines) == 6_002
    answered(1)
    assert len(deadlines) == 3_002
    due: dict[float, set[int]] = {}
    for work in [*live, waiting]:
        due.setdefault(work.deadline_s, set()).add(id(work))
    for deadline_s in sorted(due):  # each expires at its own deadline, after both compactions
        clock.advance(deadline_s - clock.now())
        await settle()
        assert {id(work) for batch in expired for work in batch} == due[deadline_s]
        expired.clear()
    assert len(deadlines) == 0
    deadlines.close()
