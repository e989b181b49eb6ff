"""Every Prometheus metric of the service, defined once, in a registry owned by one app.

Under gunicorn the launcher sets ``PROMETHEUS_MULTIPROC_DIR``; then each worker writes its
values to files there and ``render_metrics`` aggregates all workers. Each gauge declares how
it is aggregated across workers (``multiprocess_mode``).
"""

from __future__ import annotations

import os
import resource
import sys
from enum import StrEnum

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

#: Request latencies on this kind of server run from about 0.5 ms to seconds.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.04,
    0.06, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class DropReason(StrEnum):
    """Label values of ``batchserve_dropped_requests_total``."""

    QUEUE_FULL = "queue_full"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    DRAINING = "draining"


class ServiceMetrics:
    """The metric objects of one service instance; pass a fresh registry per app in tests."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # The *_created series double the exposition size and no dashboard uses them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "batchserve_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "batchserve_request_duration_seconds",
            "Time from receiving a request to sending its answer, by route and status code.",
            ["route", "status"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "batchserve_in_flight_requests",
            "Prediction requests received and not yet answered (queued or running).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_depth = Gauge(
            "batchserve_queue_depth",
            "Requests waiting in the batcher's queue.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "batchserve_queue_wait_seconds",
            "Time a request waited in the queue before its batch started.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "batchserve_batch_size_rows",
            "Rows (instances) per forward pass.",
            buckets=BATCH_SIZE_BUCKETS_ROWS,
            registry=r,
        )
        self.inference_latency = Histogram(
            "batchserve_inference_duration_seconds",
            "Time of one batched forward pass, collation and splitting included.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.dropped = Counter(
            "batchserve_dropped_requests",
            "Requests not computed (a split request counts once per chunk): queue full, "
            "deadline expired, client gone, or draining.",
            ["reason"],
            registry=r,
        )
        self.batch_failures = Counter(
            "batchserve_batch_failures",
            "Batched forward passes that raised and were retried by halves.",
            registry=r,
        )
        self.out_of_memory = Counter(
            "batchserve_out_of_memory",
            "Batches that ran out of device memory (then split and retried by halves).",
            registry=r,
        )
        self.effective_max_batch_size = Gauge(
            "batchserve_effective_max_batch_size",
            "Rows per batch allowed now: max_batch_size, or less for a while after running out "
            "of device memory.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.model_info = Gauge(
            "batchserve_model_info",
            "The model being served (value 1), with its version, device, precision and compile.",
            ["model", "version", "device", "precision", "compiled"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "batchserve_ready",
            "1 when the model is loaded and warmed up and the server is not draining.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.resident_memory = Gauge(
            "batchserve_process_resident_memory_bytes",
            "Resident memory of the serving process(es).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.device_memory_allocated = Gauge(
            "batchserve_device_memory_allocated_bytes",
            "CUDA memory held by tensors (torch.cuda.memory_allocated); 0 on CPU.",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.device_memory_reserved = Gauge(
            "batchserve_device_memory_reserved_bytes",
            "CUDA memory reserved by the caching allocator (torch.cuda.memory_reserved); 0 on CPU.",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def render(self) -> bytes:
        """Prometheus text exposition of this process, or of all workers in multiprocess mode."""
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            aggregate = CollectorRegistry()
            multiprocess.MultiProcessCollector(aggregate)  # type: ignore[no-untyped-call]
            return generate_latest(aggregate)
        return generate_latest(self.registry)


def resident_memory_bytes() -> int:
    """Current resident set size of this process (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
