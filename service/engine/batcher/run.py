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
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from typing import Generic, Protocol, Self, TypeVar

from service import tracing
from service.engine.batcher.clock import Clock, Timer
from service.engine.batcher.estimates import BatchTimes
from service.engine.batcher.queue import Entry, Outbox
from service.engine.batcher.spans import BatchTracer
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
            self._report()
        else:  # the batch it was armed for came back: watch the oldest still running
            self._timer = self._clock.call_at(due_s, self._check)

    def _report(self) -> None:
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


class BatchRun(Generic[PayloadT, OutputT]):
    """Runs batches of entries through ``run_batch`` on ``executor`` and answers them."""

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
        self.running_until_s = 0.0
        """When the batch running now should end, by its estimate (0: none running)."""

    async def run(self, batch: list[Entry]) -> None:
        """Run ``batch`` and answer each of its entries; never raises but ``CancelledError``."""
        if not batch:
            return
        try:
            started_s = self._clock.now()
            self._observe_queue_waits(batch, started_s)
            if self._tracer is not None:
                self._tracer.queue_waits(batch, started_s)
            self._metrics.batch_sources.observe(len({entry.source for entry in batch}))
            await self._isolating_failures(batch, started_s)
        except Exception:  # never let one batch stop the collector
            logger.exception("batch_failed_unexpectedly")
            with self._outbox:
                for entry in batch:
                    entry.reject(InferenceError("internal error while running the batch"))

    def _observe_queue_waits(self, batch: list[Entry], started_s: float) -> None:
        queue_wait = self._metrics.queue_wait
        for entry in batch:
            exemplar = None if entry.trace is None else tracing.exemplar_of(entry.trace)
            queue_wait.observe(started_s - entry.arrival_s, exemplar)

    async def _isolating_failures(self, batch: list[Entry], now_s: float | None = None) -> None:
        """Run ``batch``; if the forward raises, retry each half so only the culprit fails.
        ``now_s``: the time the batch started, if just read (not for a retried half)."""
        batch = [entry for entry in batch if not entry.done]
        if not batch:
            return
        rows = sum(entry.rows for entry in batch)
        self._metrics.batch_size.observe(rows)
        traced = self._tracer.batch(batch, rows) if self._tracer else contextlib.nullcontext()
        started_s = time.perf_counter()
        try:
            with traced:
                outputs = await self._forward(
                    [entry.payload for entry in batch], rows, batch[0].group, now_s
                )
            if len(outputs) != len(batch):
                raise RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(batch)}")
        except Exception as error:
            self._metrics.inference_latency.observe(time.perf_counter() - started_s)
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
            await self._isolating_failures(batch[:middle])
            await self._isolating_failures(batch[middle:])
            return
        self._metrics.inference_latency.observe(time.perf_counter() - started_s)
        with self._outbox:  # each front end's answers of this batch in one delivery
            for entry, output in zip(batch, outputs, strict=True):
                if isinstance(output, Exception):  # a row the model failed on alone
                    entry.reject(output)
                else:
                    entry.resolve(output)

    async def _forward(
        self, payloads: list[PayloadT], rows: int, group: Hashable, now_s: float | None
    ) -> Sequence[OutputT | Exception]:
        """``run_batch`` in the executor, watched for a batch that never comes back."""
        estimate_s = self._times.estimate(group, rows)
        if now_s is None:
            now_s = self._clock.now()
        self.running_until_s = now_s + (estimate_s or 0.0)
        # Cancelled (the collector stopped) before the device took it: it never runs.
        running = asyncio.wrap_future(self._executor.submit(self._timed_run_batch, payloads))
        watched = self._stall.started(now_s)
        try:
            outputs, seconds = await running
        finally:
            self.running_until_s = 0.0
            self._stall.finished(watched)
        self._times.record(group, rows, seconds)
        return outputs

    def _timed_run_batch(
        self, payloads: list[PayloadT]
    ) -> tuple[Sequence[OutputT | Exception], float]:
        """``run_batch`` and its duration, timed on the device thread: several models share
        that thread, so the time a batch waited there for another model's is not its own."""
        started_s = self._clock.now()
        outputs = self._run_batch(payloads)
        return outputs, self._clock.now() - started_s
