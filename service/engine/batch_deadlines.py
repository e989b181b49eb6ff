"""Deadlines of every entry queued or running: one heap and one timer per batcher.

A timer per request cost a timer handle, a heap push into the event loop and a cancel on every
answer; here the entries queued together (a front end's frame, one group) cost one
``heappush`` between them, under their earliest deadline, and the one timer is armed for the
earliest deadline of all. When an item's deadline comes, its entries whose own deadline has
come expire and the others go back in the heap under theirs. Entries answered before their
deadline stay in the heap, let go of their payload (``Entry.done``), until their deadline comes
up or the heap is compacted. The heap is compacted by the entries it holds, not its items: an
item is a frame's entries, and a front end whose deadlines all come later than another's (its
items never reach the head while the other has one waiting) would otherwise keep 1,024
frames of answered entries alive, each walked by every full garbage collection.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable

from service.engine.batch_clock import Clock, Timer
from service.engine.batch_queue import Entry

#: The heap is compacted (answered entries dropped) when it holds this many entries, or twice
#: what it held after the last compaction, whichever is more.
COMPACT_AT_LEAST = 4096


class Deadlines:
    """Calls ``expire(entries)`` with the unanswered entries whose ``deadline_s`` has come,
    all at once (the chunks of one request expire together)."""

    def __init__(self, clock: Clock, expire: Callable[[list[Entry]], None]) -> None:
        self._clock = clock
        self._expire = expire
        self._heap: list[tuple[float, int, list[Entry]]] = []
        self._order = itertools.count()
        self._timer: Timer | None = None
        self._armed_s = float("inf")
        self._compact_at = COMPACT_AT_LEAST
        self._entries = 0  # in the heap's items, answered or not

    def __len__(self) -> int:
        """Entries watched, and answered ones not let go of yet."""
        return self._entries

    def add(self, entry: Entry) -> None:
        self.add_all([entry])

    def add_all(self, entries: list[Entry]) -> None:
        """Watch ``entries`` (one heap item for them all; ``entries`` is kept, not copied)."""
        if not entries:
            return
        heap = self._heap
        # The oldest items are usually answered: let go of them (and of the outputs a
        # ``SoloTicket`` holds) now rather than at their deadline.
        while heap and _all_done(heap[0][2]):
            self._entries -= len(heapq.heappop(heap)[2])
        if self._entries >= self._compact_at:
            self._compact()
            heap = self._heap
        earliest_s = min(map(_deadline_s, entries))
        heapq.heappush(heap, (earliest_s, next(self._order), entries))
        self._entries += len(entries)
        if earliest_s < self._armed_s:
            self._arm(earliest_s)

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
        expired: list[Entry] = []
        later: list[Entry] = []
        while heap and (heap[0][0] <= now_s or _all_done(heap[0][2])):
            _, _, entries = heapq.heappop(heap)
            self._entries -= len(entries)
            for entry in entries:
                if not entry.done:
                    (expired if entry.deadline_s <= now_s else later).append(entry)
        if later:
            heapq.heappush(heap, (min(e.deadline_s for e in later), next(self._order), later))
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

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._armed_s = float("inf")


#: Read in C by ``map``: a generator's step per entry cost more than the read.
_done = operator.attrgetter("done")
_deadline_s = operator.attrgetter("deadline_s")


def _all_done(entries: list[Entry]) -> bool:
    return all(map(_done, entries))
