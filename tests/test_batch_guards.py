"""The stall watch (``batcher.run.StallWatch``): one timer for every running batch, on a
stepped clock (no sleeps)."""

from __future__ import annotations

import asyncio

from service.engine.batcher.run import StallWatch
from tests.fixtures import SteppedClock


async def _turn() -> None:
    for _ in range(3):  # the timers that came due run on the loop's next turns
        await asyncio.sleep(0)


async def test_a_batch_is_reported_once_it_outlives_the_timeout_after_a_quicker_one() -> None:
    clock = SteppedClock()
    clock.freeze()
    stalls: list[str] = []
    watch = StallWatch(clock, 10.0, lambda: stalls.append("stalled"))
    first = watch.started(clock.now())
    clock.advance(4.0)
    watch.finished(first)
    second = watch.started(clock.now())  # the timer armed for the first still stands
    clock.advance(6.0)
    await _turn()
    assert stalls == []
    assert not watch.stalled
    clock.advance(3.9)
    await _turn()
    assert stalls == []
    clock.advance(0.1)
    await _turn()
    assert stalls == ["stalled"]
    assert watch.stalled
    watch.finished(second)
    third = watch.started(clock.now())
    clock.advance(20.0)
    await _turn()
    assert stalls == ["stalled"]  # reported once
    watch.finished(third)
    watch.close()


async def test_batches_that_come_back_in_time_are_never_reported_and_arm_one_timer() -> None:
    clock = SteppedClock()
    clock.freeze()
    stalls: list[str] = []
    watch = StallWatch(clock, 10.0, lambda: stalls.append("stalled"))
    for _ in range(50):
        batch = watch.started(clock.now())
        clock.advance(1.0)
        await _turn()
        watch.finished(batch)
    assert stalls == []
    assert not watch.stalled
    assert len(clock._timers) == 1  # one timer watches them all, re-armed as they return
    watch.close()
    assert clock._timers == []


async def test_no_timer_without_a_stall_timeout() -> None:
    clock = SteppedClock()
    watch = StallWatch(clock, 0.0, None)
    watch.finished(watch.started(clock.now()))
    assert clock._timers == []


async def test_of_batches_running_at_once_the_oldest_is_reported_when_it_outlives_the_timeout() -> (
    None
):
    clock = SteppedClock()
    clock.freeze()
    stalls: list[str] = []
    watch = StallWatch(clock, 10.0, lambda: stalls.append("stalled"))
    first = watch.started(clock.now())
    clock.advance(5.0)
    second = watch.started(clock.now())  # two instances: both run
    clock.advance(5.0)
    await _turn()
    assert stalls == ["stalled"]  # the first, at its 10 s
    watch.finished(first)
    watch.finished(second)
    watch.close()


async def test_a_batch_still_running_is_watched_when_another_comes_back() -> None:
    clock = SteppedClock()
    clock.freeze()
    stalls: list[str] = []
    watch = StallWatch(clock, 10.0, lambda: stalls.append("stalled"))
    first = watch.started(clock.now())
    clock.advance(1.0)
    second = watch.started(clock.now())
    watch.finished(first)
    clock.advance(9.5)
    await _turn()
    assert stalls == []
    clock.advance(0.5)  # the second has run 10 s
    await _turn()
    assert stalls == ["stalled"]
    watch.finished(second)
    watch.close()
