"""The collector: one task owns the queue, and turns it into batches.

It waits until the device is free (the previous batch has returned, and the model's turn on a
device shared with other models has come), asks the dispatch policy what the next batch should
be, looks at the queue until a group is ready or due, takes a batch from it (``selection``)
and runs it (``run``) in the runner's executor thread, so the event loop never runs model code.
Requests come in through ``enqueue`` (one, from this process) and ``enqueue_frame`` (a front
end's frame), admitted or refused at once (``admission``).

Each request is answered exactly once, by whichever comes first: its result, its error, its
deadline, or its caller going away. A request whose caller has gone, or whose deadline has
passed, is removed from the queue and never computed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Generic

from service.engine.batcher.admission import Admission, Admitted, Part, Submission
from service.engine.batcher.clock import Clock, Deadlines, MonotonicClock, Timer
from service.engine.batcher.estimates import BatchTimes
from service.engine.batcher.policy import DispatchPolicy, Target
from service.engine.batcher.queue import BatchQueue, Entry, Group, QueueMetrics, Sink, Ticket
from service.engine.batcher.run import (
    BatchFunction,
    BatchRun,
    OutputT,
    PayloadT,
    RowLimit,
    StallWatch,
)
from service.engine.batcher.selection import Limits, Quantum, Selector
from service.engine.batcher.spans import BatchTracer
from service.engine.device_turns import HeldTurn, ModelTurns
from service.errors import ServiceError
from service.metrics import ModelMetrics
from service.types import Priority

logger = logging.getLogger("service.engine.batching")


def max_estimate(estimates: Iterable[float | None]) -> float | None:
    """The longest of ``estimates``; None when any is unknown."""
    longest = 0.0
    for seconds in estimates:
        if seconds is None:
            return None
        longest = max(longest, seconds)
    return longest


def joins_run(run_s: float | None, next_s: float | None, max_run_s: float) -> bool:
    """Whether a batch expected to take ``next_s`` joins a run expected to take ``run_s``:
    only while both are known and together they end within ``max_run_s`` (0: no runs)."""
    if run_s is None or next_s is None:
        return False
    return max_run_s > 0 and run_s + next_s <= max_run_s


class DynamicBatcher(Generic[PayloadT, OutputT]):
    """Queues requests and runs them in batches through ``run_batch`` on ``executor``."""

    def __init__(
        self,
        run_batch: BatchFunction[PayloadT, OutputT],
        *,
        policy: DispatchPolicy,
        executor: Executor,
        metrics: ModelMetrics,
        max_batch_size: int,
        max_queue_size: int,
        request_timeout_ms: float,
        max_batch_cost: int = 0,
        stall_timeout_s: float = 0.0,
        on_stall: Callable[[], None] | None = None,
        tracer: BatchTracer | None = None,
        turns: ModelTurns | None = None,
        clock: Clock | None = None,
        instances: int = 1,
        max_batch_ms: float = 0.0,
        quantum_floor_cost: int = 0,
        max_run_ms: float = 0.0,
    ) -> None:
        """``policy``: when a batch goes (``policy.py``). ``turns``: this model's turns on a
        device shared with other models; a batch is taken once its turn has come, and runs
        within it. ``instances``: batches that may run at once (``instances.py``: the
        executor's threads). ``quantum_floor_cost``: padded positions a batch always may hold
        whatever ``max_batch_ms`` says (one longest row). ``max_run_ms``: how long
        full batches run back to back in one hand-off may be expected to take (0: one batch a
        hand-off); with one instance only, so that each instance gets a batch of its own."""
        if max_batch_size < 1 or max_queue_size < 1:
            raise ValueError(
                f"max_batch_size and max_queue_size must be at least 1, "
                f"got {max_batch_size} and {max_queue_size}"
            )
        self._clock = clock or MonotonicClock()
        self._policy = policy
        self._instances = instances
        self._max_run_s = max_run_ms / 1e3 if instances == 1 else 0.0
        self._handed_s: float | None = None
        """The expected time of the run handed to the device last (None: unknown)."""
        self._metrics = metrics
        self._max_batch_cost = max_batch_cost
        self._turn = HeldTurn(turns)
        self.times = BatchTimes(self._clock.now)
        """Recent forward durations by group and size; the warm-up seeds them."""
        self._quantum = Quantum(
            max_batch_ms / 1e3, self.times.fastest, max(1, max_queue_size // 4), quantum_floor_cost
        )
        request_timeout_s = request_timeout_ms / 1000.0
        self._queue = BatchQueue(QueueMetrics(self._clock, metrics), request_timeout_s)
        self._deadlines = Deadlines[Entry](self._clock, self._queue.expire)
        self._row_limit = RowLimit(max_batch_size, metrics.effective_max_batch_size.set)
        self._stall = StallWatch(self._clock, stall_timeout_s, on_stall)
        self._run = BatchRun[PayloadT, OutputT](
            run_batch,
            executor=executor,
            metrics=metrics,
            clock=self._clock,
            times=self.times,
            row_limit=self._row_limit,
            stall=self._stall,
            tracer=tracer,
            outbox=self._queue.outbox,
        )
        self._admission = Admission(
            clock=self._clock,
            queue=self._queue,
            deadlines=self._deadlines,
            metrics=metrics,
            times=self.times,
            quantum=self._quantum,
            row_limit=self._row_limit,
            running=self._run,
            max_batch_cost=max_batch_cost,
            max_queue_size=max_queue_size,
            request_timeout_s=request_timeout_s,
        )
        self._selector = Selector()
        self._target = Target(max_batch_size, max_batch_size)
        self._limits = Limits(max_batch_size, max_batch_cost, self._quantum)
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
        """Started, and neither draining nor stalled."""
        return not (self._closing or self._stall.stalled) and self._collector is not None

    @property
    def stalled(self) -> bool:
        """A batch has run longer than ``stall_timeout_s``; the model may be hung."""
        return self._stall.stalled

    @property
    def row_limit(self) -> int:
        """Rows per batch now: ``max_batch_size``, or less for a while after an OOM."""
        return self._row_limit.rows

    # ----------------------------------------------------------------- requests in

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
        more: tuple[Part, ...] = (),
        order: Sequence[int] | None = None,
    ) -> Ticket[OutputT]:
        """Queue one request now; its ``Ticket`` gets its outputs, one per chunk.

        Requests share a batch only within the same ``group``. ``cost_per_row`` (e.g. padded
        tokens) counts against ``max_batch_cost`` when that is set; a chunk holds at least one
        row whatever its cost. ``high`` priority requests are taken before ``normal`` ones.
        ``deadline_s`` (``time.monotonic()``) defaults to ``request_timeout_ms`` from now.
        ``source`` names the front end (batch sources are counted); ``trace``: its W3C
        ``traceparent``. Once answered the ticket goes to ``sink`` with the others of its
        batch; ``tag`` is the caller's name for it. ``more``: further parts of the request, each
        of its own group (a request sorted by length, a part per length bucket), and ``order``
        where each of its rows is among the parts' rows joined (``Ticket.order``).

        Raises at once ``QueueFullError``, ``OverloadedError`` (the work ahead would make it
        late), ``DeadlineUnreachableError`` (too long even alone), ``InvalidInputError`` (no
        rows), ``NotReadyError`` (draining, stalled); the ticket fails with
        ``DeadlineExceededError`` or ``InferenceError`` (the model failed on its input).
        """
        now_s = self._clock.now()
        self._policy.arrived(source, 1, now_s)
        if not self.accepting:
            raise self._admission.not_ready()
        was_empty = not self._queue
        ticket = self._admission.admit(
            Submission(
                payload,
                group,
                cost_per_row,
                priority,
                deadline_s,
                request_id,
                trace,
                tag,
                more,
                order,
            ),
            source,
            sink,
            now_s,
        )
        self._added(was_empty)
        return ticket

    def enqueue_frame(
        self,
        submissions: Sequence[Submission],
        *,
        source: Hashable = None,
        sink: Sink | None = None,
    ) -> list[Admitted]:
        """Queue the requests of one frame from one front end, in order: for each, its ticket
        or the error ``enqueue`` would have raised for it. They arrived together: the clock
        is read once for them all."""
        now_s = self._clock.now()
        self._policy.arrived(source, len(submissions), now_s)
        if not self.accepting:
            return [self._admission.not_ready() for _ in submissions]
        was_empty = not self._queue
        admitted = self._admission.admit_frame(list(submissions), source, sink, now_s)
        self._added(was_empty)
        return admitted

    def refusal_of_any(
        self, priority: Priority = "normal", deadline_s: float | None = None
    ) -> ServiceError | None:
        """What ``enqueue`` would raise now for any request at ``priority`` due at
        ``deadline_s``, whatever its rows (``Admission.refusal_of_any``)."""
        return self._admission.refusal_of_any(priority, deadline_s)

    def estimated_wait_s(self, priority: Priority = "normal") -> float:
        """How long a request queued now would wait for the device (``admission``)."""
        return self._admission.estimated_wait_s(priority)

    def _added(self, was_empty: bool) -> None:
        # Wake the collector only when its decision can change: the queue was empty (it sleeps
        # without a timer), or a group is ready now.
        if self._queue and (
            was_empty
            or any(
                self._policy.is_ready(group, self._target, self._limits) for group in self._queue
            )
        ):
            self._wakeup.set()

    # ----------------------------------------------------------------- batches out

    async def _collect_forever(self) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                # Collect once an instance is free, or to queue the next run behind one.
                while len(running) >= self._instances and not (
                    len(running) == 1 and self._queues_ahead()
                ):
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                batch = await self._next_batch()
                if batch is None:
                    break
                run = self._run_of(batch)
                if self._instances == 1 and not running and not self._queues_ahead():
                    await self._run_and_release(run)
                else:
                    task = asyncio.get_running_loop().create_task(self._run_and_release(run))
                    running.add(task)
                    task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(running)
        except Exception:
            # A mistake in choosing batches must not leave the queue unserved for ever: the
            # batcher reports itself stalled, as with a hung model, so its process is replaced.
            logger.exception("collector_failed")
            self._stall.report()
            queued = [
                entry for group in self._queue for lane in group.lanes.values() for entry in lane
            ]
            with self._queue.outbox:
                for entry in queued:
                    entry.reject(self._admission.not_ready())
        finally:
            self._turn.release()
            self._deadlines.close()
            self._cancel_wakeup_timer()
            self._stall.close()

    async def _run_and_release(self, run: list[list[Entry]]) -> None:
        try:
            await self._run.run(run)
        finally:
            self._policy.answered([entry for batch in run for entry in batch], self._clock.now())
            self._turn.release()

    def _queues_ahead(self) -> bool:
        """Whether the next run is handed to the device while one runs, to wait there: so the
        device goes on to it at once, not after a turn of the event loop that answers the run
        before. With runs (``max_run_ms``, one instance), while every group queued is ready,
        no other model waits for the device, and the run handed over last is expected to take
        at most ``max_run_ms``: a batch is chosen (deadlines, priorities) at most that long
        before it starts, and never behind a long batch, where the turn of the event loop costs
        little."""
        return (
            self._handed_s is not None
            and self._handed_s <= self._max_run_s
            and bool(self._queue)
            and not self._turn.contended
            and len(self._ready_groups()) == len(self._queue.groups)
        )

    def _ready_groups(self) -> list[Group]:
        """The queued groups that go at once (``DispatchPolicy.is_ready``)."""
        return [g for g in self._queue if self._policy.is_ready(g, self._target, self._limits)]

    def _run_of(self, first: list[Entry]) -> list[list[Entry]]:
        """``first``, then more batches while every group queued is ready (full) and the run is
        expected to end within ``max_run_ms``: the device runs them back to back in one
        hand-off, without a turn of the event loop between them (``run.BatchRun``). A group
        still filling stops the run, so that it never waits for more than one batch and the
        run's time once it is due. Keeps the run's expected time (``_handed_s``)."""
        run = [first]
        self._handed_s = None
        if self._max_run_s <= 0 or not first:  # empty: its heads were all gone or late
            return run
        run_s = self.times.estimate(first[0].group, sum(entry.rows for entry in first))
        while self._queue:
            ready = self._ready_groups()
            if len(ready) < len(self._queue.groups):  # one waits for rows: it may soon be due
                break
            rows = self._limits.row_limit
            next_s = max_estimate(self.times.estimate(g.key, min(g.rows, rows)) for g in ready)
            if not joins_run(run_s, next_s, self._max_run_s):
                break
            batch = self._take(ready, self._limits)
            if not batch:
                break
            run.append(batch)
            run_s = (run_s or 0.0) + (
                self.times.estimate(batch[0].group, sum(entry.rows for entry in batch)) or 0.0
            )
        self._handed_s = run_s
        return run

    async def _next_batch(self) -> list[Entry] | None:
        """Wait for a batch worth running; ``None`` once draining and the queue is empty."""
        if self._row_limit.rows < self._row_limit.max_batch_size:  # capped after an OOM
            self._row_limit.restore(self._clock.now())
        target = self._target = self._policy.target(self._row_limit.rows)
        limits = self._limits = Limits(
            min(self._row_limit.rows, target.cap), self._max_batch_cost, self._quantum
        )
        looked_again = not target.look_again
        while True:
            if limits.row_limit > self._row_limit.rows:  # another instance ran out of memory
                limits = self._limits = Limits(
                    self._row_limit.rows, self._max_batch_cost, self._quantum
                )
            if not self._queue:
                if self._closing:
                    return None
                self._turn.release()  # what it waited for is gone (expired, cancelled)
                await self._sleep_until(None)
                continue
            ready = [group for group in self._queue if self._policy.is_ready(group, target, limits)]
            if not looked_again and not ready:
                # Requests already received but not yet parsed are queued ahead of us on the
                # event loop: let them run once so they can join, even if the oldest has
                # waited max_wait (it waited while the device was busy). Not when a batch is
                # ready: the device would wait for every answer of the last batch to be written.
                looked_again = True
                await asyncio.sleep(0)
                continue
            due_at: dict[Hashable, float] = {}
            if ready and len(ready) == len(self._queue.groups):  # all ready (c=1): all due
                due = ready
            else:
                now_s = self._clock.now()
                alone = not ready
                for group in self._queue:
                    due_at[group.key] = self._policy.due_at_s(
                        group, target, alone, limits, self.times.estimate
                    )
                due = [g for g in self._queue if g in ready or due_at[g.key] <= now_s]
            if (due or self._closing) and await self._turn.take():
                continue  # the device was another model's: take what is due now
            if due or self._closing:
                self._metrics.dispatched(self._policy.reason(ready, due, limits, due_at))
                return self._take(due or list(self._queue), limits)
            self._turn.release()  # nothing due any more (expired, cancelled): let others run
            await self._sleep_until(min(due_at.values()))

    def _take(self, candidates: list[Group], limits: Limits) -> list[Entry]:
        batch = self._selector.take(
            self._queue, candidates, limits, self.times.estimate, self._clock.now()
        )
        self._policy.taken(batch)
        return batch

    async def _sleep_until(self, when_s: float | None) -> None:
        """Wait for an enqueue that can change the decision, or until ``when_s``."""
        self._wakeup.clear()
        if when_s is not None:
            self._wakeup_timer = self._clock.call_at(when_s, self._wakeup.set)
        try:
            await self._wakeup.wait()
        finally:
            self._cancel_wakeup_timer()

    def _cancel_wakeup_timer(self) -> None:
        if self._wakeup_timer is not None:
            self._wakeup_timer.cancel()
            self._wakeup_timer = None
