"""Running one batch: the forward on the device thread, timed and watched, failures isolated
by halving, and the answers handed out once per batch per front end.

``run_batch`` runs in the executor (never on the event loop, however quick: a model that
hangs must not stop the event loop). If it raises, each half of the batch is retried, so only
the request that causes the error fails; an out-of-memory error also caps the row limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Generic, Protocol, Self, TypeVar

from service import tracing
from service.engine.batch_clock import Clock
from service.engine.batch_guards import RowLimit, StallWatch, failure_for
from service.engine.batch_queue import Entry
from service.engine.batch_spans import BatchTracer
from service.engine.batch_ticket import Sink, Ticket, settle_batch
from service.engine.estimates import BatchTimes
from service.errors import DeviceOutOfMemoryError
from service.metrics import ModelMetrics, observe_many

logger = logging.getLogger("service.engine.batching")

#: Read in C by ``map``, once a request: a generator's step cost more than the read.
_rows = operator.attrgetter("rows")
_source = operator.attrgetter("source")
_trace = operator.attrgetter("trace")
_arrival_s = operator.attrgetter("arrival_s")


class Rows(Protocol):
    """A payload of one or more rows that can be sliced along its first axis (e.g. an array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> Self: ...


PayloadT = TypeVar("PayloadT", bound=Rows)
OutputT = TypeVar("OutputT")
T = TypeVar("T")

#: Runs one batch in the executor thread: one output per payload, in order; raises if the
#: whole batch fails, or gives an exception as the output of a payload that fails alone.
BatchFunction = Callable[[list[PayloadT]], Sequence[OutputT | Exception]]


class Deliveries:
    """Hands finished tickets to their sinks: those a batch finishes, once per sink after the
    batch; any other (a deadline, a cancel) at once."""

    def __init__(self) -> None:
        self._gathering: dict[Sink, list[Ticket[Any]]] | None = None

    def finished(self, ticket: Ticket[Any]) -> None:
        sink = ticket.sink
        if sink is None:
            return
        if self._gathering is None:
            _deliver(sink, [ticket])
        else:
            self._gathering.setdefault(sink, []).append(ticket)

    def answer(self, batch: list[Entry], outputs: Sequence[object]) -> None:
        """Answer a batch's entries with its outputs (``settle_batch``), then hand each sink
        its finished tickets at once. ``per_batch`` spelt out: once a batch, a generator-based
        context manager cost more calls than the settling of a one-request batch."""
        outer, gathering = self._gather()
        try:
            settle_batch(batch, outputs, gathering)
        finally:
            self._hand_out(outer)

    @contextlib.contextmanager
    def per_batch(self) -> Iterator[None]:
        outer, _ = self._gather()
        try:
            yield
        finally:
            self._hand_out(outer)

    def _gather(self) -> tuple[dict[Sink, list[Ticket[Any]]] | None, dict[Sink, list[Ticket[Any]]]]:
        """Start gathering the tickets a batch finishes; returns what gathered before (to
        restore) and the new gathering."""
        outer, self._gathering = self._gathering, {}
        return outer, self._gathering

    def _hand_out(self, outer: dict[Sink, list[Ticket[Any]]] | None) -> None:
        """Hand each sink the tickets gathered since ``_gather``, and restore ``outer``."""
        gathered, self._gathering = self._gathering, outer
        for sink, tickets in (gathered or {}).items():
            _deliver(sink, tickets)


def _answered_on_loop(running: Future[T]) -> asyncio.Future[T]:
    """A future of the running loop settled as ``running`` (on the device thread) is: what
    ``loop.run_in_executor`` returns, without its type checks of both futures and its
    callback each way (18 calls a batch fewer: at c=1, a request). Cancelling it does not
    cancel ``running``: the caller does. An exception is passed on as it was raised."""
    loop = asyncio.get_running_loop()
    answered = loop.create_future()
    running.add_done_callback(functools.partial(_settle_soon, loop, answered))
    return answered


def _settle_soon(loop: asyncio.AbstractEventLoop, answered: asyncio.Future[T],
                 running: Future[T]) -> None:  # fmt: skip
    if not loop.is_closed():  # as asyncio's own chaining: nobody is left to tell
        loop.call_soon_threadsafe(_settle, running, answered)


def _settle(running: Future[T], answered: asyncio.Future[T]) -> None:
    if answered.cancelled():
        return
    if running.cancelled():
        answered.cancel()
        return
    error = running.exception()
    if error is None:
        answered.set_result(running.result())
    else:
        answered.set_exception(error)


def _deliver(sink: Sink, tickets: list[Ticket[Any]]) -> None:
    try:
        sink.deliver(tickets)
    except Exception:  # a front end's bad luck must not stop the collector
        logger.exception("delivery_failed")


class BatchRun(Generic[PayloadT, OutputT]):
    """Runs batches of entries through ``run_batch`` on ``executor``."""

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
        deliveries: Deliveries,
    ) -> None:
        self._run_batch = run_batch
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self.times = times
        self._row_limit = row_limit
        self._stall = stall
        self._tracer = tracer
        self._deliveries = deliveries
        self.running_until_s = 0.0
        """When the batch running now should end, by its estimate (0: none running)."""

    async def run(self, batch: list[Entry]) -> None:
        if not batch:
            return
        started_s = self._clock.now()
        queue_wait = self._metrics.queue_wait
        if any(map(_trace, batch)):
            waits_s = []
            for entry in batch:
                if entry.trace is None:
                    waits_s.append(started_s - entry.arrival_s)
                else:  # its exemplar belongs to its own observation
                    exemplar = tracing.exemplar_of(entry.trace)
                    queue_wait.observe(started_s - entry.arrival_s, exemplar)
        else:  # none traced (the common case): no step a request but the subtraction
            waits_s = [started_s - arrival_s for arrival_s in map(_arrival_s, batch)]
        observe_many(queue_wait, waits_s)  # a write per bucket touched, not two per request
        if self._tracer is not None:
            self._tracer.queue_waits(batch, started_s)
        self._metrics.batch_sources.observe(len(set(map(_source, batch))))
        await self._isolating_failures(batch, started_s)

    async def _isolating_failures(self, batch: list[Entry], now_s: float | None = None) -> None:
        """Run ``batch``; if the forward raises, retry each half so only the culprit fails.
        ``now_s``: the time the batch started, if just read (not for a retried half)."""
        batch = [entry for entry in batch if not entry.done]
        if not batch:
            return
        rows = sum(map(_rows, batch))
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
                with self._deliveries.per_batch():
                    entry.reject(failure_for(entry.rows, entry.request_id, error))
                return
            self._metrics.batch_failures.inc()
            middle = len(batch) // 2
            await self._isolating_failures(batch[:middle])
            await self._isolating_failures(batch[middle:])
            return
        self._metrics.inference_latency.observe(time.perf_counter() - started_s)
        self._deliveries.answer(batch, outputs)

    async def _forward(
        self, payloads: list[PayloadT], rows: int, group: Hashable, now_s: float | None
    ) -> Sequence[OutputT | Exception]:
        """``run_batch`` in the executor, watched for a batch that never comes back."""
        estimate_s = self.times.estimate(group, rows)
        if now_s is None:
            now_s = self._clock.now()
        self.running_until_s = now_s + (estimate_s or 0.0)
        running = self._executor.submit(self._timed_run_batch, payloads)
        answered = _answered_on_loop(running)
        watched = self._stall.started(now_s)
        try:
            outputs, seconds = await answered
        except asyncio.CancelledError:
            running.cancel()  # not started yet (another model's batch ahead): never run it
            raise
        finally:
            self.running_until_s = 0.0
            self._stall.finished(watched)
        self.times.record(group, rows, seconds)
        return outputs

    def _timed_run_batch(
        self, payloads: list[PayloadT]
    ) -> tuple[Sequence[OutputT | Exception], float]:
        """``run_batch`` and its duration, timed on the device thread: several models share
        that thread, so the time a batch waited there for another model's is not its own."""
        started_s = self._clock.now()
        outputs = self._run_batch(payloads)
        return outputs, self._clock.now() - started_s
