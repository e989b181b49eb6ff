"""The batcher's one clock: what time it is, and a callback at a given time.

Every piece of the batcher reads ``now`` from here or is handed it, so a test moves time on
by itself (``tests.fixtures.SteppedClock``) and fires the timers that came due, instead of
sleeping. Times are ``time.monotonic()`` seconds, which is system-wide: a front end in another
process sets a request's deadline on the same clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on the ``time.monotonic()`` scale."""
        ...

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback`` on the event loop once ``now()`` reaches ``when_s``."""
        ...


class MonotonicClock:
    """``time.monotonic()``, with timers on the running event loop."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        # The loop's clock may be coarser than time.monotonic() (uvloop's counts milliseconds):
        # schedule by the delay, not by an absolute loop time.
        delay_s = max(0.0, when_s - time.monotonic())
        return asyncio.get_running_loop().call_later(delay_s, callback)
