"""Running one batch on the device thread, with its guards: failures isolated by halving, the
row limit after running out of device memory, the stall watch, and the batch's spans.

``run_batch`` runs in the executor (never on the event loop, however quick: a model that
hangs must not stop the event loop). If it raises, each half of the batch is retried, so only
the request that causes the error fails. A batch that runs out of device memory is retried by
halves too, and for ``OOM_BACKOFF_S`` batches are capped at half the rows that failed; the cap
doubles back each ``OOM_BACKOFF_S`` without a new failure. A batch that runs longer than
``stall_timeout_s`` marks the batcher stalled: it refuses new work and calls ``on_stall`` so
the process can be replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

from service import tracing
from service.engine.batcher.clock import Clock, Timer
from service.engine.batcher.estimates import BatchTimes
from service.engine.batcher.queue import Entry, Outbox
from service.engine.batcher.spans import BatchTimings, BatchTracer
from service.errors import (
    DeviceOutOfMemoryError,
    InferenceError,
    InsufficientDeviceMemoryError,
    ServiceError,
)
from service.metrics import ModelMetrics

logger = logging.getLogger("service.engine.batching")

#: After running out of device memory, batches stay capped this long before the cap doubles.
OOM_BACKOFF_S = 30.0


class Rows(Protocol):
    """A payload of one or more rows that can be sliced along its first axis (e.g. an array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> Self: ...


PayloadT = TypeVar("PayloadT", bound=Rows)
OutputT = TypeVar("OutputT")

#: Runs one batch in the executor thread: one output per payload, in order; raises if the
#: whole batch fails, or gives an exception as the output of a payload that fails alone.
BatchFunction = Callable[[list[PayloadT]], Sequence[OutputT | Exception]]


class RowLimit:
    """Rows per batch now: ``max_batch_size``, or less for a while after an OOM."""

    def __init__(self, max_batch_size: int, on_change: Callable[[int], None]) -> None:
        self.max_batch_size = max_batch_size
        self.rows = max_batch_size
        self._until_s = 0.0
        self._on_change = on_change

    def shrink(self, failed_rows: int, now_s: float) -> None:
        """Out of device memory: cap batches at half the rows that failed, for a while."""
        self.rows = max(1, min(self.rows, failed_rows // 2))
        self._until_s = now_s + OOM_BACKOFF_S
        self._on_change(self.rows)
        logger.warning("device_out_of_memory", extra={"rows": failed_rows, "row_limit": self.rows})

    def restore(self, now_s: float) -> None:
        """Double the capped limit each ``OOM_BACKOFF_S`` without a new failure."""
        if self.rows < self.max_batch_size and now_s >= self._until_s:
            self.rows = min(self.max_batch_size, self.rows * 2)
            self._until_s = now_s + OOM_BACKOFF_S
            self._on_change(self.rows)


class StallWatch:
    """Marks the batcher stalled (once) when a batch outlives ``stall_timeout_s``.

    One timer watches every running batch, armed when none is: when it fires it looks at the
    oldest batch still running, and reports it or waits for its turn."""

    def __init__(
        self, clock: Clock, stall_timeout_s: float, on_stall: Callable[[], None] | None
    ) -> None:
        self._clock = clock
        self.stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self.stalled = False
        self._started_s: dict[int, float] = {}
        """When each batch running now started, by its number."""
        self._batches = 0
        self._timer: Timer | None = None

    def started(self, now_s: float) -> int:
        """A batch started at ``now_s``; pass what this returns to ``finished``."""
        self._batches += 1
        if self.stall_timeout_s > 0:
            self._started_s[self._batches] = now_s
            if self._timer is None:
                self._timer = self._clock.call_at(now_s + self.stall_timeout_s, self._check)
        return self._batches

    def began(self, batch: int, now_s: float) -> None:
        """The batch numbered ``batch``, or the next batch of its run, began on the device at
        ``now_s``: later than it was handed over when it waited there for another run. Called
        from the device thread (a key already in the dict is set, under the GIL)."""
        if batch in self._started_s:
            self._started_s[batch] = now_s

    def finished(self, batch: int) -> None:
        """The batch numbered ``batch`` came back (or failed)."""
        self._started_s.pop(batch, None)

    def close(self) -> None:
        """Stop watching (the collector has stopped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if not self._started_s or self.stalled:
            return
        due_s = min(self._started_s.values()) + self.stall_timeout_s
        if self._clock.now() >= due_s:
            self.report()
        else:  # the batch it was armed for came back: watch the oldest still running
            self._timer = self._clock.call_at(due_s, self._check)

    def report(self) -> None:
        """Mark the batcher stalled (once), and tell its owner, who replaces the process."""
        if self.stalled:
            return
        self.stalled = True
        logger.error("model_stalled", extra={"stall_timeout_s": self.stall_timeout_s})
        if self._on_stall is not None:
            self._on_stall()


def failure_for(rows: int, request_id: str, error: Exception) -> ServiceError:
    """What a request that fails alone is answered: its own ``ServiceError``, 507 when it
    does not fit in device memory even alone, otherwise 500 naming the error's type."""
    if isinstance(error, ServiceError):
        return error
    logger.error(
        "inference_failed",
        extra={"request_id": request_id, "error": f"{type(error).__name__}: {error}"},
    )
    failure: ServiceError
    if isinstance(error, DeviceOutOfMemoryError):
        failure = InsufficientDeviceMemoryError(
            f"out of device memory for this request's {rows} instance(s) even alone; "
            "retry later or with fewer instances"
        )
    else:
        failure = InferenceError(
            f"the model failed on this request's input ({type(error).__name__})"
        )
    failure.__cause__ = error
    return failure


@dataclass(frozen=True, slots=True)
class Ran(Generic[OutputT]):
    """One batch of a run, as the device thread ran it."""

    outputs: Sequence[OutputT | Exception] | Exception
    """One output per payload, or what the batch as a whole raised."""
    seconds: float
    """Its forward, timed on the device thread: several models share that thread, so the time
    a batch waited there for another model's is not its own."""
    start_ns: int
    end_ns: int
    timings: BatchTimings | None
    """The runner's timings of the batch it ran last, read just after this one."""
    started_s: float
    """When the device began it, by the batcher's clock: where its requests' queue wait ends."""


class BatchRun(Generic[PayloadT, OutputT]):
    """Runs batches of entries through ``run_batch`` on ``executor`` and answers them.

    The collector hands over a run: one batch, or several full ones that the device runs back
    to back in one hand-off (``collector.DynamicBatcher._run_of``), so that the device does not
    wait for a turn of the event loop between them, and the event loop does not share the
    interpreter with a forward between each. Each batch of a run is recorded, traced and
    answered as a batch of its own; a batch that fails ends the run, and the batches after it
    run afterwards each alone."""

    def __init__(
        self,
        run_batch: BatchFunction[PayloadT, OutputT],
        *,
        executor: Executor,
        metrics: ModelMetrics,
        clock: Clock,
        times: BatchTimes,
        row_limit: RowLimit,
        stall: StallWatch,
        tracer: BatchTracer | None,
        outbox: Outbox,
    ) -> None:
        self._run_batch = run_batch
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self._times = times
        self._row_limit = row_limit
        self._stall = stall
        self._tracer = tracer
        self._outbox = outbox
        self._ends_s: dict[int, float] = {}
        """When each run handed to the device should end, by its estimate, by its number."""
        self._runs = 0

    @property
    def running_until_s(self) -> float:
        """When the runs handed to the device should end, by their estimates (0: none)."""
        return max(self._ends_s.values(), default=0.0)

    async def run(self, batches: list[list[Entry]]) -> None:
        """Run ``batches`` in order in one hand-off and answer each of their entries; never
        raises but ``CancelledError``. Each entry's queue wait ends when the device begins
        the first batch holding it (for a run queued behind another, and for each batch
        after a run's first, later than the hand-off)."""
        entries = [entry for batch in batches for entry in batch]
        if not entries:
            return
        try:
            for batch in batches:
                self._metrics.batch_sources.observe(len({entry.source for entry in batch}))
            await self._isolating_failures(batches, self._clock.now(), first=True)
        except Exception:  # never let one batch stop the collector
            logger.exception("batch_failed_unexpectedly")
            with self._outbox:
                for entry in entries:
                    entry.reject(InferenceError("internal error while running the batch"))

    def _observe_queue_waits(self, entries: list[Entry], started_s: float) -> None:
        queue_wait = self._metrics.queue_wait
        for entry in entries:
            exemplar = None if entry.trace is None else tracing.exemplar_of(entry.trace)
            queue_wait.observe(started_s - entry.arrival_s, exemplar)

    async def _isolating_failures(
        self, batches: list[list[Entry]], now_s: float | None = None, *, first: bool
    ) -> None:
        """Run ``batches``; if one raises, retry each half of it so only the culprit fails.
        ``now_s``: the time the run started, if just read (not for a retry); ``first``: no
        batch holding these entries began before (their queue waits end as theirs begin)."""
        batches = [live for live in ([e for e in b if not e.done] for b in batches) if live]
        if not batches:
            return
        rows = [sum(entry.rows for entry in batch) for batch in batches]
        for count in rows:
            self._metrics.batch_size.observe(count)
        ran = await self._forward(batches, rows, now_s)
        for batch, count, result in zip(batches, rows, ran, strict=False):
            if result is None:  # every request in it was answered before it ran
                continue
            if first:
                self._observe_queue_waits(batch, result.started_s)
                if self._tracer is not None:
                    self._tracer.queue_waits(batch, result.start_ns)
            outputs = result.outputs
            if not isinstance(outputs, Exception) and len(outputs) != len(batch):
                outputs = RuntimeError(
                    f"run_batch returned {len(outputs)} outputs for {len(batch)}"
                )
            self._metrics.inference_latency.observe(result.seconds)
            if self._tracer is not None:
                error = outputs if isinstance(outputs, Exception) else None
                self._tracer.ran(
                    batch, count, result.start_ns, result.end_ns, result.timings, error
                )
            if isinstance(outputs, Exception):
                await self._failed(batch, count, outputs)
                continue
            self._times.record(batch[0].group, count, result.seconds)
            with self._outbox:  # each front end's answers of this batch in one delivery
                for entry, output in zip(batch, outputs, strict=True):
                    if isinstance(output, Exception):  # a row the model failed on alone
                        entry.reject(output)
                    else:
                        entry.resolve(output)
        for batch in batches[len(ran) :]:  # not run: a batch before it failed
            await self._isolating_failures([batch], first=first)

    async def _failed(self, batch: list[Entry], rows: int, error: Exception) -> None:
        """``batch`` raised ``error``: its one request is answered with it, or each half of
        the batch runs again."""
        if isinstance(error, DeviceOutOfMemoryError):
            self._metrics.out_of_memory.inc()
            self._row_limit.shrink(rows, self._clock.now())
        if len(batch) == 1:
            entry = batch[0]
            with self._outbox:
                entry.reject(failure_for(entry.rows, entry.request_id, error))
            return
        self._metrics.batch_failures.inc()
        middle = len(batch) // 2
        await self._isolating_failures([batch[:middle]], first=False)
        await self._isolating_failures([batch[middle:]], first=False)

    async def _forward(
        self, batches: list[list[Entry]], rows: list[int], now_s: float | None
    ) -> list[Ran[OutputT] | None]:
        """The run in the executor, watched for a batch that never comes back: a result for
        each batch up to the first that failed (``_on_device``). The executor failing to run
        it at all counts as its first batch failing."""
        estimates_s = (
            self._times.estimate(b[0].group, n) for b, n in zip(batches, rows, strict=True)
        )
        if now_s is None:
            now_s = self._clock.now()
        self._runs += 1
        number = self._runs
        # A run handed over while another runs (``collector``) begins when that one ends.
        begins_s = max(now_s, self.running_until_s)
        self._ends_s[number] = begins_s + sum(seconds or 0.0 for seconds in estimates_s)
        payloads = [[entry.payload for entry in batch] for batch in batches]
        watched = self._stall.started(now_s)
        try:
            # Cancelled (the collector stopped) before the device took it: it never runs.
            running = self._executor.submit(self._on_device, batches, payloads, watched)
            return await asyncio.wrap_future(running)
        except Exception as error:
            now_ns = time.time_ns()
            return [Ran(error, 0.0, now_ns, now_ns, None, self._clock.now())]
        finally:
            del self._ends_s[number]
            self._stall.finished(watched)

    def _on_device(
        self, batches: list[list[Entry]], payloads: list[list[PayloadT]], watched: int
    ) -> list[Ran[OutputT] | None]:
        """Each batch through ``run_batch`` in turn, on the device thread, until one raises;
        None for a batch whose every request was answered meanwhile (cancelled, past its
        deadline, or failed in an earlier batch), which is not run. The stall watch's clock
        (``watched``) starts again at each batch."""
        ran: list[Ran[OutputT] | None] = []
        for batch, inputs in zip(batches, payloads, strict=True):
            if all(entry.done for entry in batch):
                ran.append(None)
                continue
            start_ns = time.time_ns()
            started_s = self._clock.now()
            self._stall.began(watched, started_s)
            outputs: Sequence[OutputT | Exception] | Exception
            try:
                outputs = self._run_batch(inputs)
            except Exception as error:
                outputs = error
            timings = self._tracer.timings() if self._tracer is not None else None
            seconds = self._clock.now() - started_s
            ran.append(Ran(outputs, seconds, start_ns, time.time_ns(), timings, started_s))
            if isinstance(outputs, Exception):
                break
        return ran
