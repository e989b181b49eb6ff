"""Spans of the engine: each traced request's queue wait, and one span per batch.

A batch span belongs to no request's trace: it is a root of its own, with a span link to every
request it served (the link carries that request's rows), and child spans for collation, the
forward pass and splitting, timed by the runner. Each request learns the batch's trace context
and its rows in the batch (``InferenceResult.batches``), so its front end can record them on
the request span. Nothing is recorded for a batch in which no request was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from service import tracing
from service.manifest import Manifest


@dataclass(frozen=True, slots=True)
class BatchTimings:
    """When the runner's phases of one batch began and ended (``time.time_ns()``)."""

    collate_ns: int
    forward_ns: int
    split_ns: int
    end_ns: int
    padded_rows: int
    padded_tokens: int
    """Rows times the padded length of the variable axis (0 for fixed shapes)."""


class TracedWork(Protocol):
    """A queued piece of a request (``queue.Entry``)."""

    rows: int
    arrival_s: float
    trace: str | None
    batches: tuple[tuple[str, int], ...]


class TimedRunner(Protocol):
    """What a batch span reads of the runner (``runner.TorchRunner``)."""

    @property
    def device(self) -> object: ...

    @property
    def precision(self) -> str: ...

    @property
    def last_batch(self) -> BatchTimings | None: ...


def batch_tracer(manifest: Manifest, runner: TimedRunner) -> BatchTracer:
    """The tracer of the batches ``runner`` runs for ``manifest``'s version."""
    return BatchTracer(
        manifest.name,
        manifest.version,
        str(runner.device),
        runner.precision,
        lambda: runner.last_batch,
    )


@dataclass(frozen=True)
class BatchTracer:
    """Traces the batches of one served version."""

    model: str
    version: str
    device: str
    precision: str
    timings: Callable[[], BatchTimings | None]
    """The runner's timings of the batch it ran last."""

    def queue_waits(self, batch: Sequence[TracedWork], started_ns: int) -> None:
        """A ``queue_wait`` span, from arrival to ``started_ns`` (the wall-clock start of the
        batch's own span), for each sampled request in ``batch``."""
        if tracing.current is None:
            return
        tracer = tracing.current.engine_tracer
        wall_ns = time.time_ns() - time.monotonic_ns()  # a monotonic time's wall-clock time
        for work in batch:
            if work.trace is None or not tracing.is_sampled(work.trace):
                continue
            arrival_ns = wall_ns + int(work.arrival_s * 1e9)
            span = tracer.start_span(
                "queue_wait",
                context=tracing.parent_from(work.trace),
                start_time=arrival_ns,
                attributes={"batchserve.rows": work.rows},
            )
            span.end(end_time=started_ns)

    def ran(
        self,
        batch: Sequence[TracedWork],
        rows: int,
        start_ns: int,
        end_ns: int,
        timings: BatchTimings | None,
        error: Exception | None,
    ) -> None:
        """The span of one forward of ``batch``, from ``start_ns`` to ``end_ns`` as the device
        thread timed it, linked to each sampled request in it, with the runner's ``timings``
        of it and the ``error`` it raised; nothing when none is sampled."""
        if tracing.current is None:
            return
        sampled = [work for work in batch if work.trace and tracing.is_sampled(work.trace)]
        if not sampled:
            return
        links = [
            trace.Link(tracing.span_context_from(work.trace or ""), {"batchserve.rows": work.rows})
            for work in sampled
        ]
        span = tracing.current.engine_tracer.start_span(
            "batch",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            links=links,
            start_time=start_ns,
            attributes={
                "batchserve.model": self.model,
                "batchserve.model.version": self.version,
                "batchserve.device": self.device,
                "batchserve.precision": self.precision,
                "batchserve.batch.rows": rows,
                "batchserve.batch.requests": len(batch),
            },
        )
        traceparent = tracing.traceparent_of(span) or ""
        for work in sampled:
            work.batches += ((traceparent, work.rows),)
        if error is not None:
            span.record_exception(error)
            span.set_status(
                trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")
            )
        elif timings is not None:
            self._record_phases(span, timings, start_ns)
        span.end(end_time=end_ns)

    def _record_phases(self, span: trace.Span, timings: BatchTimings, start_ns: int) -> None:
        """Child spans for the runner's phases, when the batch it ran last is this one."""
        if tracing.current is None or timings.collate_ns < start_ns:
            return
        span.set_attribute("batchserve.batch.padded_rows", timings.padded_rows)
        span.set_attribute("batchserve.batch.padded_tokens", timings.padded_tokens)
        context = trace.set_span_in_context(span)
        phases = (
            ("collate", timings.collate_ns, timings.forward_ns),
            ("forward", timings.forward_ns, timings.split_ns),
            ("split", timings.split_ns, timings.end_ns),
        )
        for name, begin_ns, end_ns in phases:
            child = tracing.current.engine_tracer.start_span(
                name, context=context, start_time=begin_ns
            )
            child.end(end_time=end_ns)
