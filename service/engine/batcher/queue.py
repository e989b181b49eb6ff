"""The batcher's queue: the work waiting for the device, and the tickets its callers hold.

A request is one ``Ticket``, queued as one ``Entry`` per chunk (one, unless the request is
larger than a batch). Entries wait by group (the requests that may share a batch), in one FIFO
lane per priority, with running totals that admission and the dispatch policies read. Only
the collector's event loop touches the queue.

A ticket is answered exactly once: each of its chunks by its batch, its deadline or its caller
leaving, whichever comes first; once one chunk has failed, the request's other chunks are
withdrawn (those still queued are never computed). A caller that leaves (``Ticket.cancel``:
an in-process caller cancelled, or a front end's CANCELS frame) withdraws its request at once,
so it stops counting as queued work before the collector reaches it. No asyncio future per
request: a finished ticket goes to its ``Sink`` (a front end's connection) with the others the
same batch finished (``Outbox``); an in-process caller awaits ``Ticket.wait`` instead, which
makes the one future it needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from service.engine.batcher.clock import Clock, Timer
from service.errors import DeadlineExceededError
from service.metrics import DropReason, ModelMetrics
from service.types import PRIORITIES, Priority

logger = logging.getLogger("service.engine.batching")

OutputT = TypeVar("OutputT")

#: The queue-depth gauge follows the queue at most this late: a gauge scraped every few
#: seconds loses nothing, and a queue that changes on every request costs one write per
#: interval (a file write with several processes) rather than two per request.
QUEUE_DEPTH_REFRESH_S = 0.05


class Sink(Protocol):
    """Where a front end's finished tickets go: once per batch, all of that batch's."""

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None: ...


class Entry:
    """One queued piece of work: a whole request, or one chunk of one larger than a batch.
    Once ``done`` (answered: output, error, deadline or cancel) it lets go of its payload and
    ticket, so a deadline still pending for it holds nothing large."""

    __slots__ = (
        "arrival_s",
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
        ticket: Ticket[Any] | None,
        index: int,
        payload: Any,
        *,
        rows: int,
        cost: int,
        group: Hashable,
        priority: Priority,
        arrival_s: float,
        deadline_s: float,
        request_id: str = "-",
        source: Hashable = None,
        trace: str | None = None,
    ) -> None:
        self.ticket = ticket
        self.index = index
        """Which chunk of its request this is."""
        self.payload = payload
        self.rows = rows
        self.cost = cost
        """Padded positions (e.g. tokens) it adds to a batch's budget."""
        self.group = group
        self.priority = priority
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self.request_id = request_id
        self.source = source
        """The front end it came from (None: this process)."""
        self.trace = trace
        """The request's W3C ``traceparent`` when its front end traces it."""
        self.batches: tuple[tuple[str, int], ...] = ()
        """Each traced batch that ran it: the batch span's ``traceparent`` and these rows."""
        self.queued = False
        self.done = False

    @property
    def abandoned(self) -> bool:
        """Its in-process caller was cancelled and has not withdrawn it yet (it will as soon as
        it runs again): drop it rather than compute it for nobody."""
        return self.ticket is not None and self.ticket.abandoned

    def resolve(self, output: object) -> None:
        """Answer with ``output``, unless answered already (deadline, cancel)."""
        if not self.done:  # lets go of its payload and ticket
            self.done = True
            self.payload = None
            ticket, self.ticket = self.ticket, None
            if ticket is not None:
                ticket.answered(self.index, output)

    def reject(self, error: BaseException) -> None:
        """Answer with ``error``, unless answered already."""
        if not self.done:
            self.done = True
            self.payload = None
            ticket, self.ticket = self.ticket, None
            if ticket is not None:
                ticket.failed(self.index, error)


