"""The batcher's time: one clock, and every request's deadline on one heap with one timer.

Every piece of the batcher reads ``now`` from the clock or is handed it, so a test moves time
on by itself (``tests.fixtures.SteppedClock``) and fires the timers that came due, instead of
sleeping. Times are ``time.monotonic()`` seconds, which is system-wide: a front end in another
process sets a request's deadline on the same clock.

Deadlines: the entries queued together (a front end's frame) share one heap item under their
earliest deadline, and one timer is armed for the earliest deadline of all, rather than a
timer per request. When an item comes due, its entries whose own deadline has come expire and
the others go back in the heap under theirs. An entry answered before its deadline stays in
the heap, holding nothing large (``Entry.done``), until its item comes up or the heap is
compacted. The heap is compacted by the entries it holds, not its items: a front end whose
deadlines all come later than another's would otherwise keep its answered frames alive.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


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


class Expiring(Protocol):
    """What a deadline watches (``queue.Entry``)."""

    @property
    def done(self) -> bool: ...

    @property
    def deadline_s(self) -> float: ...


E = TypeVar("E", bound=Expiring)

#: The heap is compacted (answered entries dropped) when it holds this many entries, or twice
#: what it held after the last compaction, whichever is more.
COMPACT_AT_LEAST = 4096


class Deadlines(Generic[E]):
    """Calls ``expire(entries)`` with the unanswered entries whose ``deadline_s`` has come, all
    at once (the chunks of one request expire together)."""

    def __init__(self, clock: Clock, expire: Callable[[list[E]], None]) -> None:
        self._clock = clock
        self._expire = expire
        self._heap: list[tuple[float, int, Sequence[E]]] = []
        self._order = itertools.count()
        self._timer: Timer | None = None
        self._armed_s = float("inf")
        self._compact_at = COMPACT_AT_LEAST
        self._entries = 0  # in the heap's items, answered or not

    def __len__(self) -> int:
        """Entries watched, and answered ones not let go of yet."""
        return self._entries

    def add_all(self, entries: Sequence[E]) -> None:
        """Watch ``entries`` (one heap item for them all; ``entries`` is kept, not copied)."""
        if not entries:
            return
        heap = self._heap
        # The oldest items are usually answered: let go of them now rather than at their
        # deadline.
        while heap and _all_done(heap[0][2]):
            self._entries -= len(heapq.heappop(heap)[2])
        if self._entries >= self._compact_at:
            self._compact()
            heap = self._heap
        earliest_s = min(entry.deadline_s for entry in entries)
        heapq.heappush(heap, (earliest_s, next(self._order), entries))
        self._entries += len(entries)
        if earliest_s < self._armed_s:
            self._arm(earliest_s)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._armed_s = float("inf")

    def _arm(self, when_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_s = when_s
        self._timer = self._clock.call_at(when_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._armed_s = float("inf")
        heap = self._heap
        now_s = self._clock.now()
        expired: list[E] = []
        later: list[E] = []
        while heap and (heap[0][0] <= now_s or _all_done(heap[0][2])):
            _, _, entries = heapq.heappop(heap)
            self._entries -= len(entries)
            for entry in entries:
                if not entry.done:
                    (expired if entry.deadline_s <= now_s else later).append(entry)
        if later:
            earliest_s = min(entry.deadline_s for entry in later)
            heapq.heappush(heap, (earliest_s, next(self._order), later))
            self._entries += len(later)
        if expired:
            self._expire(expired)
        if heap:
            self._arm(heap[0][0])

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if not _all_done(item[2])]
        heapq.heapify(self._heap)
        self._entries = sum(len(item[2]) for item in self._heap)
        self._compact_at = max(COMPACT_AT_LEAST, 2 * self._entries)


def _all_done(entries: Sequence[Expiring]) -> bool:
    return all(entry.done for entry in entries)
