"""Turns on a device shared by several models: the model that has used it least goes next.

Each model's batcher holds a turn while it takes a batch and runs it (and a version's warm-up
holds its model's turns, batch by batch), so one batch runs on the device at a time. When the
device is free and several models wait, the one with the least device time so far gets it:
fair in device time, not in batches, so a model whose batches take 1 ms is not held to one
batch per 50 ms batch of another (start-time fair queuing, as in network schedulers). A model
that was idle is lifted to the least time of those waiting or running when it asks again, so it
cannot bank idle time and then hold the device for long.

A model that has just finished a batch and has had less device time than every model waiting
keeps the device for ``ANTICIPATION_S``: it asks again at once when more of its requests are
queued, and handing the device on in the meantime would give the turns out a batch each.

A batch is taken when its model's turn comes, not before: requests that arrive while it waits
join it.

A background model (a shadow candidate: ``engine/shadow.py``, on a thread of its own) starts a
batch only when no model holds the device or waits for it, and holds nobody back: a served
model's turn may begin while a background batch runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

#: How long the device is kept for a model that has just finished a batch and is owed device
#: time: it asks again at once when more of its requests are queued.
ANTICIPATION_S = 0.001


class DeviceTurns:
    """The turns of every model on one device."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._used_s: dict[str, float] = {}
        self._released_s: dict[str, float] = {}
        self._waiting: list[tuple[str, asyncio.Future[None]]] = []
        self._holder: str | None = None
        self._held_since_s = 0.0
        self._granted_s = -math.inf
        """When the last turn was granted."""
        self._virtual_s = 0.0
        """The device time of the model granted last, when it was granted."""
        self._kept_for: str | None = None
        self._keeping: asyncio.TimerHandle | None = None
        self._background: set[str] = set()
        self._idle_waiters: list[asyncio.Future[None]] = []
        """Background models waiting for the device to be idle."""

    def for_model(self, name: str, *, background: bool = False) -> ModelTurns:
        """``name``'s turns; a ``background`` model's begin only when the device is idle and
        exclude no other model."""
        if background:
            self._background.add(name)
        return ModelTurns(self, name)

    @property
    def idle(self) -> bool:
        """No model holds the device, waits for it, or keeps it (``ANTICIPATION_S``)."""
        return self._holder is None and self._kept_for is None and not self._waiting

    def waiting_besides(self, name: str) -> bool:
        """A model other than ``name`` waits for the device."""
        return any(waiting != name for waiting, _ in self._waiting)

    def used_s(self, name: str) -> float:
        """Device time ``name`` has had (lifted when it came back from idle)."""
        return self._used_s.get(name, 0.0)

    async def acquire(self, name: str) -> None:
        """Wait until ``name`` may use the device."""
        if name in self._background:
            await self._idle()
            return
        self._lift(name)
        if self._holder is None and (
            self._kept_for == name or (self._kept_for is None and not self._waiting)
        ):
            self._grant(name, self._clock())
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((name, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(name)  # granted, but its holder is gone
            else:
                self._waiting.remove((name, granted))
            raise

    def release(self, name: str) -> None:
        """``name`` is done with the device: count its time, hand the device on (after
        ``ANTICIPATION_S`` when ``name`` has had less than every model waiting)."""
        if name in self._background:
            return
        if self._holder != name:
            raise RuntimeError(f"{name} releases a turn held by {self._holder}")
        now_s = self._clock()
        self._used_s[name] = self.used_s(name) + now_s - self._held_since_s
        self._released_s[name] = now_s
        self._holder = None
        if not self._waiting:
            self._wake_background()
            return
        if self.used_s(name) < min(self.used_s(waiting) for waiting, _ in self._waiting):
            self._kept_for = name
            self._keeping = asyncio.get_running_loop().call_later(ANTICIPATION_S, self._hand_on)
            return
        self._hand_on()

    def forget(self, name: str) -> None:
        """``name`` is served no more."""
        self._used_s.pop(name, None)
        self._released_s.pop(name, None)
        self._background.discard(name)

    def _hand_on(self) -> None:
        """The device to the waiting model that has had the least of it."""
        self._kept_for = None
        if self._keeping is not None:
            self._keeping.cancel()
            self._keeping = None
        if self._holder is not None:
            return
        if not self._waiting:
            self._wake_background()
            return
        index = min(range(len(self._waiting)), key=lambda i: self.used_s(self._waiting[i][0]))
        name, granted = self._waiting.pop(index)
        self._grant(name, self._clock())
        granted.set_result(None)

    async def _idle(self) -> None:
        """Wait until the device is idle (at once when it is)."""
        while not self.idle:
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._idle_waiters:
                    self._idle_waiters.remove(waiter)

    def _wake_background(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _grant(self, name: str, now_s: float) -> None:
        if self._keeping is not None:
            self._keeping.cancel()
            self._keeping = None
        self._kept_for = None
        self._holder = name
        self._held_since_s = now_s
        self._granted_s = now_s
        self._virtual_s = self.used_s(name)

    def _lift(self, name: str) -> None:
        """A model that has had no turn since before the last one was granted was idle: it
        starts level with the model granted last, not with what it saved while idle."""
        if self._released_s.get(name, -math.inf) < self._granted_s:
            self._used_s[name] = max(self.used_s(name), self._virtual_s)


class ModelTurns:
    """One model's turns on its device."""

    def __init__(self, turns: DeviceTurns, name: str) -> None:
        self._turns = turns
        self.name = name

    async def acquire(self) -> None:
        await self._turns.acquire(self.name)

    def release(self) -> None:
        self._turns.release(self.name)

    @property
    def contended(self) -> bool:
        """Another model waits for the device."""
        return self._turns.waiting_besides(self.name)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class HeldTurn:
    """A batcher's hold on its model's turn: taken before a batch is taken, released after
    it ran (or when what it waited for is gone). No turns (a device with one model): free."""

    def __init__(self, turns: ModelTurns | None) -> None:
        self._turns = turns
        self._holding = False

    async def take(self) -> bool:
        """Wait for the turn; whether it had to wait (requests may have arrived meanwhile:
        look again)."""
        if self._turns is None or self._holding:
            return False
        await self._turns.acquire()
        self._holding = True
        return True

    @property
    def contended(self) -> bool:
        """Another model waits for the device."""
        return self._turns is not None and self._turns.contended

    def release(self) -> None:
        if self._holding:
            assert self._turns is not None
            self._holding = False
            self._turns.release()
