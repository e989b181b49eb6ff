"""The batcher's spans without a model: each traced request's queue wait, one span per batch
linked to the requests it served, and the runner's phases, in the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service import tracing
from service.engine.batcher.spans import BatchTimings, BatchTracer, batch_tracer
from service.errors import InferenceError
from service.metrics import EngineMetrics
from tests.fixtures import (
    BatcherFactory,
    GatedModel,
    PoisonModel,
    RecordingDoubler,
    sample_total,
)

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SAMPLED_TOO = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.start([SimpleSpanProcessor(exporter)], role="engine")
    try:
        yield exporter
    finally:
        tracing.stop()


@pytest.fixture
async def make_batcher() -> AsyncIterator[BatcherFactory]:
    factory = BatcherFactory()
    yield factory
    await factory.aclose()


def tracer(timings: BatchTimings | None = None) -> BatchTracer:
    return BatchTracer("m", "v1", "cpu", "fp32", lambda: timings)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def trace_id(traceparent: str) -> int:
    return int(traceparent[3:35], 16)


async def test_a_batch_span_links_each_sampled_request_with_its_rows(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=8, tracer=tracer())
    blocker = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    before_ns = time.time_ns()
    traced = batcher.enqueue([1, 2], group="g", trace=SAMPLED)
    also = batcher.enqueue([3], group="g", trace=SAMPLED_TOO)
    unsampled = batcher.enqueue([4], group="g", trace=UNSAMPLED)
    untraced = batcher.enqueue([5], group="g")
    queued_ns = time.time_ns()
    await asyncio.sleep(0)
    released_ns = time.time_ns()
    model.release()
    async with asyncio.timeout(5):
        await blocker
        for ticket in (traced, also, unsampled, untraced):
            await ticket.wait()

    [batch] = named(exported, "batch")  # the blocker's batch had no sampled request
    assert batch.attributes is not None
    assert dict(batch.attributes) == {
        "batchserve.model": "m",
        "batchserve.model.version": "v1",
        "batchserve.device": "cpu",
        "batchserve.precision": "fp32",
        "batchserve.batch.rows": 5,
        "batchserve.batch.requests": 4,
    }
    assert batch.parent is None  # a root of its own, not in any request's trace
    links = {
        (link.context.trace_id, dict(link.attributes or {})["batchserve.rows"])
        for link in batch.links
    }
    assert links == {(trace_id(SAMPLED), 2), (trace_id(SAMPLED_TOO), 1)}
    assert batch.context is not None
    context = batch.context
    batch_traceparent = (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )
    assert traced.traced_batches() == ((batch_traceparent, 2),)
    assert also.traced_batches() == ((batch_traceparent, 1),)
    assert unsampled.traced_batches() == untraced.traced_batches() == ()

    waits = named(exported, "queue_wait")
    assert {span.context.trace_id for span in waits if span.context} == {
        trace_id(SAMPLED),
        trace_id(SAMPLED_TOO),
    }
    for span in waits:  # from each request's arrival to its batch's start
        assert span.parent is not None
        assert span.start_time is not None
        assert span.end_time is not None
        assert before_ns - 10**6 <= span.start_time <= queued_ns + 10**6
        assert released_ns - 10**6 <= span.end_time <= batch.start_time  # type: ignore[operator]
    rows = {
        span.context.trace_id: dict(span.attributes or {})["batchserve.rows"]
        for span in waits
        if span.context
    }
    assert rows == {trace_id(SAMPLED): 2, trace_id(SAMPLED_TOO): 1}


async def test_no_span_for_a_batch_without_a_sampled_request_or_with_tracing_off(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    batcher = make_batcher(RecordingDoubler(), tracer=tracer())
    async with asyncio.timeout(5):
        await batcher.enqueue([1], group="g", trace=UNSAMPLED).wait()
        await batcher.enqueue([2], group="g").wait()
    assert exported.get_finished_spans() == ()
    tracing.stop()
    async with asyncio.timeout(5):
        ticket = batcher.enqueue([3], group="g", trace=SAMPLED)
        assert await ticket.wait() == [[6]]
    assert ticket.traced_batches() == ()


async def test_the_runners_phases_are_children_of_the_batch_span(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    later_ns = time.time_ns() + 10**9  # the runner's timings of this batch: after it began
    timings = BatchTimings(later_ns, later_ns + 10, later_ns + 30, later_ns + 60, 8, 96)
    batcher = make_batcher(RecordingDoubler(), tracer=tracer(timings))
    async with asyncio.timeout(5):
        await batcher.enqueue([1], group="g", trace=SAMPLED).wait()
    [batch] = named(exported, "batch")
    assert batch.attributes is not None
    assert batch.attributes["batchserve.batch.padded_rows"] == 8
    assert batch.attributes["batchserve.batch.padded_tokens"] == 96
    phases = {
        span.name: (span.start_time, span.end_time)
        for span in exported.get_finished_spans()
        if span.parent is not None
        and batch.context
        and span.parent.span_id == batch.context.span_id
    }
    assert phases == {
        "collate": (later_ns, later_ns + 10),
        "forward": (later_ns + 10, later_ns + 30),
        "split": (later_ns + 30, later_ns + 60),
    }


async def test_timings_of_an_earlier_batch_are_not_recorded_as_this_ones(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    earlier_ns = time.time_ns() - 10**9
    stale = BatchTimings(earlier_ns, earlier_ns + 1, earlier_ns + 2, earlier_ns + 3, 8, 96)
    batcher = make_batcher(RecordingDoubler(), tracer=tracer(stale))
    async with asyncio.timeout(5):
        await batcher.enqueue([1], group="g", trace=SAMPLED).wait()
    [batch] = named(exported, "batch")
    assert batch.attributes is not None
    assert "batchserve.batch.padded_rows" not in batch.attributes
    assert [span.name for span in exported.get_finished_spans()] == ["queue_wait", "batch"]


async def test_a_request_split_over_batches_records_each_batch_and_its_rows(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    batcher = make_batcher(RecordingDoubler(), max_batch_size=2, tracer=tracer())
    async with asyncio.timeout(5):
        ticket = batcher.enqueue([1, 2, 3], group="g", trace=SAMPLED)
        assert await ticket.wait() == [[2, 4], [6]]
    batches = named(exported, "batch")
    assert len(batches) == 2
    assert [rows for _, rows in ticket.traced_batches()] == [2, 1]
    assert {traceparent for traceparent, _ in ticket.traced_batches()} == {
        f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"
        f"{span.context.trace_flags:02x}"
        for span in batches
        if span.context is not None
    }


async def test_a_traced_requests_queue_wait_is_observed_with_its_exemplar(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    metrics = EngineMetrics()
    batcher = make_batcher(RecordingDoubler(), metrics=metrics, tracer=tracer())
    async with asyncio.timeout(5):
        await batcher.enqueue([1], group="g", trace=SAMPLED).wait()
        await batcher.enqueue([2], group="g").wait()
    count = sample_total(metrics.registry, "batchserve_queue_wait_seconds_count")
    assert count == 2


async def test_a_batch_span_records_the_forwards_exception(
    exported: InMemorySpanExporter, make_batcher: BatcherFactory
) -> None:
    batcher = make_batcher(PoisonModel(poison=1), tracer=tracer())
    async with asyncio.timeout(5):
        with pytest.raises(InferenceError):
            await batcher.enqueue([1], group="g", trace=SAMPLED).wait()
    [batch] = named(exported, "batch")
    assert [event.name for event in batch.events] == ["exception"]


def test_a_versions_tracer_names_its_model_version_device_and_precision() -> None:
    manifest = SimpleNamespace(name="digits", version="abc123")
    runner = SimpleNamespace(device="cuda:0", precision="bf16", last_batch=None)
    made = batch_tracer(manifest, runner)  # type: ignore[arg-type]
    assert (made.model, made.version, made.device, made.precision) == (
        "digits",
        "abc123",
        "cuda:0",
        "bf16",
    )
    assert made.timings() is None
