"""The front end's request tally: counted in memory, written to the metrics a batch at a time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from service.frontend.request_metrics import RequestTally
from service.metrics import LATENCY_BUCKETS_S, FrontendMetrics, observe_many
from tests.fixtures import sample_total

LATENCIES_S = [0.0001, 0.0005, 0.0007, 0.002, 0.002, 0.04, 0.5, 31.0]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_observing_all_at_once_equals_observing_each() -> None:
    one_by_one, all_at_once = CollectorRegistry(), CollectorRegistry()
    each = Histogram("latency", "", ["route"], buckets=LATENCY_BUCKETS_S, registry=one_by_one)
    together = Histogram("latency", "", ["route"], buckets=LATENCY_BUCKETS_S, registry=all_at_once)
    for value in LATENCIES_S:
        each.labels("/predict").observe(value)
    observe_many(together.labels("/predict"), LATENCIES_S)
    assert samples(all_at_once) == samples(one_by_one)


def test_requests_are_written_when_the_front_end_goes_idle_and_on_flush() -> None:
    registry = CollectorRegistry()
    tally = RequestTally(FrontendMetrics(registry), flush_every_s=3600)
    tally.started()
    assert sample_total(registry, "batchserve_in_flight_requests") == 1  # shown at once
    tally.started()
    tally.answered("/predict", "200", 0.002)
    tally.answered("/healthz", "200", 0.001, in_flight=False)
    assert sample_total(registry, "batchserve_requests_total") == 0  # one still in flight
    tally.flush()  # as /metrics does
    assert sample_total(registry, "batchserve_requests_total") == 2
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
    tally.answered("/predict", "200", 0.002)
    assert sample_total(registry, "batchserve_requests_total") == 1
    assert sample_total(registry, "batchserve_in_flight_requests") == 1
