"""The engine's metrics stay exact when written a batch at a time: the queue wait of every
request of a batch ends when the device begins the batch, and reads afterwards find every
request in the bucket it falls in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from service.metrics import LATENCY_BUCKETS_S, EngineMetrics
from tests.fixtures import (
    BatcherFactory,
    ManualExecutor,
    RecordingDoubler,
    SteppedClock,
    sample,
    wait_until,
)


def buckets(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """The ``le`` bucket samples of the histogram ``name`` (cumulative, as exposed)."""
    return {
        found.labels["le"]: found.value
        for metric in registry.collect()
        for found in metric.samples
        if found.name == f"{name}_bucket"
    }


def reference(values: list[float]) -> CollectorRegistry:
    """A histogram with the latency buckets, each value observed alone."""
    registry = CollectorRegistry()
    histogram = Histogram("h", "reference", buckets=LATENCY_BUCKETS_S, registry=registry)
    for value in values:
        histogram.observe(value)
    return registry


@pytest.fixture
async def make_batcher() -> AsyncIterator[tuple[BatcherFactory, SteppedClock]]:
    clock = SteppedClock()
    factory = BatcherFactory(clock)
    yield factory, clock
    await factory.aclose()


async def test_queue_waits_end_when_the_device_begins_each_batch_and_read_exact(
    make_batcher: tuple[BatcherFactory, SteppedClock],
) -> None:
    factory, clock = make_batcher
    clock.freeze()
    metrics = EngineMetrics()
    device = ManualExecutor()  # it begins a batch when the test finishes it
    batcher = factory(RecordingDoubler(), metrics=metrics, executor=device, max_batch_size=4)
    first = asyncio.create_task(batcher.submit([0], group="g"))
    await wait_until(lambda: device.pending == 1)  # a lone request is handed over at once
    early = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    await wait_until(lambda: batcher.queue_depth == 2)
    clock.advance(0.004)
    late = [asyncio.create_task(batcher.submit([row], group="g")) for row in (3, 4)]
    await wait_until(lambda: batcher.queue_depth == 4)
    clock.advance(0.004)
    device.finish_next()  # the device begins the lone request 8 ms after it came
    await wait_until(lambda: device.pending == 1)  # the four queued, as one full batch
    clock.advance(0.002)  # begun 2 ms after they were handed over
    device.finish_next()
    await asyncio.gather(first, *early, *late)

    waits_s = [0.008, 0.010, 0.010, 0.006, 0.006]
    name = "batchserve_queue_wait_seconds"
    assert sample(metrics, f"{name}_count") == len(waits_s)
    assert sample(metrics, f"{name}_sum") == pytest.approx(sum(waits_s))
    assert buckets(metrics.registry, name) == buckets(reference(waits_s), "h")
    assert sample(metrics, "batchserve_batch_size_rows_count") == 2
    assert sample(metrics, "batchserve_batch_size_rows_sum") == 5
