"""Deadlines of every entry queued or running: one heap and one timer per batcher.

A timer per request cost a timer handle, a heap push into the event loop and a cancel on every
answer; here an entry costs one ``heappush``, and the one timer is armed for the earliest
deadline. Entries answered before their deadline stay in the heap, let go of their payload
(``Entry.done``), until their deadline comes up or the heap is compacted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from service.engine.batch_clock import Clock, Timer
from service.engine.batch_queue import Entry

#: The heap is compacted (answered entries dropped) when it holds this many entries, or twice
#: what it held after the last compaction, whichever is more.
COMPACT_AT_LEAST = 1024


class Deadlines:
    """Calls ``expire(entries)`` with the unanswered entries whose ``deadline_s`` has come,
    all at once (the chunks of one request expire together)."""

    def __init__(self, clock: Clock, expire: Callable[[list[Entry]], None]) -> None:
        self._clock = clock
        self._expire = expire
        self._heap: list[tuple[float, int, Entry]] = []
        self._order = itertools.count()
        self._timer: Timer | None = None
        self._armed_s = float("inf")
        self._compact_at = COMPACT_AT_LEAST

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, entry: Entry) -> None:
        heap = self._heap
        if len(heap) >= self._compact_at:
            self._compact()
        heapq.heappush(heap, (entry.deadline_s, next(self._order), entry))
        if entry.deadline_s < self._armed_s:
            self._arm(entry.deadline_s)

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
        expired = []
        while heap and (heap[0][2].done or heap[0][0] <= now_s):
            _, _, entry = heapq.heappop(heap)
            if not entry.done:
                expired.append(entry)
        if expired:
            self._expire(expired)
        if heap:
            self._arm(heap[0][0])

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if not item[2].done]
        heapq.heapify(self._heap)
        self._compact_at = max(COMPACT_AT_LEAST, 2 * len(self._heap))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._armed_s = float("inf")
