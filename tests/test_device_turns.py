"""``DeviceTurns``: the model that has used the device least goes next, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from service.engine.device_turns import DeviceTurns


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def busy_model(
    turns: DeviceTurns, clock: Clock, name: str, batch_s: float, order: list[str], count: int
) -> None:
    """A model that always has a batch waiting, each taking ``batch_s`` of device time."""
    for _ in range(count):
        async with turns.for_model(name).turn():
            order.append(name)
            clock.now_s += batch_s
            await asyncio.sleep(0)  # the others ask for their turn meanwhile


async def test_a_model_with_short_batches_gets_as_much_device_time_as_one_with_long_ones() -> None:
    """Batches of 40 and of 10: the short model runs about four batches per long one, so
    both get about half the device; turn by turn, a batch each would give it a fifth."""
    clock = Clock()
    turns = DeviceTurns(clock)
    order: list[str] = []
    await asyncio.gather(
        busy_model(turns, clock, "long", 40.0, order, 10),
        busy_model(turns, clock, "short", 10.0, order, 100),
    )
    first_half = order[: len(order) // 2]
    assert 3.5 <= first_half.count("short") / first_half.count("long") <= 4.5
    assert abs(turns.used_s("long") - 400.0) < 1e-9
    assert abs(turns.used_s("short") - 1000.0) < 1e-9


async def test_a_model_back_from_idle_does_not_take_the_device_for_its_idle_time() -> None:
    """'late' asks after 'early' has used 100: it starts level with 'early', so the two
    alternate instead of 'late' running ten batches in a row."""
    clock = Clock()
    turns = DeviceTurns(clock)
    order: list[str] = []
    await busy_model(turns, clock, "early", 10.0, order, 10)
    order.clear()
    await asyncio.gather(
        busy_model(turns, clock, "early", 10.0, order, 5),
        busy_model(turns, clock, "late", 10.0, order, 5),
    )
    assert order[:4] in (["early", "late", "early", "late"], ["late", "early", "late", "early"])


async def test_a_waiter_cancelled_before_or_after_its_turn_never_keeps_the_device() -> None:
    turns = DeviceTurns(Clock())
    await turns.acquire("a")
    waiting = asyncio.create_task(turns.acquire("b"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    turns.release("a")
    await asyncio.wait_for(turns.acquire("c"), timeout=1)  # free: nobody kept it
    granted_then_cancelled = asyncio.create_task(turns.acquire("d"))
    await asyncio.sleep(0)
    turns.release("c")  # d is granted the device...
    granted_then_cancelled.cancel()  # ...and cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await granted_then_cancelled
    await asyncio.wait_for(turns.acquire("e"), timeout=1)


async def test_a_background_model_starts_only_on_an_idle_device_and_holds_nobody_back() -> None:
    """A shadow candidate's turn (background) waits while a served model holds the device
    or waits for it, begins once the device is idle, and a served model's turn begins while
    the background batch still runs."""
    clock = Clock()
    turns = DeviceTurns(clock)
    served = turns.for_model("served")
    shadow = turns.for_model("served@shadow", background=True)
    await served.acquire()
    background = asyncio.create_task(shadow.acquire())
    await asyncio.sleep(0)
    assert not background.done()  # the served model holds the device
    served.release()  # anticipation: the device is kept for it a moment, then idle
    await asyncio.wait_for(background, timeout=1)
    assert turns.idle  # the background batch holds nobody back...
    await asyncio.wait_for(served.acquire(), timeout=1)  # ...a served turn begins at once
    shadow.release()  # its batch ends: nothing to hand on
    assert not turns.idle
    served.release()
