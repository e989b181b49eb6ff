"""Dynamic batching: many concurrent requests, one forward pass.

Pure asyncio: no torch, no web framework. One collector task owns the queue. It waits until
the device is free (the previous batch has returned), then takes a group (requests whose
instances have the same shape or length bucket) and fills a batch from it, high-priority
requests first, up to ``max_batch_size`` rows (and ``max_batch_cost`` padded tokens), waiting
at most ``max_wait_ms`` counted from the oldest request's arrival. The batch runs in the
runner's single executor thread, so the event loop never runs model code.

Each request's future is resolved exactly once, by whichever comes first: its result, its
error, its deadline, or its caller going away. A request whose caller has gone, or whose
deadline has passed, is removed from the queue and never computed.

Fairness: a group whose oldest request has waited ``max_wait_ms`` is due like a full one, and
among the groups due the one whose oldest request came first runs next, except the group of the
last batch, which goes after the others (round robin); so a request waits at most
``max_wait_ms``, the batch running, and one batch of each other group due, however full another
group keeps. Deadlines: from recent forward durations (``estimates.BatchTimes``) the batcher
refuses at once what cannot be served in time (429 with ``Retry-After`` when the queue holds
too much work, 422 when the request alone needs longer than its deadline); a batch takes only
the requests it can finish before every deadline in it (the others wait for the next batch),
and a request that cannot finish by its deadline even alone is answered 504 at once,
uncomputed. Under overload the device thus keeps computing answers someone gets.

A batch that raises is retried by halves, so only the request that causes the error fails. A
batch that runs out of device memory is retried by halves too, and for a while batches are
capped at half the rows that failed. A batch that runs longer than ``stall_timeout_s`` marks
the batcher stalled: it refuses new work and calls ``on_stall`` so the process can be replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Self, TypeVar

from service import tracing
from service.config import BatchPolicy
from service.engine.batch_spans import BatchTracer
from service.engine.device_turns import ModelTurns
from service.engine.estimates import BatchTimes
from service.errors import (
    DeadlineExceededError,
    DeadlineUnreachableError,
    DeviceOutOfMemoryError,
    InferenceError,
    InsufficientDeviceMemoryError,
    InvalidInputError,
    NotReadyError,
    OverloadedError,
    QueueFullError,
    ServiceError,
)
from service.metrics import DropReason, ModelMetrics
from service.types import PRIORITIES, Priority

logger = logging.getLogger(__name__)

#: After this many batches led by high-priority requests while normal ones wait, the next
#: batch is filled with normal requests first, so normal traffic is never starved.
HIGH_PRIORITY_STREAK_LIMIT = 3
#: After running out of device memory, batches stay capped this long before the cap doubles.
OOM_BACKOFF_S = 30.0
#: The queue-depth gauge follows the queue at most this late. Written on every enqueue and
#: dequeue it cost two metric writes per request (file writes with several processes); a
#: gauge scraped every few seconds loses nothing at this delay.
QUEUE_DEPTH_REFRESH_S = 0.05


class Rows(Protocol):
    """A payload of one or more rows that can be sliced along its first axis (e.g. an array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> Self: ...


PayloadT = TypeVar("PayloadT", bound=Rows)
OutputT = TypeVar("OutputT")

#: Runs one batch in the executor thread: one output per payload, in order; raises if the
#: whole batch fails, or gives an exception as the output of a payload that fails alone.
BatchFunction = Callable[[list[PayloadT]], Sequence[OutputT | Exception]]


@dataclass(eq=False)
class _Entry(Generic[PayloadT, OutputT]):
    """One queued piece of work: a whole request, or one chunk of a request split by size."""

    payload: PayloadT
    rows: int
    cost: int
    group: Hashable
    priority: Priority
    arrival_s: float
    deadline_s: float
    request_id: str
    future: asyncio.Future[OutputT]
    source: Hashable = None
    queued: bool = True
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    trace: str | None = None
    """The request's W3C ``traceparent`` when its front end traces it."""
    batches: tuple[tuple[str, int], ...] = ()
    """Each traced batch that ran it: the batch span's ``traceparent`` and these rows."""

    def resolve(self, output: OutputT) -> None:
        """Answer with ``output``, unless answered already (deadline, cancel)."""
        if not self.future.done():
            self.future.set_result(output)
        self._stop_timer()

    def reject(self, error: BaseException) -> None:
        """Answer with ``error``, unless answered already."""
        if not self.future.done():
            self.future.set_exception(error)
        self._stop_timer()

    def withdraw(self) -> None:
        """Its caller has gone: cancel the future, unless answered already."""
        if not self.future.done():
            self.future.cancel()
        elif not self.future.cancelled():
            self.future.exception()  # mark an error nobody will read as retrieved
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Group(Generic[PayloadT, OutputT]):
    """The queued entries of one group, one FIFO lane per priority, with running totals."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.lanes: dict[Priority, deque[_Entry[PayloadT, OutputT]]] = {
            priority: deque() for priority in PRIORITIES
        }
        self.rows = 0
        self.cost = 0
        self.high_rows = 0

    def append(self, entry: _Entry[PayloadT, OutputT]) -> None:
        self.lanes[entry.priority].append(entry)
        self._count(entry, +1)

    def remove(self, entry: _Entry[PayloadT, OutputT]) -> None:
        self.lanes[entry.priority].remove(entry)
        self._count(entry, -1)

    def pop(self, priority: Priority) -> _Entry[PayloadT, OutputT]:
        entry = self.lanes[priority].popleft()
        self._count(entry, -1)
        return entry

    def head(self, priority: Priority) -> _Entry[PayloadT, OutputT] | None:
        lane = self.lanes[priority]
        return lane[0] if lane else None

    def oldest(self) -> _Entry[PayloadT, OutputT] | None:
        heads = [lane[0] for lane in self.lanes.values() if lane]
        return min(heads, key=lambda entry: entry.arrival_s, default=None)

    def _count(self, entry: _Entry[PayloadT, OutputT], sign: int) -> None:
        self.rows += sign * entry.rows
        self.cost += sign * entry.cost
        if entry.priority == "high":
            self.high_rows += sign * entry.rows


class Ticket(Generic[OutputT]):
    """A queued request: the futures of its chunks, in request order.

    It always finishes: each chunk is answered by its batch, its deadline or a cancel, and
    once one chunk has failed the request's other chunks still queued are dropped.
    """

    def __init__(
        self, batcher: DynamicBatcher[Any, OutputT], entries: list[_Entry[Any, OutputT]]
    ) -> None:
        self._batcher = batcher
        self._entries = entries
        self._pending = len(entries)
        self._callbacks: list[Callable[[Ticket[OutputT]], None]] = []
        for entry in entries:
            entry.future.add_done_callback(self._chunk_done)

    def add_done_callback(self, callback: Callable[[Ticket[OutputT]], None]) -> None:
        """Call ``callback(ticket)`` once every chunk is answered (result, error or cancel)."""
        if self._pending == 0:
            asyncio.get_running_loop().call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def outputs(self) -> list[OutputT]:
        """Every chunk's output once done; raises the first chunk's error or CancelledError."""
        return [entry.future.result() for entry in self._entries]

    async def wait(self) -> list[OutputT]:
        """The outputs; if the caller is cancelled meanwhile, the request is withdrawn."""
        try:
            return [await entry.future for entry in self._entries]
        except BaseException:
            self.cancel()
            raise

    def batches(self) -> tuple[tuple[str, int], ...]:
        """The traced batches that ran the request's chunks, and the rows each held."""
        return tuple(batch for entry in self._entries for batch in entry.batches)

    def cancel(self) -> None:
        """Withdraw the request: its chunks still queued are dropped and never computed."""
        self._batcher._abandon(self._entries, DropReason.CANCELLED)

    def _chunk_done(self, future: asyncio.Future[OutputT]) -> None:
        self._pending -= 1
        if self._pending and (future.cancelled() or future.exception() is not None):
            self.cancel()  # the request has failed as a whole
        if self._pending == 0:
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback(self)


class DynamicBatcher(Generic[PayloadT, OutputT]):
    """Queues requests and runs them in batches through ``run_batch`` on ``executor``.

    ``submit`` returns the outputs of the request's chunks, in order: one chunk unless the
    request had more rows than fit in one batch.

    Dispatch policy, once the device is free:

    - ``fixed``: wait until the oldest request has waited ``max_wait_ms`` or a batch is full.
    - ``adaptive``: first let requests that have already arrived join; then dispatch as soon
      as the batch holds as many rows as the last batch had, or as the front ends hold
      requests (``expected_requests``: bodies read, not yet answered, which includes the
      clients just answered and about to come back), waiting never past ``max_wait_ms``. A
      lone client never waits for batch-mates that are not coming, nor for uploads still
      arriving; 64 concurrent clients fill batches of 64. Batches also grow while the device
      is busy, because they are only collected when it is free.
    """

    def __init__(
        self,
        run_batch: BatchFunction[PayloadT, OutputT],
        *,
        executor: Executor,
        metrics: ModelMetrics,
        max_batch_size: int,
        max_wait_ms: float,
        max_queue_size: int,
        request_timeout_ms: float,
        max_batch_cost: int = 0,
        policy: BatchPolicy = "adaptive",
        stall_timeout_s: float = 0.0,
        on_stall: Callable[[], None] | None = None,
        expected_requests: Callable[[], int] = lambda: 0,
        tracer: BatchTracer | None = None,
        turns: ModelTurns | None = None,
    ) -> None:
        """``turns``: this model's turns on a device shared with other models; a batch is
        taken once its turn has come, and runs within it."""
        if max_batch_size < 1 or max_queue_size < 1:
            raise ValueError(
                f"max_batch_size and max_queue_size must be at least 1, "
                f"got {max_batch_size} and {max_queue_size}"
            )
        self._run_batch = run_batch
        self._executor = executor
        self._turns = turns
        self._holding_turn = False
        self._metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.policy = policy
        self._max_wait_s = max_wait_ms / 1000.0
        self._max_queue_size = max_queue_size
        self._request_timeout_s = request_timeout_ms / 1000.0
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self._expected_requests = expected_requests
        self._tracer = tracer
        self._queue_depth_refresh: asyncio.TimerHandle | None = None
        self.times = BatchTimes()
        """Recent forward durations by group and size; the warm-up seeds them."""
        self._running_until_s = 0.0
        self._groups: dict[Hashable, _Group[PayloadT, OutputT]] = {}
        self._queued_entries = 0
        self._last_batch_rows = 1
        self._target_rows = max_batch_size
        self._high_streak = 0
        self._last_group: Hashable | None = None
        self._row_limit = max_batch_size
        self._row_limit_until_s = 0.0
        self._wakeup = asyncio.Event()
        self._closing = False
        self._stalled = False
        self._collector: asyncio.Task[None] | None = None
        metrics.effective_max_batch_size.set(max_batch_size)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the collector task; call from inside the running event loop."""
        if self._collector is None:
            self._collector = asyncio.get_running_loop().create_task(
                self._collect_forever(), name="batchserve-collector"
            )

    async def drain(self) -> None:
        """Refuse new requests (503), finish every queued and running one, stop the collector."""
        self._closing = True
        self._wakeup.set()
        if self._collector is not None:
            await self._collector

    @property
    def queue_depth(self) -> int:
        """Queued entries (a request larger than ``max_batch_size`` counts once per chunk)."""
        return self._queued_entries

    @property
    def accepting(self) -> bool:
        return not (self._closing or self._stalled)

    @property
    def stalled(self) -> bool:
        """A batch has run longer than ``stall_timeout_s``; the model may be hung."""
        return self._stalled

    @property
    def row_limit(self) -> int:
        """Rows per batch now: ``max_batch_size``, or less for a while after running out of
        device memory."""
        return self._row_limit

    # ----------------------------------------------------------------- submitting

    async def submit(
        self,
        payload: PayloadT,
        *,
        group: Hashable,
        cost_per_row: int = 0,
        priority: Priority = "normal",
        request_id: str = "-",
        deadline_s: float | None = None,
    ) -> list[OutputT]:
        """Queue one request and wait for its outputs (one per chunk that fits in a batch).

        ``enqueue`` says what the arguments mean and what is raised. If the caller is
        cancelled while waiting, the request's chunks still queued are dropped.
        """
        ticket = self.enqueue(
            payload,
            group=group,
            cost_per_row=cost_per_row,
            priority=priority,
            request_id=request_id,
            deadline_s=deadline_s,
        )
        return await ticket.wait()

    def enqueue(
        self,
        payload: PayloadT,
        *,
        group: Hashable,
        cost_per_row: int = 0,
        priority: Priority = "normal",
        request_id: str = "-",
        deadline_s: float | None = None,
        source: Hashable = None,
        trace: str | None = None,
    ) -> Ticket[OutputT]:
        """Queue one request now; its ``Ticket`` gets its outputs, one per chunk.

        Requests share a batch only within the same ``group``. ``cost_per_row`` (e.g. padded
        tokens) counts against ``max_batch_cost`` when that is set; a chunk holds at least one
        row whatever its cost. ``high`` priority requests are taken before ``normal`` ones.
        ``deadline_s`` (``time.monotonic()``, which is system-wide, so a front end in another
        process can set it) defaults to ``request_timeout_ms`` from now. ``source`` names where
        the request came from (a front end), to count how many share each batch; ``trace``
        is its W3C ``traceparent`` when its front end traces it.

        Raises at once ``QueueFullError`` when the queue is full, ``OverloadedError`` when the
        work queued ahead would not let it finish by its deadline, ``InvalidInputError`` when
        it alone needs longer than its deadline, and ``NotReadyError`` while draining or
        stalled; the ticket fails with ``DeadlineExceededError`` past the deadline (or at once
        when it could not finish by then even alone) and ``InferenceError`` when the model
        fails on this request's input.
        """
        if not self.accepting or self._collector is None:
            self._metrics.dropped(DropReason.DRAINING).inc()
            raise NotReadyError("the server is not accepting requests (starting or draining)")
        total_rows = len(payload)
        if total_rows < 1:
            raise InvalidInputError("a request needs at least one instance")
        rows_per_chunk = self.max_batch_size
        if self.max_batch_cost and cost_per_row:
            rows_per_chunk = max(1, min(rows_per_chunk, self.max_batch_cost // cost_per_row))
        chunks = [
            payload[start : start + rows_per_chunk]
            for start in range(0, total_rows, rows_per_chunk)
        ]
        if self._queued_entries + len(chunks) > self._max_queue_size:
            self._metrics.dropped(DropReason.QUEUE_FULL).inc()
            raise QueueFullError(
                f"the queue is full ({self._max_queue_size} requests waiting); retry shortly"
            )

        loop = asyncio.get_running_loop()
        arrival_s = time.monotonic()
        if deadline_s is None:
            deadline_s = arrival_s + self._request_timeout_s
        self._admit([len(chunk) for chunk in chunks], group, priority, deadline_s - arrival_s)
        # The loop's clock may be coarser than time.monotonic() (uvloop's is in milliseconds).
        deadline = loop.time() + deadline_s - arrival_s
        entries = [
            _Entry(
                payload=chunk,
                rows=len(chunk),
                cost=len(chunk) * cost_per_row,
                group=group,
                priority=priority,
                arrival_s=arrival_s,
                deadline_s=deadline_s,
                request_id=request_id,
                future=loop.create_future(),
                source=source,
                trace=trace,
            )
            for chunk in chunks
        ]
        for entry in entries:
            entry.timer = loop.call_at(deadline, self._expire, entry)
            self._enqueue(entry)
        return Ticket(self, entries)

    def _admit(
        self, chunk_rows: list[int], group: Hashable, priority: Priority, left_s: float
    ) -> None:
        """Refuse now what the estimates say cannot be answered within ``left_s``."""
        own = [self.times.estimate(group, rows) for rows in chunk_rows]
        if any(seconds is None for seconds in own):
            return  # never measured: nothing to refuse it on
        own_s = sum(seconds for seconds in own if seconds is not None)
        if own_s > left_s:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
            raise DeadlineUnreachableError(
                f"these {sum(chunk_rows)} instances need about {own_s * 1000:.0f} ms of "
                f"compute, more than the {left_s * 1000:.0f} ms left before the request's "
                "deadline; send fewer instances per request"
            )
        wait_s = self.estimated_wait_s(priority)
        if wait_s + own_s > left_s:
            self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
            raise OverloadedError(
                f"the queue holds about {wait_s * 1000:.0f} ms of work, and this request "
                f"needs {own_s * 1000:.0f} ms more: it could not be answered within the "
                f"{left_s * 1000:.0f} ms left before its deadline; retry shortly",
                retry_after_s=max(1, math.ceil(wait_s)),
            )

    def estimated_wait_s(self, priority: Priority = "normal") -> float:
        """How long a request queued now would wait for the device: what is left of the
        running batch, then the queued batches it would not go before (all of them for a
        normal request; the high-priority ones for a high one). Unmeasured groups count 0."""
        wait_s = max(0.0, self._running_until_s - time.monotonic())
        for group in self._groups.values():
            rows = group.high_rows if priority == "high" else group.rows
            if rows == 0:
                continue
            per_batch = self._row_limit
            if self.max_batch_cost and group.cost:
                per_batch = max(1, min(per_batch, self.max_batch_cost * group.rows // group.cost))
            full_batches, rest = divmod(rows, per_batch)
            for count, batch_rows in ((full_batches, per_batch), (1 if rest else 0, rest)):
                if count:
                    wait_s += count * (self.times.estimate(group.key, batch_rows) or 0.0)
        return wait_s

    def _enqueue(self, entry: _Entry[PayloadT, OutputT]) -> None:
        group = self._groups.get(entry.group)
        if group is None:
            group = self._groups[entry.group] = _Group(entry.group)
        group.append(entry)
        self._queued_entries += 1
        self._queue_depth_changed()
        # Wake the collector only when its decision can change: the queue was empty (it sleeps
        # without a timer), or this group just reached a full batch or the adaptive target.
        if self._queued_entries == 1 or self._is_full(group) or group.rows >= self._target_rows:
            self._wakeup.set()

    def _queue_depth_changed(self) -> None:
        if self._queue_depth_refresh is None:
            self._queue_depth_refresh = asyncio.get_running_loop().call_later(
                QUEUE_DEPTH_REFRESH_S, self._refresh_queue_depth
            )

    def _refresh_queue_depth(self) -> None:
        self._queue_depth_refresh = None
        self._metrics.queue_depth.set(self._queued_entries)

    def _is_full(self, group: _Group[PayloadT, OutputT]) -> bool:
        return group.rows >= self._row_limit or (
            self.max_batch_cost > 0 and group.cost >= self.max_batch_cost
        )

    def _dequeue(self, entry: _Entry[PayloadT, OutputT]) -> None:
        """Remove a queued entry from anywhere in its group's queue."""
        group = self._groups[entry.group]
        group.remove(entry)
        self._forget_queued(entry, group)

    def _forget_queued(
        self, entry: _Entry[PayloadT, OutputT], group: _Group[PayloadT, OutputT]
    ) -> None:
        entry.queued = False
        if group.rows == 0:  # every entry holds a row at least
            del self._groups[entry.group]
        self._queued_entries -= 1
        self._queue_depth_changed()

    def _expire(self, entry: _Entry[PayloadT, OutputT]) -> None:
        """Deadline timer: answer 504 now, even while another batch is running."""
        entry.timer = None
        if entry.future.done():
            return
        if entry.queued:
            self._dequeue(entry)
        self._metrics.dropped(DropReason.EXPIRED).inc()
        entry.reject(
            DeadlineExceededError(
                f"the request was not answered within {self._request_timeout_s * 1000:.0f} ms"
            )
        )

    def _abandon(self, entries: list[_Entry[PayloadT, OutputT]], reason: DropReason) -> None:
        """The caller stopped waiting: drop its queued chunks so they are never computed."""
        for entry in entries:
            if entry.queued:
                self._dequeue(entry)
                self._metrics.dropped(reason).inc()
            entry.withdraw()

    # ----------------------------------------------------------------- collecting

    async def _collect_forever(self) -> None:
        try:
            while True:
                batch = await self._next_batch()
                if batch is None:
                    return
                try:
                    await self._run(batch)
                except Exception:  # never let one batch stop the collector
                    logger.exception("batch_failed_unexpectedly")
                    for entry in batch:
                        entry.reject(InferenceError("internal error while running the batch"))
                finally:
                    self._release_turn()
        finally:
            self._release_turn()

    async def _take_turn(self) -> bool:
        """Wait for this model's turn on the device; whether it had to wait (requests may
        have arrived meanwhile: look again)."""
        if self._turns is None or self._holding_turn:
            return False
        await self._turns.acquire()
        self._holding_turn = True
        return True

    def _release_turn(self) -> None:
        if self._holding_turn:
            assert self._turns is not None
            self._holding_turn = False
            self._turns.release()

    async def _next_batch(self) -> list[_Entry[PayloadT, OutputT]] | None:
        """Wait for a batch worth running; ``None`` once draining and the queue is empty."""
        self._restore_row_limit()
        if self.policy == "adaptive":
            expected = max(self._last_batch_rows, self._expected_requests())
            self._target_rows = max(1, min(self._row_limit, expected))
        yielded = self.policy != "adaptive"
        while True:
            oldest = self._oldest_entry()
            if oldest is None:
                if self._closing:
                    return None
                self._release_turn()  # what it waited for is gone (expired, cancelled)
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not yielded and not any(self._is_ready(group) for group in self._groups.values()):
                # Requests already received but not yet parsed are queued ahead of us on the
                # event loop: let them run once so they can join, even if the oldest has
                # waited max_wait (it waited while the device was busy). Not when a batch is
                # ready: the device would wait for every answer of the last batch to be written.
                yielded = True
                await asyncio.sleep(0)
                continue
            now_s = time.monotonic()
            due = [group for group in self._groups.values() if self._is_due(group, now_s)]
            if (due or self._closing) and await self._take_turn():
                continue  # the device was another model's: take what is due now
            if due or self._closing:
                return self._take(due or list(self._groups.values()))
            self._release_turn()  # nothing due any more (expired, cancelled): let others run
            remaining_s = oldest.arrival_s + self._max_wait_s - now_s
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=remaining_s)

    def _is_due(self, group: _Group[PayloadT, OutputT], now_s: float) -> bool:
        """Full, or as full as the adaptive target, or its oldest request has waited long
        enough: due groups compete for the next batch by the age of their oldest request."""
        if self._is_ready(group):
            return True
        oldest = group.oldest()
        return oldest is not None and now_s - oldest.arrival_s >= self._max_wait_s

    def _is_ready(self, group: _Group[PayloadT, OutputT]) -> bool:
        """Full, or (adaptive) holding as many rows as the batch should have."""
        return self._is_full(group) or (
            self.policy == "adaptive" and group.rows >= self._target_rows
        )

    def _oldest_entry(self) -> _Entry[PayloadT, OutputT] | None:
        heads = [group.oldest() for group in self._groups.values()]
        return min(
            (head for head in heads if head is not None),
            key=lambda entry: entry.arrival_s,
            default=None,
        )

    def _take(self, candidates: list[_Group[PayloadT, OutputT]]) -> list[_Entry[PayloadT, OutputT]]:
        """Fill one batch from the best candidate group, in priority and arrival order.

        High-priority requests lead, unless they have led ``HIGH_PRIORITY_STREAK_LIMIT``
        batches in a row while normal ones waited: then the longest-waiting normal requests do.
        """
        normal_waiting = any(group.head("normal") for group in self._groups.values())
        lead: Priority = "high"
        if self._high_streak >= HIGH_PRIORITY_STREAK_LIMIT and normal_waiting:
            lead = "normal"
            candidates = list(self._groups.values())
        # Round robin: the group of the last batch goes after the other groups due.
        candidates = [g for g in candidates if g.key != self._last_group] or candidates
        with_lead = [group for group in candidates if group.head(lead) is not None]
        if with_lead:
            group = min(with_lead, key=lambda g: g.head(lead).arrival_s)  # type: ignore[union-attr]
        else:
            group = min(candidates, key=lambda g: g.oldest().arrival_s)  # type: ignore[union-attr]
        order: tuple[Priority, ...] = ("high", "normal") if lead == "high" else ("normal", "high")
        batch: list[_Entry[PayloadT, OutputT]] = []
        rows = cost = 0
        finish_by_s = math.inf  # the earliest deadline in the batch
        for priority in order:
            while (head := group.head(priority)) is not None:
                if head.future.done():  # answered already (deadline or cancel): skip it
                    self._pop(group, priority)
                    # Its caller was cancelled but has not run its clean-up yet; that clean-up
                    # counts only entries still queued, so count the drop here.
                    if head.future.cancelled():
                        self._metrics.dropped(DropReason.CANCELLED).inc()
                    continue
                if not batch and self._would_finish_late(head, group.key, head.rows, math.inf):
                    self._answer_late(self._pop(group, priority), group.key)
                    continue
                if batch and not self._fits(rows, cost, head, group.key, finish_by_s):
                    break
                entry = self._pop(group, priority)
                batch.append(entry)
                rows += entry.rows
                cost += entry.cost
                finish_by_s = min(finish_by_s, entry.deadline_s)
        self._last_batch_rows = max(1, rows)
        self._last_group = group.key
        led_by_high = bool(batch) and batch[0].priority == "high"
        self._high_streak = self._high_streak + 1 if led_by_high and normal_waiting else 0
        return batch

    def _pop(
        self, group: _Group[PayloadT, OutputT], priority: Priority
    ) -> _Entry[PayloadT, OutputT]:
        """Take the head of ``group``'s ``priority`` lane out of the queue."""
        entry = group.pop(priority)
        self._forget_queued(entry, group)
        return entry

    def _would_finish_late(
        self, entry: _Entry[PayloadT, OutputT], group: Hashable, rows: int, finish_by_s: float
    ) -> bool:
        """Whether a batch of ``rows`` rows holding ``entry``, started now, is estimated to end
        after ``entry``'s deadline or ``finish_by_s``. Unmeasured: not late."""
        seconds = self.times.estimate(group, rows)
        if seconds is None:
            return False
        return time.monotonic() + seconds > min(finish_by_s, entry.deadline_s)

    def _answer_late(self, entry: _Entry[PayloadT, OutputT], group: Hashable) -> None:
        """504 now, uncomputed, for an entry that cannot finish by its deadline even alone:
        computing it would only spend the device on an answer nobody gets."""
        seconds = self.times.estimate(group, entry.rows) or 0.0
        self._metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
        entry.reject(
            DeadlineExceededError(
                f"the request could not be answered within {self._request_timeout_s * 1000:.0f}"
                f" ms: its rows would take about {seconds * 1000:.0f} ms"
            )
        )

    def _fits(
        self,
        rows: int,
        cost: int,
        entry: _Entry[PayloadT, OutputT],
        group: Hashable,
        finish_by_s: float,
    ) -> bool:
        """Whether ``entry`` may join a batch of ``rows`` rows and ``cost``: within the row
        limit and the token budget, and the larger batch still estimated to end before every
        deadline in it (an entry that would make it late waits for the next batch). The first
        entry of a batch is not asked: a chunk larger than the current limits runs alone."""
        if rows + entry.rows > self._row_limit:
            return False
        if self.max_batch_cost and cost + entry.cost > self.max_batch_cost:
            return False
        return not self._would_finish_late(entry, group, rows + entry.rows, finish_by_s)

    # ----------------------------------------------------------------- running

    async def _run(self, batch: list[_Entry[PayloadT, OutputT]]) -> None:
        if not batch:
            return
        started_s = time.monotonic()
        for entry in batch:
            exemplar = None if entry.trace is None else tracing.exemplar_of(entry.trace)
            self._metrics.queue_wait.observe(started_s - entry.arrival_s, exemplar)
        if self._tracer is not None:
            self._tracer.queue_waits(batch, started_s)
        self._metrics.batch_sources.observe(len({entry.source for entry in batch}))
        await self._run_isolating_failures(batch)

    async def _run_isolating_failures(self, batch: list[_Entry[PayloadT, OutputT]]) -> None:
        """Run ``batch``; if the forward raises, retry each half so only the culprit fails."""
        batch = [entry for entry in batch if not entry.future.done()]
        if not batch:
            return
        rows = sum(entry.rows for entry in batch)
        self._metrics.batch_size.observe(rows)
        started_s = time.perf_counter()
        traced = self._tracer.batch(batch, rows) if self._tracer else contextlib.nullcontext()
        try:
            with traced:
                outputs = await self._forward(
                    [entry.payload for entry in batch], rows, batch[0].group
                )
            if len(outputs) != len(batch):
                raise RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(batch)}")
        except Exception as error:
            self._metrics.inference_latency.observe(time.perf_counter() - started_s)
            if isinstance(error, DeviceOutOfMemoryError):
                self._shrink_row_limit(rows)
            if len(batch) == 1:
                self._fail(batch[0], error)
                return
            self._metrics.batch_failures.inc()
            middle = len(batch) // 2
            await self._run_isolating_failures(batch[:middle])
            await self._run_isolating_failures(batch[middle:])
            return
        self._metrics.inference_latency.observe(time.perf_counter() - started_s)
        for entry, output in zip(batch, outputs, strict=True):
            if isinstance(output, Exception):
                entry.reject(output)
            else:
                entry.resolve(output)

    async def _forward(
        self, payloads: list[PayloadT], rows: int, group: Hashable
    ) -> Sequence[OutputT | Exception]:
        """``run_batch`` in the executor (never on this thread, however quick: a model that
        hangs must not stop the event loop), watching for a batch that never comes back."""
        estimate_s = self.times.estimate(group, rows)
        started_s = time.monotonic()
        self._running_until_s = started_s + (estimate_s or 0.0)
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self._executor, self._timed_run_batch, payloads)
        watchdog = None
        if self._stall_timeout_s > 0:
            watchdog = loop.call_later(self._stall_timeout_s, self._report_stall)
        try:
            outputs, seconds = await running
        finally:
            self._running_until_s = 0.0
            if watchdog is not None:
                watchdog.cancel()
        self.times.record(group, rows, seconds)
        return outputs

    def _timed_run_batch(
        self, payloads: list[PayloadT]
    ) -> tuple[Sequence[OutputT | Exception], float]:
        """``run_batch`` and its duration, timed on the device thread: several models share
        that thread, so the time a batch waited there for another model's is not its own."""
        started_s = time.monotonic()
        outputs = self._run_batch(payloads)
        return outputs, time.monotonic() - started_s

    def _report_stall(self) -> None:
        if self._stalled:
            return
        self._stalled = True
        logger.error("model_stalled", extra={"stall_timeout_s": self._stall_timeout_s})
        if self._on_stall is not None:
            self._on_stall()

    def _shrink_row_limit(self, failed_rows: int) -> None:
        """Out of device memory: cap batches at half the rows that failed, for a while."""
        self._metrics.out_of_memory.inc()
        self._row_limit = max(1, min(self._row_limit, failed_rows // 2))
        self._row_limit_until_s = time.monotonic() + OOM_BACKOFF_S
        self._metrics.effective_max_batch_size.set(self._row_limit)
        logger.warning(
            "device_out_of_memory", extra={"rows": failed_rows, "row_limit": self._row_limit}
        )

    def _restore_row_limit(self) -> None:
        """Double the capped row limit each ``OOM_BACKOFF_S`` without a new failure."""
        if self._row_limit < self.max_batch_size and time.monotonic() >= self._row_limit_until_s:
            self._row_limit = min(self.max_batch_size, self._row_limit * 2)
            self._row_limit_until_s = time.monotonic() + OOM_BACKOFF_S
            self._metrics.effective_max_batch_size.set(self._row_limit)

    def _fail(self, entry: _Entry[PayloadT, OutputT], error: Exception) -> None:
        if isinstance(error, ServiceError):
            entry.reject(error)
            return
        logger.error(
            "inference_failed",
            extra={"request_id": entry.request_id, "error": f"{type(error).__name__}: {error}"},
        )
        failure: ServiceError
        if isinstance(error, DeviceOutOfMemoryError):
            failure = InsufficientDeviceMemoryError(
                f"out of device memory for this request's {entry.rows} instance(s) even alone; "
                "retry later or with fewer instances"
            )
        else:
            failure = InferenceError(
                f"the model failed on this request's input ({type(error).__name__})"
            )
        failure.__cause__ = error
        entry.reject(failure)
