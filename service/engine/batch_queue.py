"""The batcher's queue: entries by group, one FIFO lane per priority, with running totals.

Only the collector's own event loop touches it. An entry is one queued piece of work (a whole
request, or one chunk of a request larger than a batch); every entry holds a row at least, so
a group whose rows reach 0 is empty and removed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

from service.engine.batch_clock import Clock, Timer
from service.types import PRIORITIES, Priority

if TYPE_CHECKING:
    from service.engine.batch_ticket import ChunkedTicket as Ticket

#: The queue-depth gauge follows the queue at most this late. Written on every enqueue and
#: dequeue it cost two metric writes per request (file writes with several processes); a
#: gauge scraped every few seconds loses nothing at this delay.
QUEUE_DEPTH_REFRESH_S = 0.05


class Entry:
    """One queued piece of work. ``done`` once answered (output, error, deadline or
    cancel); its payload and ticket are let go then, so a deadline still pending for it
    holds nothing large."""

    __slots__ = (
        "arrival_s",
        "awaited",
        "batches",
        "cost",
        "deadline_s",
        "done",
        "group",
        "index",
        "payload",
        "priority",
        "queued",
        "request_id",
        "rows",
        "source",
        "ticket",
        "trace",
    )

    def __init__(
        self,
        payload: Any,
        *,
        rows: int,
        cost: int,
        group: Hashable,
        priority: Priority,
        arrival_s: float,
        deadline_s: float,
        request_id: str,
        source: Hashable,
        trace: str | None,
        ticket: Ticket[Any] | None,
        index: int,
    ) -> None:
        self.payload = payload
        self.rows = rows
        self.cost = cost
        self.group = group
        self.priority = priority
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self.request_id = request_id
        self.source = source
        self.trace = trace
        """The request's W3C ``traceparent`` when its front end traces it."""
        self.batches: tuple[tuple[str, int], ...] = ()
        """Each traced batch that ran it: the batch span's ``traceparent`` and these rows."""
        self.ticket = ticket
        self.index = index
        """Which chunk of its request this is."""
        self.queued = False
        self.done = False
        self.awaited = True
        """Whether its caller may be gone (``abandoned``) without having withdrawn it yet:
        False only for a request that no in-process caller awaits (a front end's), whose
        ``abandoned`` a batch plan then need not ask."""

    @property
    def abandoned(self) -> bool:
        """Its in-process caller was cancelled (``Ticket``): drop it rather than compute it."""
        return self.ticket is not None and self.ticket.abandoned

    def resolve(self, output: object) -> None:
        """Answer with ``output``, unless answered already (deadline, cancel)."""
        if not self.done:
            ticket = self._finish()
            if ticket is not None:
                ticket.chunk_answered(self.index, output)

    def reject(self, error: BaseException) -> None:
        """Answer with ``error``, unless answered already."""
        if not self.done:
            ticket = self._finish()
            if ticket is not None:
                ticket.chunk_failed(self.index, error)

    def _finish(self) -> Ticket[Any] | None:
        self.done = True
        self.payload = None
        ticket, self.ticket = self.ticket, None
        return ticket


class Group:
    """The queued entries of one group, one FIFO lane per priority, with running totals."""

    __slots__ = ("cost", "high_rows", "key", "lanes", "rows")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.lanes: dict[Priority, deque[Entry]] = {priority: deque() for priority in PRIORITIES}
        self.rows = 0
        self.cost = 0
        self.high_rows = 0

    def head(self, priority: Priority) -> Entry | None:
        lane = self.lanes[priority]
        return lane[0] if lane else None

    def oldest(self) -> Entry | None:
        heads = [lane[0] for lane in self.lanes.values() if lane]
        return min(heads, key=lambda entry: entry.arrival_s, default=None)

    def count(self, entry: Entry, sign: int) -> None:
        self.rows += sign * entry.rows
        self.cost += sign * entry.cost
        if entry.priority == "high":
            self.high_rows += sign * entry.rows


class BatchQueue:
    """Every queued entry, by group."""

    def __init__(self) -> None:
        self.groups: dict[Hashable, Group] = {}
        self.entries = 0
        """Queued entries (a request larger than a batch counts once per chunk)."""

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups.values())

    def __bool__(self) -> bool:
        return self.entries > 0

    def add(self, entry: Entry) -> Group:
        return self.add_all([entry])

    def add_all(self, entries: list[Entry]) -> Group:
        """Queue ``entries``, all of one group (a request's chunks, or a frame's requests), in
        order: its totals counted once for them all."""
        key = entries[0].group
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(key)
        lanes = group.lanes
        rows = cost = high_rows = 0
        for entry in entries:
            lanes[entry.priority].append(entry)
            entry.queued = True
            rows += entry.rows
            cost += entry.cost
            if entry.priority == "high":
                high_rows += entry.rows
        group.rows += rows
        group.cost += cost
        group.high_rows += high_rows
        self.entries += len(entries)
        return group

    def remove(self, entry: Entry) -> None:
        """Take a queued entry out from anywhere in its group."""
        group = self.groups[entry.group]
        group.lanes[entry.priority].remove(entry)
        self._forget(entry, group)

    def pop(self, group: Group, priority: Priority) -> Entry:
        """Take the head of ``group``'s ``priority`` lane."""
        entry = group.lanes[priority].popleft()
        self._forget(entry, group)
        return entry

    def pop_heads(self, group: Group, priority: Priority, count: int) -> None:
        """Take the first ``count`` entries of ``group``'s ``priority`` lane (a batch's)."""
        lane = group.lanes[priority]
        rows = cost = 0
        for _ in range(count):
            entry = lane.popleft()
            entry.queued = False
            rows += entry.rows
            cost += entry.cost
        group.rows -= rows
        group.cost -= cost
        if priority == "high":
            group.high_rows -= rows
        if group.rows == 0:  # every entry holds a row at least
            del self.groups[group.key]
        self.entries -= count

    def oldest(self) -> Entry | None:
        heads = [group.oldest() for group in self.groups.values()]
        return min(
            (head for head in heads if head is not None),
            key=lambda entry: entry.arrival_s,
            default=None,
        )

    def normal_waiting(self) -> bool:
        return any(group.head("normal") is not None for group in self.groups.values())

    def _forget(self, entry: Entry, group: Group) -> None:
        group.count(entry, -1)
        entry.queued = False
        if group.rows == 0:  # every entry holds a row at least
            del self.groups[entry.group]
        self.entries -= 1


class DepthGauge:
    """Sets the queue-depth gauge at most ``QUEUE_DEPTH_REFRESH_S`` after each change."""

    def __init__(self, clock: Clock, queue: BatchQueue, set_depth: Callable[[int], None]) -> None:
        self._clock = clock
        self._queue = queue
        self._set_depth = set_depth
        self._refresh: Timer | None = None

    def changed(self) -> None:
        if self._refresh is None:
            self._refresh = self._clock.call_at(
                self._clock.now() + QUEUE_DEPTH_REFRESH_S, self._set_now
            )

    def _set_now(self) -> None:
        self._refresh = None
        self._set_depth(self._queue.entries)
