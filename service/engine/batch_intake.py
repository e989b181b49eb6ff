"""Taking requests into the queue: one at a time, or a front end's whole SUBMITS frame at once.

One at a time (``enqueue``), a request is split into chunks, checked against the queue's
bound and the refusal policy (``batch_admission``), and queued. A frame (``enqueue_frame``)
is admitted in bulk: one admission check per kind of request in it (group, priority, chunk
rows), against a pessimistic picture of the queue (every request of the frame already queued
ahead of every other, each group's batches at their slowest measured size), instead of two or
three estimate look-ups per request. When that check admits every kind, submitting the frame
one request at a time would have admitted every request too, since the refusal policy is
monotone (less work ahead, or more time left, never turns an admission into a refusal); the
frame is then queued in bulk, and its entries of one group share one deadline heap item.
Otherwise the frame is admitted one request at a time, in order, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from service.engine import batch_admission
from service.engine.batch_clock import Clock
from service.engine.batch_deadlines import Deadlines
from service.engine.batch_guards import RowLimit
from service.engine.batch_queue import BatchQueue, Entry, Group
from service.engine.batch_selection import Quantum
from service.engine.batch_ticket import ChunkedTicket, Sink, SoloTicket, Ticket
from service.engine.estimates import BatchTimes
from service.errors import InvalidInputError, NotReadyError, QueueFullError, ServiceError
from service.metrics import DropReason, ModelMetrics
from service.types import Priority


class Submission(NamedTuple):
    """One request of a frame, as ``DynamicBatcher.enqueue`` takes it (same meanings)."""

    payload: Any
    group: Hashable
    cost_per_row: int = 0
    priority: Priority = "normal"
    deadline_s: float | None = None
    request_id: str = "-"
    trace: str | None = None
    tag: object = None
    rows: int | None = None
    """``len(payload)`` when its caller has it already (None: counted here)."""


#: A queued request as its caller holds it (a ``Ticket``), or why it was refused.
Admitted = Ticket[Any] | ServiceError


class Intake:
    """Admits requests into ``queue``; ``added`` is told which groups grew, and whether the
    queue was empty before, once per request or frame."""

    def __init__(
        self,
        *,
        clock: Clock,
        queue: BatchQueue,
        deadlines: Deadlines,
        metrics: ModelMetrics,
        times: BatchTimes,
        quantum: Quantum,
        row_limit: RowLimit,
        max_batch_cost: int,
        max_queue_size: int,
        request_timeout_s: float,
        running_until_s: Callable[[], float],
        accepting: Callable[[], bool],
        withdraw: Callable[[list[Entry]], None],
        finished: Callable[[Ticket[Any]], None],
        added: Callable[[list[Group], bool], None],
    ) -> None:
        self._clock = clock
        self._queue = queue
        self._deadlines = deadlines
        self._metrics = metrics
        self._times = times
        self._quantum = quantum
        self._row_limit = row_limit
        self._max_batch_cost = max_batch_cost
        self._max_queue_size = max_queue_size
        self._request_timeout_s = request_timeout_s
        self._running_until_s = running_until_s
        self._accepting = accepting
        self._withdraw = withdraw
        self._finished = finished
        self._added = added

    # ----------------------------------------------------------------- one request

    def enqueue(self, submission: Submission, source: Hashable, sink: Sink | None) -> Ticket[Any]:
        """Queue one request now, or raise why not (``DynamicBatcher.enqueue``)."""
        self._check_accepting()
        chunks, rows = self._chunks(submission)
        if self._queue.entries + len(chunks) > self._max_queue_size:
            raise self._refuse_queue_full()
        arrival_s = self._clock.now()
        deadline_s = submission.deadline_s
        if deadline_s is None:
            deadline_s = arrival_s + self._request_timeout_s
        refused = batch_admission.refusal(
            rows,
            submission.group,
            deadline_s - arrival_s,
            self._times,
            self.estimated_wait_s,
            submission.priority,
        )
        if refused is not None:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
            raise refused
        ticket, entries = self._entries(
            submission, chunks, rows, arrival_s, deadline_s, source, sink
        )
        was_empty = not self._queue
        self._deadlines.add_all(entries)
        self._added([self._queue.add_all(entries)], was_empty)  # one group: the request's
        return ticket

    def refusal_of_any(self, priority: Priority, deadline_s: float | None) -> ServiceError | None:
        """What ``enqueue`` would raise now for any request at ``priority`` due at
        ``deadline_s`` (None: not known yet), whatever its rows: the queue is full (a request
        is at least one entry), or the work ahead alone would make it late
        (``batch_admission.refusal_of_any``). Asked before a request's body is parsed, so a
        storm of requests that would be refused costs no parse (issue 23)."""
        if self._queue.entries >= self._max_queue_size:
            return self._refuse_queue_full()
        if deadline_s is None or not self._queue:
            return None
        refused = batch_admission.refusal_of_any(
            self.estimated_wait_s(priority), deadline_s - self._clock.now()
        )
        if refused is not None:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
        return refused

    def _refuse_queue_full(self) -> QueueFullError:
        self._metrics.dropped(DropReason.QUEUE_FULL).inc()
        return QueueFullError(
            f"the queue is full ({self._max_queue_size} requests waiting); retry shortly"
        )

    def estimated_wait_s(self, priority: Priority = "normal") -> float:
        """How long a request queued now would wait for the device (``batch_admission``)."""
        return batch_admission.estimated_wait_s(
            self._queue,
            priority,
            self._running_until_s() - self._clock.now(),
            self._row_limit.rows,
            self._max_batch_cost,
            self._times.estimate,
        )

    # ----------------------------------------------------------------- a frame

    def enqueue_frame(
        self, submissions: Sequence[Submission], source: Hashable, sink: Sink | None
    ) -> list[Admitted]:
        """Queue every request of a frame that one-by-one ``enqueue`` would queue, in order:
        for each, its ticket or the error ``enqueue`` would have raised."""
        if not submissions:
            return []
        if not self._accepting():
            return [self._refuse_not_ready() for _ in submissions]
        planned = self._plan(submissions)
        if planned is None:
            return [self._one_of_frame(submission, source, sink) for submission in submissions]
        arrival_s, chunked = planned
        default_deadline_s = arrival_s + self._request_timeout_s
        admitted: list[Admitted] = []
        by_group: dict[Hashable, list[Entry]] = {}
        withdraw, finished = self._withdraw, self._finished
        # A frame's requests are mostly of one group: its list is looked up when it changes.
        last_group: Hashable = batch_admission.NO_GROUP
        queued: list[Entry] = []
        for index, submission in enumerate(submissions):
            payload, group, cost_per_row, priority, deadline_s, request_id, trace, tag, rows = (
                submission
            )
            if deadline_s is None:
                deadline_s = default_deadline_s
            if group != last_group:
                last_group = group
                queued = by_group.setdefault(group, [])
            pieces = chunked.get(index) if chunked else None
            if pieces is None:  # one chunk: one object (the common case)
                if rows is None:
                    rows = len(payload)
                solo: SoloTicket[Any] = SoloTicket(
                    payload,
                    rows,
                    rows * cost_per_row,
                    group,
                    priority,
                    arrival_s,
                    deadline_s,
                    request_id,
                    source,
                    trace,
                    tag,
                    sink,
                    withdraw,
                    finished,
                )
                admitted.append(solo)
                queued.append(solo)
            else:
                ticket, entries = self._entries(
                    submission, *pieces, arrival_s, deadline_s, source, sink
                )
                admitted.append(ticket)
                queued.extend(entries)  # not the ticket's own list
        was_empty = not self._queue
        groups = []
        add_all = self._queue.add_all
        for queued in by_group.values():
            self._deadlines.add_all(queued)
            groups.append(add_all(queued))
        self._added(groups, was_empty)
        return admitted

    def _plan(
        self, submissions: Sequence[Submission]
    ) -> tuple[float, dict[int, tuple[list[Any], list[int]]]] | None:
        """The chunks and their rows of each request (by its index) in more than one chunk,
        when the whole frame is admitted (see the module's docstring); None when some request
        might be refused. Runs once a request: what it asks per kind of request is looked up
        again only when the kind changes from the previous request's."""
        chunked: dict[int, tuple[list[Any], list[int]]] = {}
        chunk_count = 0
        growth: dict[Hashable, list[int]] = {}  # group: [rows, high rows, cost]
        tightest: dict[batch_admission.Kind, float] = {}
        arrival_s = self._clock.now()
        default_left_s = self._request_timeout_s
        max_batch_size, max_batch_cost = self._row_limit.max_batch_size, self._max_batch_cost
        split_rows = not self._quantum.max_batch_s  # several rows may share one chunk
        last_cost, chunk_rows = -1, 0
        last_group: Hashable = batch_admission.NO_GROUP
        grown = [0, 0, 0]
        # The kind of the previous request, and its tightest time left so far.
        last_kind: batch_admission.Kind | None = None
        last_left_s = 0.0
        for index, submission in enumerate(submissions):
            payload, group, cost_per_row, priority, deadline_s, _, _, _, total_rows = submission
            if total_rows is None:
                total_rows = len(payload)
            if total_rows < 1:
                return None  # refused alone: one by one says why
            if cost_per_row != last_cost:
                last_cost = cost_per_row
                chunk_rows = batch_admission.chunk_rows(max_batch_size, max_batch_cost, last_cost)
            kind: batch_admission.Kind
            if total_rows <= chunk_rows and (total_rows == 1 or split_rows):
                chunk_count += 1
                kind = (group, priority, total_rows)
            else:
                chunks, rows = self._chunks(submission)
                chunked[index] = (chunks, rows)
                chunk_count += len(chunks)
                kind = (group, priority, tuple(rows))
            if group != last_group:
                last_group = group
                grown = growth.setdefault(group, [0, 0, 0])
            grown[0] += total_rows
            grown[2] += total_rows * cost_per_row
            if priority == "high":
                grown[1] += total_rows
            left_s = default_left_s if deadline_s is None else deadline_s - arrival_s
            if kind != last_kind:
                batch_admission.keep_tightest(tightest, last_kind, last_left_s)
                last_kind, last_left_s = kind, left_s
            elif left_s < last_left_s:
                last_left_s = left_s
        batch_admission.keep_tightest(tightest, last_kind, last_left_s)
        if self._queue.entries + chunk_count > self._max_queue_size:
            return None
        waits = self._pessimistic_waits_s(growth, arrival_s)
        for (group, priority, kind_rows), left_s in tightest.items():
            chunk_list = [kind_rows] if isinstance(kind_rows, int) else list(kind_rows)
            refused = batch_admission.refusal(
                chunk_list, group, left_s, self._times, waits.__getitem__, priority
            )
            if refused is not None:
                return None
        return arrival_s, chunked

    def _pessimistic_waits_s(
        self, growth: dict[Hashable, list[int]], now_s: float
    ) -> dict[Priority, float]:
        """At least the ``estimated_wait_s`` each request of the frame could see one by one,
        at either priority: each group with every request of the frame queued, its batches
        each as slow as its slowest measured size; with a token budget, one row a batch."""
        row_limit = self._row_limit.rows
        waits: dict[Priority, float] = {}
        for priority in ("normal", "high"):
            waits[priority] = max(0.0, self._running_until_s() - now_s)
        keys = {group.key for group in self._queue} | set(growth)
        for key in keys:
            queued = self._queue.groups.get(key)
            grown = growth.get(key, [0, 0, 0])
            rows = grown[0] + (queued.rows if queued is not None else 0)
            high_rows = grown[1] + (queued.high_rows if queued is not None else 0)
            cost = grown[2] + (queued.cost if queued is not None else 0)
            slowest_s = self._times.slowest(key, row_limit)  # a look-up: tabled per group
            per_batch = 1 if self._max_batch_cost and cost else row_limit
            waits["normal"] += -(-rows // per_batch) * slowest_s
            waits["high"] += -(-high_rows // per_batch) * slowest_s
        return waits

    def _one_of_frame(
        self, submission: Submission, source: Hashable, sink: Sink | None
    ) -> Admitted:
        try:
            return self.enqueue(submission, source, sink)
        except ServiceError as error:
            return error

    # ----------------------------------------------------------------- pieces

    def _check_accepting(self) -> None:
        if not self._accepting():
            raise self._refuse_not_ready()

    def _refuse_not_ready(self) -> NotReadyError:
        self._metrics.dropped(DropReason.DRAINING).inc()
        return NotReadyError("the server is not accepting requests (starting or draining)")

    def _chunks(self, submission: Submission) -> tuple[list[Any], list[int]]:
        payload = submission.payload
        total_rows = len(payload)
        if total_rows < 1:
            raise InvalidInputError("a request needs at least one instance")
        chunks = batch_admission.chunks_of(
            payload,
            total_rows,
            self._quantum.rows(
                submission.group,
                total_rows,
                self._row_limit.max_batch_size,
                submission.cost_per_row,
            ),
            self._max_batch_cost,
            submission.cost_per_row,
        )
        rows = [total_rows] if len(chunks) == 1 else [len(chunk) for chunk in chunks]
        return chunks, rows

    def _entries(
        self,
        submission: Submission,
        chunks: list[Any],
        rows: list[int],
        arrival_s: float,
        deadline_s: float,
        source: Hashable,
        sink: Sink | None,
    ) -> tuple[Ticket[Any], list[Entry]]:
        if len(chunks) == 1:
            solo: SoloTicket[Any] = SoloTicket(
                chunks[0],
                rows[0],
                rows[0] * submission.cost_per_row,
                submission.group,
                submission.priority,
                arrival_s,
                deadline_s,
                submission.request_id,
                source,
                submission.trace,
                submission.tag,
                sink,
                self._withdraw,
                self._finished,
            )
            return solo, [solo]
        ticket: ChunkedTicket[Any] = ChunkedTicket(
            tag=submission.tag, sink=sink, withdraw=self._withdraw, finished=self._finished
        )
        entries = [
            Entry(
                chunk,
                rows=rows[index],
                cost=rows[index] * submission.cost_per_row,
                group=submission.group,
                priority=submission.priority,
                arrival_s=arrival_s,
                deadline_s=deadline_s,
                request_id=submission.request_id,
                source=source,
                trace=submission.trace,
                ticket=ticket,
                index=index,
            )
            for index, chunk in enumerate(chunks)
        ]
        ticket.attach(entries)
        return ticket, entries
