"""The front end's request tally: counted in memory, written to the metrics a batch at a time."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from service.frontend.request_metrics import RequestTally
from service.metrics import FrontendMetrics
from tests.fixtures import sample_total

LATENCIES_S = [0.0001, 0.0005, 0.0007, 0.002, 0.002, 0.04, 0.5, 31.0]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_requests_are_written_when_the_front_end_goes_idle_and_on_flush() -> None:
    registry = CollectorRegistry()
    tally = RequestTally(FrontendMetrics(registry), flush_every_s=3600)
    tally.started()
    assert sample_total(registry, "batchserve_in_flight_requests") == 1  # shown at once
    tally.started()
    tally.stopped()
    tally.answered("/predict", "200", 0.002)
    tally.answered("/healthz", "200", 0.001)
    assert sample_total(registry, "batchserve_requests_total") == 0  # one still in flight
    tally.flush()  # as /metrics does
    assert sample_total(registry, "batchserve_requests_total") == 2
    tally.stopped()
    tally.answered("/predict", "504", 2.0)
    assert sample_total(registry, "batchserve_requests_total") == 3
    assert sample_total(registry, "batchserve_in_flight_requests") == 0
    assert sample_total(registry, "batchserve_request_duration_seconds_count") == 3
    assert sample_total(registry, "batchserve_request_duration_seconds_sum") == pytest.approx(2.003)


def test_under_load_the_tally_is_written_at_most_flush_every_s_apart() -> None:
    registry = CollectorRegistry()
    tally = RequestTally(FrontendMetrics(registry), flush_every_s=0.0)
    tally.started()
    tally.started()
    tally.stopped()
    tally.answered("/predict", "200", 0.002)
    assert sample_total(registry, "batchserve_requests_total") == 1
    assert sample_total(registry, "batchserve_in_flight_requests") == 1


async def test_on_an_event_loop_going_idle_is_written_once_at_the_end_of_the_turn() -> None:
    """Requests that start and end in one step (answered without waiting) are written once
    for the turn, not twice each; what a scrape then reads is exact."""
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    writes: list[int] = []
    tally = RequestTally(metrics, flush_every_s=3600)
    flush = tally.flush

    def counted_flush() -> None:
        writes.append(1)
        flush()

    tally.flush = counted_flush  # type: ignore[method-assign]
    for _ in range(3):
        tally.started()
        tally.stopped()
        tally.answered("/predict", "200", 0.002)
    assert sample_total(registry, "batchserve_requests_total") == 0  # not yet: same turn
    await asyncio.sleep(0)
    assert len(writes) == 1
    assert sample_total(registry, "batchserve_requests_total") == 3
    assert sample_total(registry, "batchserve_in_flight_requests") == 0
    tally.started()
    await asyncio.sleep(0)
    assert sample_total(registry, "batchserve_in_flight_requests") == 1  # shown a turn later
