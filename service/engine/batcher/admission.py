"""Admission: what a request is split into, and what is refused at once.

A request is split into chunks that each fit in one batch (by rows, the token budget and the
time quantum); a request given in parts (a variable-length request sorted by length, its
rows of each length bucket a part of that bucket's group: ``buckets.sorted_runs``) is split
part by part, its chunks joining the batches of their own groups, and its ticket keeps
where each of its rows went (``Ticket.order``). It is checked against the queue's bound, and
refused before it is queued when it cannot be served in time, from recent forward durations
(``estimates.BatchTimes``): 422 when it alone needs longer than its deadline even at its
fastest, 429 with ``Retry-After`` when the work queued ahead of it, or a device slowed by
load, would make it late. Groups not measured lately are never refused on an estimate. Under
overload the device thus keeps computing answers someone gets.

The work queued ahead is estimated from the queue's running totals at each request, so a
request withdrawn (its client left) stops counting at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar

from service.engine.batcher.clock import Clock, Deadlines
from service.engine.batcher.estimates import size_class
from service.engine.batcher.queue import BatchQueue, Entry, Sink, Ticket
from service.engine.batcher.run import RowLimit, Rows
from service.engine.batcher.selection import Estimate, Quantum
from service.errors import (
    DeadlineUnreachableError,
    InvalidInputError,
    NotReadyError,
    OverloadedError,
    QueueFullError,
    ServiceError,
)
from service.metrics import DropReason, ModelMetrics
from service.types import Priority

RowsT = TypeVar("RowsT", bound=Rows)


class Part(NamedTuple):
    """Rows of a request that share a group: their payload, group and cost per row."""

    payload: Any
    group: Hashable
    cost_per_row: int = 0


class Submission(NamedTuple):
    """One request, as ``DynamicBatcher.enqueue`` takes it (the same meanings)."""

    payload: Any
    group: Hashable
    cost_per_row: int = 0
    priority: Priority = "normal"
    deadline_s: float | None = None
    request_id: str = "-"
    trace: str | None = None
    tag: object = None
    more: tuple[Part, ...] = ()
    """Further parts of the request, each of its own group, after the first (``payload``,
    ``group``, ``cost_per_row``)."""
    order: Sequence[int] | None = None
    """With ``more``: the place of each of the request's rows among the parts' rows joined
    (None: in that order already)."""

    def parts(self) -> list[Part]:
        return [Part(self.payload, self.group, self.cost_per_row), *self.more]


#: A queued request as its caller holds it (a ``Ticket``), or why it was refused.
Admitted = Ticket[Any] | ServiceError


class Durations(Protocol):
    """Forward durations by group and rows (``estimates.BatchTimes``)."""

    def estimate(self, group: Hashable, rows: int) -> float | None:
        """Recent: how long such a batch takes now."""

    def fastest(self, group: Hashable, rows: int) -> float | None:
        """The quickest it was ever measured: the forward itself."""


#: Not asked yet (None is an answer: never measured).
_UNASKED = object()


class RememberedDurations:
    """``Durations`` asked once per group and size class (``estimates.size_class``: a
    duration depends on the rows through it only). The requests of a frame are admitted at
    one instant, mostly of one kind, and the durations do not change while they are (only a
    batch's end records one)."""

    __slots__ = ("_estimates", "_fastest", "_times")

    def __init__(self, times: Durations) -> None:
        self._times = times
        self._estimates: dict[tuple[Hashable, int], float | None] = {}
        self._fastest: dict[tuple[Hashable, int], float | None] = {}

    def estimate(self, group: Hashable, rows: int) -> float | None:
        key = (group, size_class(rows))
        seconds = self._estimates.get(key, _UNASKED)
        if seconds is _UNASKED:
            seconds = self._estimates[key] = self._times.estimate(group, rows)
        return seconds  # type: ignore[return-value]  # not _UNASKED any more

    def fastest(self, group: Hashable, rows: int) -> float | None:
        key = (group, size_class(rows))
        seconds = self._fastest.get(key, _UNASKED)
        if seconds is _UNASKED:
            seconds = self._fastest[key] = self._times.fastest(group, rows)
        return seconds  # type: ignore[return-value]


class Running(Protocol):
    """The batch on the device (``run.BatchRun``)."""

    @property
    def running_until_s(self) -> float:
        """When it should end, by its estimate (0: none running)."""
        ...


def chunk_rows(max_batch_size: int, max_batch_cost: int, cost_per_row: int) -> int:
    """Rows per chunk of a request: what fits in one batch by rows and token budget (at
    least one row whatever its cost)."""
    rows = max_batch_size
    if max_batch_cost and cost_per_row:
        rows = max(1, min(rows, max_batch_cost // cost_per_row))
    return rows


def chunks_of(
    payload: RowsT, total_rows: int, max_batch_size: int, max_batch_cost: int, cost_per_row: int
) -> list[RowsT]:
    """``payload`` (of ``total_rows`` rows) in chunks of ``chunk_rows`` rows (itself when it
    fits in one)."""
    rows = chunk_rows(max_batch_size, max_batch_cost, cost_per_row)
    if rows >= total_rows:
        return [payload]
    return [payload[start : start + rows] for start in range(0, total_rows, rows)]


class Totals(Protocol):
    """A group's queued work, as the wait ahead reads it (``queue.Group``)."""

    @property
    def key(self) -> Hashable: ...
    @property
    def rows(self) -> int: ...
    @property
    def cost(self) -> int: ...
    @property
    def high_rows(self) -> int: ...


def estimated_wait_s(
    queue: Iterable[Totals],
    priority: Priority,
    running_left_s: float,
    row_limit: int,
    max_batch_cost: int,
    estimate: Estimate,
) -> float:
    """How long a request queued now would wait for the device: what is left of the running
    batch, then the queued batches it would not go before (all of them for a normal request;
    the high-priority ones for a high one). Unmeasured groups count 0."""
    wait_s = max(0.0, running_left_s)
    for group in queue:
        rows = group.high_rows if priority == "high" else group.rows
        if rows == 0:
            continue
        per_batch = row_limit
        if max_batch_cost and group.cost:
            per_batch = max(1, min(per_batch, max_batch_cost * group.rows // group.cost))
        full_batches, rest = divmod(rows, per_batch)
        if full_batches:
            wait_s += full_batches * (estimate(group.key, per_batch) or 0.0)
        if rest:
            wait_s += estimate(group.key, rest) or 0.0
    return wait_s


class _GroupTotals:
    __slots__ = ("cost", "high_rows", "key", "rows")

    def __init__(self, key: Hashable, rows: int = 0, cost: int = 0, high_rows: int = 0) -> None:
        self.key = key
        self.rows = rows
        self.cost = cost
        self.high_rows = high_rows


class WorkAhead:
    """The work queued ahead of the next request of a frame: the queue's totals by group when
    the frame arrived, plus the frame's requests admitted before it (queued together after
    the last). Its ``wait_s`` is what ``estimated_wait_s`` of the queue would be had each
    been queued as it was admitted: the same groups in the same order."""

    __slots__ = ("_estimate", "_groups", "_max_batch_cost", "_row_limit", "_running_left_s")

    def __init__(
        self,
        queue: BatchQueue,
        running_left_s: float,
        row_limit: int,
        max_batch_cost: int,
        estimate: Estimate,
    ) -> None:
        self._groups = {
            group.key: _GroupTotals(group.key, group.rows, group.cost, group.high_rows)
            for group in queue
        }
        self._running_left_s = running_left_s
        self._row_limit = row_limit
        self._max_batch_cost = max_batch_cost
        self._estimate = estimate

    def add(self, entries: Sequence[Entry]) -> None:
        """``entries`` were admitted: they count as queued from now on."""
        for entry in entries:
            totals = self._groups.get(entry.group)
            if totals is None:
                totals = self._groups[entry.group] = _GroupTotals(entry.group)
            totals.rows += entry.rows
            totals.cost += entry.cost
            if entry.priority == "high":
                totals.high_rows += entry.rows

    def wait_s(self, priority: Priority) -> float:
        """How long a request admitted now at ``priority`` would wait for the device."""
        return estimated_wait_s(
            self._groups.values(),
            priority,
            self._running_left_s,
            self._row_limit,
            self._max_batch_cost,
            self._estimate,
        )


def refusal_of_any(ahead_s: float, left_s: float) -> ServiceError | None:
    """Why any request queued now would be late whatever its rows, before they are known: the
    work queued ahead of it (``ahead_s``, ``estimated_wait_s``) alone outlasts the ``left_s``
    before its deadline (429 with ``Retry-After``). Unlike ``refusal`` it does not wait for
    the request's own group to be measured: the work ahead is what was measured."""
    if ahead_s <= left_s:
        return None
    return OverloadedError(
        f"the queue holds about {ahead_s * 1000:.0f} ms of work, more than the "
        f"{left_s * 1000:.0f} ms left before the request's deadline; retry shortly",
        retry_after_s=max(1, math.ceil(ahead_s)),
    )


def refusal(
    chunks: Sequence[tuple[Hashable, int]],
    left_s: float,
    times: Durations,
    wait_s: Callable[[Priority], float],
    priority: Priority,
) -> ServiceError | None:
    """Why a request of ``chunks`` (group, rows) cannot be answered within ``left_s``, from its
    chunks' recent durations (``times.estimate``) and the ``wait_s`` of the work ahead of it
    at ``priority``; None when it can (or when a chunk has no recent estimate: admitted, it is
    measured).

    422 only when the chunks need longer than ``left_s`` even at the fastest they were ever
    measured (``times.fastest``): the forward itself is too long, the client must send less.
    When only the recent durations make it late (a loaded device), or the queue ahead does,
    429 with ``Retry-After``."""
    own_s = quickest_s = 0.0
    for group, rows in chunks:
        seconds = times.estimate(group, rows)
        if seconds is None:
            return None
        own_s += seconds
        quickest_s += times.fastest(group, rows) or 0.0
    needed_s = min(own_s, quickest_s)
    if needed_s > left_s:
        instances = sum(rows for _, rows in chunks)
        return DeadlineUnreachableError(
            f"these {instances} instances need about {needed_s * 1000:.0f} ms of "
            f"compute, more than the {left_s * 1000:.0f} ms left before the request's "
            "deadline; send fewer instances per request"
        )
    ahead_s = wait_s(priority)
    if ahead_s + own_s > left_s:
        return OverloadedError(
            f"the queue holds about {ahead_s * 1000:.0f} ms of work, and this request "
            f"needs {own_s * 1000:.0f} ms more at the device's recent pace: it could not be "
            f"answered within the {left_s * 1000:.0f} ms left before its deadline; retry "
            "shortly",
            retry_after_s=max(1, math.ceil(ahead_s)),
        )
    return None


class Admission:
    """Admits requests into ``queue``, or says why not."""

    def __init__(
        self,
        *,
        clock: Clock,
        queue: BatchQueue,
        deadlines: Deadlines[Entry],
        metrics: ModelMetrics,
        times: Durations,
        quantum: Quantum,
        row_limit: RowLimit,
        running: Running,
        max_batch_cost: int,
        max_queue_size: int,
        request_timeout_s: float,
    ) -> None:
        self._clock = clock
        self._queue = queue
        self._deadlines = deadlines
        self._metrics = metrics
        self._times = times
        self._quantum = quantum
        self._row_limit = row_limit
        self._running = running
        self._max_batch_cost = max_batch_cost
        self._max_queue_size = max_queue_size
        self._request_timeout_s = request_timeout_s

    def admit(
        self, submission: Submission, source: Hashable, sink: Sink | None, now_s: float
    ) -> Ticket[Any]:
        """Queue one request arrived at ``now_s``: its ticket. Raises why not
        (``DynamicBatcher.enqueue``). Its wait is summed over the queue as it is: nothing of a
        frame to keep up to date."""
        ticket, entries = self._planned(
            submission,
            source,
            sink,
            now_s,
            self._times,
            partial(self._estimated_wait_s, self._times.estimate, now_s),
            self._max_queue_size - self._queue.entries,
        )
        self._queue.add_all(entries)
        self._deadlines.add_all(entries)
        return ticket

    def admit_frame(
        self, submissions: list[Submission], source: Hashable, sink: Sink | None, now_s: float
    ) -> list[Admitted]:
        """Queue the requests of a frame in order, each as ``admit`` would at ``now_s`` (they
        arrived together): for each, its ticket or why it was refused.

        The frame is admitted at once: the durations asked once per group and size class, the
        work queued ahead kept up to date as its requests are admitted (``WorkAhead``) rather
        than summed over the queue for each, its entries queued in one insert and their
        deadlines watched together. Each request still sees the frame's requests before it as
        queued work, exactly as if they had been admitted one by one."""
        admitted: list[Admitted] = []
        entries: list[Entry] = []
        times = RememberedDurations(self._times)
        ahead = WorkAhead(
            self._queue,
            self._running.running_until_s - now_s,
            self._row_limit.rows,
            self._max_batch_cost,
            times.estimate,
        )
        room = self._max_queue_size - self._queue.entries
        for submission in submissions:
            try:
                ticket, chunks = self._planned(
                    submission, source, sink, now_s, times, ahead.wait_s, room - len(entries)
                )
            except ServiceError as error:
                # Kept without its traceback, whose frames hold this list: no reference cycle.
                admitted.append(error.with_traceback(None))
                continue
            admitted.append(ticket)
            entries += chunks
            ahead.add(chunks)
        if entries:
            self._queue.add_all(entries)
            self._deadlines.add_all(entries)
        return admitted

    def _planned(
        self,
        submission: Submission,
        source: Hashable,
        sink: Sink | None,
        arrival_s: float,
        times: Durations,
        wait_s: Callable[[Priority], float],
        room: int,
    ) -> tuple[Ticket[Any], list[Entry]]:
        """One request's ticket and entries (one per chunk), not queued yet; raises why it
        cannot be. ``wait_s``: the work queued ahead of it, by its priority; ``room``: entries
        the queue still has room for."""
        # The submission is its own first part (its payload, group and cost per row).
        chunks = self._chunks(submission)
        for part in submission.more:
            chunks += self._chunks(part)
        sizes: list[tuple[Hashable, int]] = []
        total_rows = 0
        for chunk in chunks:
            rows = len(chunk.payload)
            sizes.append((chunk.group, rows))
            total_rows += rows
        if total_rows < 1:
            raise InvalidInputError("a request needs at least one instance")
        if len(chunks) > room:
            raise self._queue_full()
        deadline_s = submission.deadline_s
        if deadline_s is None:
            deadline_s = arrival_s + self._request_timeout_s
        refused = refusal(sizes, deadline_s - arrival_s, times, wait_s, submission.priority)
        if refused is not None:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
            raise refused
        ticket: Ticket[Any] = Ticket(self._queue, sink, submission.tag, submission.order)
        entries: list[Entry] = []
        for index, chunk in enumerate(chunks):
            rows = sizes[index][1]
            entries.append(
                Entry(
                    ticket,
                    index,
                    chunk.payload,
                    rows=rows,
                    cost=rows * chunk.cost_per_row,
                    group=chunk.group,
                    priority=submission.priority,
                    arrival_s=arrival_s,
                    deadline_s=deadline_s,
                    request_id=submission.request_id,
                    source=source,
                    trace=submission.trace,
                )
            )
        ticket.attach(entries)
        return ticket, entries

    def _chunks(self, part: Part | Submission) -> list[Part | Submission]:
        """``part`` in chunks that each fit in a batch (itself when it does)."""
        total_rows = len(part.payload)
        if total_rows <= 1:  # the common case: one chunk
            return [part]
        max_rows = self._row_limit.max_batch_size
        rows_per_chunk = self._quantum.rows(part.group, total_rows, max_rows, part.cost_per_row)
        chunks = chunks_of(
            part.payload, total_rows, rows_per_chunk, self._max_batch_cost, part.cost_per_row
        )
        return [Part(chunk, part.group, part.cost_per_row) for chunk in chunks]

    def refusal_of_any(self, priority: Priority, deadline_s: float | None) -> ServiceError | None:
        """What ``admit`` would raise now for any request at ``priority`` due at
        ``deadline_s`` (None: not known yet), whatever its rows: the queue is full (a request
        is at least one entry), or the work ahead alone would make it late. Asked before a
        request's body is parsed, so a storm of requests that would be refused costs no parse."""
        if self._queue.entries >= self._max_queue_size:
            return self._queue_full()
        if deadline_s is None or not self._queue:
            return None
        refused = refusal_of_any(self.estimated_wait_s(priority), deadline_s - self._clock.now())
        if refused is not None:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
        return refused

    def estimated_wait_s(self, priority: Priority = "normal") -> float:
        """How long a request queued now would wait for the device (``estimated_wait_s``)."""
        return self._estimated_wait_s(self._times.estimate, self._clock.now(), priority)

    def _estimated_wait_s(self, estimate: Estimate, now_s: float, priority: Priority) -> float:
        return estimated_wait_s(
            self._queue,
            priority,
            self._running.running_until_s - now_s,
            self._row_limit.rows,
            self._max_batch_cost,
            estimate,
        )

    def not_ready(self) -> NotReadyError:
        """The refusal of a request while the batcher is not accepting (counted)."""
        self._metrics.dropped(DropReason.DRAINING).inc()
        return NotReadyError("the server is not accepting requests (starting or draining)")

    def _queue_full(self) -> QueueFullError:
        self._metrics.dropped(DropReason.QUEUE_FULL).inc()
        return QueueFullError(
            f"the queue is full ({self._max_queue_size} requests waiting); retry shortly"
        )
