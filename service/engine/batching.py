"""Dynamic batching: many concurrent requests, one forward pass.

Pure asyncio: no torch, no web framework. ``DynamicBatcher`` is the collector: one task owns
the queue. It waits until the device is free (the previous batch has returned), then takes a
group (requests whose instances have the same shape or length bucket) and fills a batch from
it, up to the row limit and the token budget, as the dispatch policy says when; the batch runs
in the runner's executor thread, so the event loop never runs model code.

Its pieces (``batch_*.py``, each tested alone): the queue, admission, selection, fill,
dispatch policies, guards, the run, deadlines (one heap, one timer), tickets, the clock.

Each request is answered exactly once, by whichever comes first: its result, its error, its
deadline, or its caller going away. A request whose caller has gone, or whose deadline has
passed, is removed from the queue and never computed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from typing import Generic

from service.config import BatchPolicy
from service.engine.batch_clock import Clock, MonotonicClock, Timer
from service.engine.batch_deadlines import Deadlines
from service.engine.batch_dispatch import Dispatch
from service.engine.batch_fill import BatchFiller, answer_skipped
from service.engine.batch_guards import OOM_BACKOFF_S, RowLimit, StallWatch
from service.engine.batch_intake import Admitted, Intake, Submission
from service.engine.batch_queue import QUEUE_DEPTH_REFRESH_S, BatchQueue, DepthGauge, Entry, Group
from service.engine.batch_refill import Returns
from service.engine.batch_run import BatchFunction, BatchRun, Deliveries, OutputT, PayloadT
from service.engine.batch_selection import Limits, Quantum
from service.engine.batch_spans import BatchTracer
from service.engine.batch_ticket import Sink, Ticket
from service.engine.device_turns import HeldTurn, ModelTurns
from service.engine.estimates import BatchTimes
from service.errors import DeadlineExceededError, InferenceError, ServiceError
from service.metrics import DropReason, ModelMetrics
from service.types import Priority

__all__ = [
    "OOM_BACKOFF_S",
    "QUEUE_DEPTH_REFRESH_S",
    "Admitted",
    "BatchFunction",
    "DynamicBatcher",
    "Submission",
    "Ticket",
]

logger = logging.getLogger(__name__)


class DynamicBatcher(Generic[PayloadT, OutputT]):
    """Queues requests and runs them in batches through ``run_batch`` on ``executor``."""

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
        clock: Clock | None = None,
        instances: int = 1,
        max_batch_ms: float = 0.0,
        quantum_floor_cost: int = 0,
    ) -> None:
        """``turns``: this model's turns on a device shared with other models; a batch is
        taken once its turn has come, and runs within it. ``expected_requests``: how many
        requests the front ends hold now (the adaptive policy's hint). ``instances``: batches that
        may run at once (``instances.py``: the executor's threads). ``quantum_floor_cost``: padded
        positions a batch always may hold whatever ``max_batch_ms`` says (one longest row)."""
        if max_batch_size < 1 or max_queue_size < 1:
            raise ValueError(
                f"max_batch_size and max_queue_size must be at least 1, "
                f"got {max_batch_size} and {max_queue_size}"
            )
        self._clock = clock or MonotonicClock()
        self._instances = instances
        self._metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.policy = policy
        self._dispatch = Dispatch(policy, max_wait_ms / 1000.0)
        self._request_timeout_s = request_timeout_ms / 1000.0
        self._expected_requests = expected_requests
        self._turn = HeldTurn(turns)
        self.times = BatchTimes(self._clock.now)
        """Recent forward durations by group and size; the warm-up seeds them."""
        self._quantum = Quantum(
            max_batch_ms / 1e3, self.times.fastest, max(1, max_queue_size // 4), quantum_floor_cost
        )
        self._queue = BatchQueue()
        self._deadlines = Deadlines(self._clock, self._expire)
        self._deliveries = Deliveries()
        self._row_limit = RowLimit(max_batch_size, metrics.effective_max_batch_size.set)
        self._stall = StallWatch(self._clock, stall_timeout_s, on_stall)
        self._runner = BatchRun[PayloadT, OutputT](
            run_batch,
            executor=executor,
            metrics=metrics,
            clock=self._clock,
            times=self.times,
            row_limit=self._row_limit,
            stall=self._stall,
            tracer=tracer,
            deliveries=self._deliveries,
        )
        self._depth = DepthGauge(self._clock, self._queue, metrics.queue_depth.set)
        self._filler = BatchFiller()
        self._intake = Intake(
            clock=self._clock,
            queue=self._queue,
            deadlines=self._deadlines,
            metrics=metrics,
            times=self.times,
            quantum=self._quantum,
            row_limit=self._row_limit,
            max_batch_cost=max_batch_cost,
            max_queue_size=max_queue_size,
            request_timeout_s=self._request_timeout_s,
            running_until_s=lambda: self._runner.running_until_s,
            accepting=lambda: self.accepting and self._collector is not None,
            withdraw=self._withdraw,
            finished=self._deliveries.finished,
            added=self._added,
        )
        self._returns = Returns()
        self._target_rows = self._cap_rows = max_batch_size
        self._last_limits = Limits(max_batch_size, max_batch_cost, self._quantum)
        self._wakeup = asyncio.Event()
        self._wakeup_timer: Timer | None = None
        self._closing = False
        self._collector: asyncio.Task[None] | None = None
        metrics.effective_max_batch_size.set(max_batch_size)

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
        return self._queue.entries

    @property
    def accepting(self) -> bool:
        return not (self._closing or self._stall.stalled)

    @property
    def stalled(self) -> bool:
        """A batch has run longer than ``stall_timeout_s``; the model may be hung."""
        return self._stall.stalled

    @property
    def row_limit(self) -> int:
        """Rows per batch now: ``max_batch_size``, or less for a while after an OOM."""
        return self._row_limit.rows

    def _limits(self) -> Limits:
        rows = min(self._row_limit.rows, self._cap_rows)
        if self._last_limits.row_limit != rows:  # the same until the row limit or cap changes
            self._last_limits = Limits(rows, self.max_batch_cost, self._quantum)
        return self._last_limits

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
        sink: Sink | None = None,
        tag: object = None,
    ) -> Ticket[OutputT]:
        """Queue one request now; its ``Ticket`` gets its outputs, one per chunk.

        Requests share a batch only within the same ``group``. ``cost_per_row`` (e.g. padded
        tokens) counts against ``max_batch_cost`` when that is set; a chunk holds at least one
        row whatever its cost. ``high`` priority requests are taken before ``normal`` ones.
        ``deadline_s`` (``time.monotonic()``) defaults to ``request_timeout_ms`` from now.
        ``source`` names the front end (batch sources are counted); ``trace``: its W3C
        ``traceparent``. Once answered the ticket goes to ``sink`` with the others of its
        batch; ``tag`` is the caller's name for it.

        Raises at once ``QueueFullError``, ``OverloadedError`` (the work ahead would make it
        late), ``DeadlineUnreachableError`` (too long even alone), ``InvalidInputError`` (no
        rows), ``NotReadyError`` (draining, stalled); the ticket fails with
        ``DeadlineExceededError`` or ``InferenceError`` (the model failed on its input).
        """
        self._returns.arrived(source, 1, self._clock.now())
        return self._intake.enqueue(
            Submission(payload, group, cost_per_row, priority, deadline_s, request_id, trace, tag),
            source,
            sink,
        )

    def enqueue_frame(
        self,
        submissions: Sequence[Submission],
        *,
        source: Hashable = None,
        sink: Sink | None = None,
    ) -> list[Admitted]:
        """Queue the requests of one frame from one front end at once (``batch_intake``): for
        each, in order, its ticket or the error ``enqueue`` would have raised for it had the
        requests been queued one by one."""
        self._returns.arrived(source, len(submissions), self._clock.now())
        return self._intake.enqueue_frame(submissions, source, sink)

    def refusal_of_any(
        self, priority: Priority = "normal", deadline_s: float | None = None
    ) -> ServiceError | None:
        """What ``enqueue`` would raise now for any request at ``priority`` due at
        ``deadline_s``, whatever its rows (``Intake.refusal_of_any``)."""
        return self._intake.refusal_of_any(priority, deadline_s)

    def estimated_wait_s(self, priority: Priority = "normal") -> float:
        """How long a request queued now would wait for the device (``batch_admission``)."""
        return self._intake.estimated_wait_s(priority)

    def _added(self, groups: list[Group], was_empty: bool) -> None:
        self._depth.changed()
        # Wake the collector only when its decision can change: the queue was empty (it sleeps
        # without a timer), or a group just reached a full batch or the adaptive target.
        limits = self._limits()
        if was_empty or any(
            self._dispatch.is_ready(group, self._target_rows, limits) for group in groups
        ):
            self._wakeup.set()

    def _expire(self, entries: list[Entry]) -> None:
        """Deadline: answer 504 now, even while another batch is running."""
        for entry in entries:
            if entry.queued:
                self._queue.remove(entry)
            self._metrics.dropped(DropReason.EXPIRED).inc()
        self._depth.changed()
        for entry in entries:
            entry.reject(
                DeadlineExceededError(
                    f"the request was not answered within {self._request_timeout_s * 1000:.0f} ms"
                )
            )

    def _withdraw(self, entries: list[Entry]) -> None:
        """The caller stopped waiting (or one chunk failed): drop the queued chunks so they
        are never computed, and answer every chunk not answered yet as cancelled."""
        for entry in entries:
            if entry.queued:
                self._queue.remove(entry)
                self._depth.changed()
                self._metrics.dropped(DropReason.CANCELLED).inc()
            entry.reject(asyncio.CancelledError())

    async def _collect_forever(self) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                while len(running) >= self._instances:  # collect once an instance is free
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                batch = await self._next_batch()
                if batch is None:
                    break
                if self._instances == 1:
                    await self._run(batch)
                else:
                    task = asyncio.get_running_loop().create_task(self._run(batch))
                    running.add(task)
                    task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(running)
        finally:
            self._turn.release()
            self._deadlines.close()
            self._cancel_wakeup_timer()
            self._stall.close()

    async def _run(self, batch: list[Entry]) -> None:
        try:
            await self._runner.run(batch)
        except Exception:  # never let one batch stop the collector
            logger.exception("batch_failed_unexpectedly")
            with self._deliveries.per_batch():
                for entry in batch:
                    entry.reject(InferenceError("internal error while running the batch"))
        finally:
            self._returns.answered(batch, self._clock.now())
            self._turn.release()

    async def _next_batch(self) -> list[Entry] | None:
        """Wait for a batch worth running; ``None`` once draining and the queue is empty."""
        if self._row_limit.rows < self._row_limit.max_batch_size:  # capped after an OOM
            self._row_limit.restore(self._clock.now())
        adaptive = self._dispatch.adaptive
        expected = self._expected_requests() if adaptive else 0
        rows = self._row_limit.rows
        split = self._dispatch.split_rows(expected, rows, self._instances)
        self._target_rows = split or self._dispatch.target_rows(
            self._filler.last_batch_rows, expected, rows
        )
        self._cap_rows = split or rows
        yielded = not adaptive
        while True:
            if not self._queue:
                if self._closing:
                    return None
                self._turn.release()  # what it waited for is gone (expired, cancelled)
                await self._sleep_until(None)
                continue
            limits = self._limits()
            ready = [
                g for g in self._queue if self._dispatch.is_ready(g, self._target_rows, limits)
            ]
            if not yielded and not ready:
                # Requests already received but not yet parsed are queued ahead of us on the
                # event loop: let them run once so they can join, even if the oldest has
                # waited max_wait (it waited while the device was busy). Not when a batch is
                # ready: the device would wait for every answer of the last batch to be written.
                yielded = True
                await asyncio.sleep(0)
                continue
            if ready and len(ready) == len(self._queue.groups):  # all ready (c=1): all due
                due, due_at = ready, {}
            else:
                now_s = self._clock.now()
                refill = not ready
                until_s = self._returns.until_s(self._dispatch.max_wait_s)
                due_at = {g.key: self._due_at_s(g, until_s, refill) for g in self._queue}
                due = [g for g in self._queue if g in ready or due_at[g.key] <= now_s]
            if (due or self._closing) and await self._turn.take():
                continue  # the device was another model's: take what is due now
            if due or self._closing:
                self._metrics.dispatched(self._dispatch.reason(ready, due, limits, due_at))
                return self._take(due or list(self._queue), limits)
            self._turn.release()  # nothing due any more (expired, cancelled): let others run
            await self._sleep_until(min(due_at.values()))

    def _due_at_s(self, group: Group, refill_until_s: float, refill: bool) -> float:
        # No refill wait where the quantum would not let the batch grow by a row anyway.
        grown_cost = group.cost + group.cost // group.rows
        refill = refill and self._quantum.allows(group.key, group.rows + 1, grown_cost)
        run_s = (self.times.estimate(group.key, self._target_rows) or 0.0) if refill else 0.0
        return self._dispatch.due_at_s(group, refill_until_s, refill, run_s)

    async def _sleep_until(self, when_s: float | None) -> None:
        """Wait for an enqueue that can change the decision, or until ``when_s``."""
        self._wakeup.clear()
        if when_s is not None:
            self._wakeup_timer = self._clock.call_at(when_s, self._wakeup.set)
        try:
            await self._wakeup.wait()
        finally:
            if self._wakeup_timer is not None:  # tested here: at c=1 none is set, a call less
                self._cancel_wakeup_timer()

    def _cancel_wakeup_timer(self) -> None:
        if self._wakeup_timer is not None:
            self._wakeup_timer.cancel()
            self._wakeup_timer = None

    def _take(self, candidates: list[Group], limits: Limits) -> list[Entry]:
        """Fill one batch from the best candidate group (``batch_fill``) within ``limits``."""
        taken = self._filler.take(
            self._queue, candidates, limits, self.times.estimate, self._clock.now()
        )
        self._depth.changed()
        answer_skipped(taken, self._metrics, self.times.estimate, self._request_timeout_s)
        return taken.batch