class Ticket(Generic[OutputT]):
    """A queued request as its caller holds it: the outputs of its chunks, in request order."""

    __slots__ = (
        "_entries",
        "_error",
        "_outputs",
        "_pending",
        "_queue",
        "_waiter",
        "order",
        "sink",
        "tag",
    )

    def __init__(
        self,
        queue: BatchQueue,
        sink: Sink | None = None,
        tag: object = None,
        order: Sequence[int] | None = None,
    ) -> None:
        self._queue = queue
        self.sink = sink
        self.tag = tag
        """What the caller knows the request by (the bridge: its call id and version)."""
        self.order = order
        """Where each of the request's rows is among its chunks' output rows joined (None:
        in order): a request sorted by length is answered in its own order."""
        self._entries: list[Entry] = []
        self._outputs: list[Any] = []
        self._pending = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def attach(self, entries: list[Entry]) -> None:
        """The request's chunks, in order (each entry's ``ticket`` and ``index`` point here)."""
        self._entries = entries
        self._outputs = [None] * len(entries)
        self._pending = len(entries)

    @property
    def abandoned(self) -> bool:
        """Its in-process caller was cancelled and has not withdrawn it yet."""
        return self._waiter is not None and self._waiter.cancelled()

    @property
    def done(self) -> bool:
        """Every chunk is answered."""
        return self._pending == 0

    def outputs(self) -> list[OutputT]:
        """Every chunk's output once done; raises the error the request failed with, or
        ``CancelledError`` when it was withdrawn."""
        if self._error is not None:
            raise self._error
        return list(self._outputs)

    async def wait(self) -> list[OutputT]:
        """The outputs; if the caller is cancelled meanwhile, the request is withdrawn."""
        if self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.cancel()
                raise
        return self.outputs()

    def traced_batches(self) -> tuple[tuple[str, int], ...]:
        """The traced batches that ran the request's chunks, and the rows each held."""
        if len(self._entries) == 1:
            return self._entries[0].batches
        return tuple(batch for entry in self._entries for batch in entry.batches)

    def cancel(self) -> None:
        """Withdraw the request: its chunks still queued are dropped and never computed."""
        if self._pending:
            self._queue.withdraw(self._entries)

    def answered(self, index: int, output: object) -> None:
        """Chunk ``index`` computed ``output`` (``Entry.resolve``)."""
        self._outputs[index] = output
        self._pending -= 1
        if self._pending == 0:
            self._finish()

    def failed(self, index: int, error: BaseException) -> None:
        """Chunk ``index`` failed, expired or was withdrawn (``Entry.reject``): the request
        fails as a whole, with the first error that is not a withdrawal."""
        first = self._error is None
        if first or isinstance(self._error, asyncio.CancelledError):
            self._error = error
        self._pending -= 1
        if self._pending == 0:
            self._finish()
        elif first:
            self._queue.withdraw(self._entries)

    def _finish(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._queue.outbox.finished(self)


class Outbox:
    """Hands finished tickets to their sinks: those a batch finishes all at once after it
    (``with outbox:`` around answering it), any other (a deadline, a cancel) at once."""

    __slots__ = ("_gathering", "_outer")

    def __init__(self) -> None:
        self._gathering: dict[Sink, list[Ticket[Any]]] | None = None
        self._outer: list[dict[Sink, list[Ticket[Any]]] | None] = []

    def finished(self, ticket: Ticket[Any]) -> None:
        sink = ticket.sink
        if sink is None:  # an in-process caller: its waiter is set
            return
        if self._gathering is None:
            _deliver(sink, [ticket])
        else:
            tickets = self._gathering.get(sink)
            if tickets is None:
                self._gathering[sink] = [ticket]
            else:
                tickets.append(ticket)

    def __enter__(self) -> None:
        self._outer.append(self._gathering)
        self._gathering = {}

    def __exit__(self, *exc_info: object) -> None:
        gathered, self._gathering = self._gathering or {}, self._outer.pop()
        for sink, tickets in gathered.items():
            _deliver(sink, tickets)


def _deliver(sink: Sink, tickets: list[Ticket[Any]]) -> None:
    try:
        sink.deliver(tickets)
    except Exception:  # a front end's bad luck must not stop the collector
        logger.exception("delivery_failed")


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


class QueueWatch(Protocol):
    """What the queue reports: its depth (entries queued) changed; entries left it uncomputed."""

    def changed(self, depth: int) -> None: ...

    def dropped(self, reason: DropReason, count: int) -> None: ...


class QueueMetrics:
    """The queue's ``QueueWatch`` as metrics: the depth gauge, set at most
    ``QUEUE_DEPTH_REFRESH_S`` after each change, and the dropped requests by reason."""

    def __init__(self, clock: Clock, metrics: ModelMetrics) -> None:
        self._clock = clock
        self._metrics = metrics
        self._refresh: Timer | None = None
        self._depth = 0

    def changed(self, depth: int) -> None:
        self._depth = depth
        if self._refresh is None:
            self._refresh = self._clock.call_at(
                self._clock.now() + QUEUE_DEPTH_REFRESH_S, self._set_depth
            )

    def dropped(self, reason: DropReason, count: int) -> None:
        self._metrics.dropped(reason).inc(count)

    def _set_depth(self) -> None:
        self._refresh = None
        self._metrics.queue_depth.set(self._depth)


class _Unwatched:
    def changed(self, depth: int) -> None:
        pass

    def dropped(self, reason: DropReason, count: int) -> None:
        pass


class BatchQueue:
    """Every queued entry, by group; what leaves it uncomputed is answered here and reported
    to ``watch``."""

    def __init__(
        self, watch: QueueWatch | None = None, request_timeout_s: float = float("inf")
    ) -> None:
        """``request_timeout_s``: named in the answers of requests that expire."""
        self.groups: dict[Hashable, Group] = {}
        self.entries = 0
        """Queued entries (a request larger than a batch counts once per chunk)."""
        self.outbox = Outbox()
        self._watch = watch or _Unwatched()
        self._request_timeout_s = request_timeout_s

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups.values())

    def __bool__(self) -> bool:
        return self.entries > 0

    def add_all(self, entries: Sequence[Entry]) -> list[Group]:
        """Queue ``entries`` in order; the groups they joined, each once."""
        groups: list[Group] = []
        group: Group | None = None
        for entry in entries:
            if group is None or entry.group != group.key:
                group = self.groups.get(entry.group)
                if group is None:
                    group = self.groups[entry.group] = Group(entry.group)
                if group not in groups:
                    groups.append(group)
            group.lanes[entry.priority].append(entry)
            entry.queued = True
            group.rows += entry.rows
            group.cost += entry.cost
            if entry.priority == "high":
                group.high_rows += entry.rows
        self.entries += len(entries)
        self._watch.changed(self.entries)
        return groups

    def pop_heads(self, group: Group, priority: Priority, count: int) -> None:
        """Take the first ``count`` entries of ``group``'s ``priority`` lane (a batch's)."""
        lane = group.lanes[priority]
        for _ in range(count):
            self._forget(lane.popleft(), group)
        self._watch.changed(self.entries)

    def normal_waiting(self) -> bool:
        return any(group.head("normal") is not None for group in self.groups.values())

    # ----------------------------------------------------------------- leaving uncomputed

    def withdraw(self, entries: Sequence[Entry]) -> None:
        """Their caller stopped waiting, or another chunk of their request failed: drop those
        still queued, so they are never computed, and answer every one not answered yet as
        cancelled."""
        removed = self._remove_queued(entries)
        if removed:
            self._watch.dropped(DropReason.CANCELLED, removed)
        for entry in entries:
            entry.reject(asyncio.CancelledError())

    def expire(self, entries: Sequence[Entry]) -> None:
        """Their deadline has come: answer 504 now, even while their batch is running."""
        self._remove_queued(entries)
        self._watch.dropped(DropReason.EXPIRED, len(entries))
        timeout_ms = self._request_timeout_s * 1000
        for entry in entries:
            entry.reject(
                DeadlineExceededError(f"the request was not answered within {timeout_ms:.0f} ms")
            )

    def skipped(
        self,
        gone: Sequence[Entry],
        late: Sequence[Entry],
        estimate: Callable[[Hashable, int], float | None],
    ) -> None:
        """Answer what filling a batch took out uncomputed: entries whose caller has gone,
        and entries that cannot finish by their deadline even alone (504)."""
        if gone:
            self._watch.dropped(DropReason.CANCELLED, len(gone))
            for entry in gone:
                entry.reject(asyncio.CancelledError())
        if late:
            self._watch.dropped(DropReason.DEADLINE_UNREACHABLE, len(late))
            timeout_ms = self._request_timeout_s * 1000
            for entry in late:
                seconds = estimate(entry.group, entry.rows) or 0.0
                entry.reject(
                    DeadlineExceededError(
                        f"the request could not be answered within {timeout_ms:.0f} ms: its "
                        f"rows would take about {seconds * 1000:.0f} ms"
                    )
                )

    def _remove_queued(self, entries: Sequence[Entry]) -> int:
        removed = 0
        for entry in entries:
            if entry.queued:
                group = self.groups[entry.group]
                group.lanes[entry.priority].remove(entry)
                self._forget(entry, group)
                removed += 1
        if removed:
            self._watch.changed(self.entries)
        return removed

    def _forget(self, entry: Entry, group: Group) -> None:
        entry.queued = False
        group.rows -= entry.rows
        group.cost -= entry.cost
        if entry.priority == "high":
            group.high_rows -= entry.rows
        if group.rows == 0:  # every entry holds a row at least
            del self.groups[group.key]
        self.entries -= 1
