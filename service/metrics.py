"""Every Prometheus metric of the service, defined once, in registries owned by the caller.

Front ends count requests (``FrontendMetrics``); engines count what happens to the queue and
the batches (``EngineMetrics``); one process serving alone registers both in one registry.
With several processes the server sets ``PROMETHEUS_MULTIPROC_DIR``: each process writes its
values to files there and ``render`` adds up all of them, so request counts sum over front
ends and batch histograms come from the engines once. Each gauge declares how it is
aggregated across processes (``multiprocess_mode``).
"""

from __future__ import annotations

import os
import resource
import sys
from enum import StrEnum
from typing import Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import choose_encoder

from service.metric_files import CollectorOfStartedFiles

#: Request latencies on this kind of server run from about 0.5 ms to seconds.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.04,
    0.06, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
FRONTEND_COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
#: Shares of a batch's positions that are padding: none, then steps of a tenth.
PADDING_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: A 504 should leave at its deadline; how late it leaves shows event-loop or engine delays.
OVERRUN_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: An event loop wakes within a millisecond when idle; a stall of 50 ms delays every request.
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: A standby takes over in a heartbeat or two (0.25 s each); a restart takes seconds.
TAKEOVER_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

ProcessRole = Literal["frontend", "engine", "server"]


class DropReason(StrEnum):
    """Label values of ``batchserve_dropped_requests_total``."""

    QUEUE_FULL = "queue_full"
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    DRAINING = "draining"


def _fresh_registry(registry: CollectorRegistry | None) -> CollectorRegistry:
    # The *_created series double the exposition size and no dashboard uses them.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    return registry if registry is not None else CollectorRegistry()


class FrontendMetrics:
    """What a front end counts: requests by route and status, and its readiness."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = _fresh_registry(registry)
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
        self.model_requests = Counter(
            "batchserve_model_requests",
            "Inference requests answered, by the model and version they were validated for "
            "(a traffic split's choice, or the version named) and status code.",
            ["model", "version", "status"],
            registry=r,
        )
        self.deadline_overrun = Histogram(
            "batchserve_deadline_overrun_seconds",
            "How long after its deadline a request answered 504 by its engine got that "
            "answer, as its front end saw it (0 for one refused before its deadline, as unable "
            "to finish in time): deadlines are kept while this stays near 0.",
            buckets=OVERRUN_BUCKETS_S,
            registry=r,
        )
        self.loop_lag = Histogram(
            "batchserve_event_loop_lag_seconds",
            "How much later than asked a front end's event loop woke a task that asks every "
            "100 ms: what holds the loop (a costly parse or handler, a garbage collection) "
            "delays every request of that process by as much.",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "batchserve_in_flight_requests",
            "Prediction requests received and not yet answered (queued or running).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rollout_percent = Gauge(
            "batchserve_rollout_percent",
            "The candidate version's share of traffic at the step a rollout plan holds "
            "(batchserve rollout), by model and candidate; 0 once the plan is done.",
            ["model", "version"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.rollout_decisions = Counter(
            "batchserve_rollout_decisions",
            "Rollout steps decided, by model, verdict (promote, rollback) and the check that "
            "failed (none on a promotion).",
            ["model", "verdict", "check"],
            registry=r,
        )
        self.ready = Gauge(
            "batchserve_ready",
            "1 when the front end can reach a ready engine and is not draining.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.engines_ready = Gauge(
            "batchserve_engines_ready",
            "Engines this front end reaches that are ready (the least over front ends).",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.engine_role = Gauge(
            "batchserve_engine_role",
            "1 for each engine's role as the front ends see it (active: takes the requests of "
            "its device; standby: ready to take over), by device and engine socket.",
            ["device", "engine", "role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.standby_engines_ready = Gauge(
            "batchserve_standby_engines_ready",
            "Standby engines ready to take over, by device (the least over front ends); "
            "exported only with standby_engines set.",
            ["device"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.engine_failovers = Counter(
            "batchserve_engine_failovers",
            "Times a front end switched to a standby engine when the active one was lost, by "
            "device: each front end counts its own, so one engine lost counts once per worker.",
            ["device"],
            registry=r,
        )
        self.engine_takeover = Histogram(
            "batchserve_engine_takeover_seconds",
            "From the last frame a front end received from its lost active engine (an answer, "
            "or a heartbeat: one every engine_heartbeat_interval_s) until that front end had "
            "an active engine again and sent its next requests there: a standby, or else the "
            "restarted engine. The outage of one device as one front end saw it, to within "
            "one heartbeat interval; one per front end.",
            ["device"],
            buckets=TAKEOVER_BUCKETS_S,
            registry=r,
        )
        self.response_cache_hits = Counter(
            "batchserve_response_cache_hits",
            "Requests answered from a front end's response cache without a forward, by model "
            "(a request that waited for an identical one in flight counts here too).",
            ["model"],
            registry=r,
        )
        self.response_cache_misses = Counter(
            "batchserve_response_cache_misses",
            "Requests to a cached model that the response cache sent to an engine, by model.",
            ["model"],
            registry=r,
        )
        self.response_cache_evictions = Counter(
            "batchserve_response_cache_evictions",
            "Answers dropped from a response cache to make room (least recently used first), "
            "by model.",
            ["model"],
            registry=r,
        )
        self.response_cache_bytes = Gauge(
            "batchserve_response_cache_bytes",
            "Bytes of answers and their keys the response caches hold, by model (summed over "
            "front ends, each of which keeps its own).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )


class EngineMetrics:
    """What an engine counts: its queue, its batches, its model and its device's memory."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = _fresh_registry(registry)
        self.model_memory = Gauge(
            "batchserve_model_memory_bytes",
            "Memory a served model takes on its device, measured after its warm-up: CUDA "
            "memory allocated, or the engine's resident-memory growth on the CPU.",
            ["model", "version", "device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.starts = Counter(
            "batchserve_engine_starts",
            "Engine processes started, by device: more than one per device means restarts.",
            ["device"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "batchserve_queue_depth",
            "Requests waiting in a model version's batcher queue (several versions of a model "
            "are loaded under a traffic split: sum by model for the model's).",
            labelnames=["model", "version"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "batchserve_queue_wait_seconds",
            "Time a request waited in the queue before its batch started.",
            buckets=LATENCY_BUCKETS_S,
            labelnames=["model"],
            registry=r,
        )
        self.batch_size = Histogram(
            "batchserve_batch_size_rows",
            "Rows (instances) per forward pass.",
            buckets=BATCH_SIZE_BUCKETS_ROWS,
            labelnames=["model"],
            registry=r,
        )
        self.batch_sources = Histogram(
            "batchserve_batch_frontends",
            "Front-end processes whose requests shared a batch (1 with one process).",
            buckets=FRONTEND_COUNT_BUCKETS,
            labelnames=["model"],
            registry=r,
        )
        self.batch_tokens = Counter(
            "batchserve_batch_tokens",
            "Positions of the variable-length inputs (tokens) run in forward passes: real "
            "ones (kind=real, those of the attention mask) and padding (kind=padding: up to "
            "each request's longest instance, then to the batch's longest).",
            ["model", "kind"],
            registry=r,
        )
        self.batch_padding = Histogram(
            "batchserve_batch_padding_ratio",
            "Share of a forward pass's positions that are padding (variable-length inputs).",
            buckets=PADDING_RATIO_BUCKETS,
            labelnames=["model"],
            registry=r,
        )
        self.inference_latency = Histogram(
            "batchserve_inference_duration_seconds",
            "Time of one batched forward pass, collation and splitting included.",
            buckets=LATENCY_BUCKETS_S,
            labelnames=["model"],
            registry=r,
        )
        self.dropped = Counter(
            "batchserve_dropped_requests",
            "Requests not computed (a split request counts once per chunk): queue full, "
            "deadline unreachable (refused or dropped by estimate), deadline expired, client "
            "gone, or draining.",
            ["model", "reason"],
            registry=r,
        )
        self.batch_dispatches = Counter(
            "batchserve_batch_dispatches",
            "Batches taken, by why: full, target (the adaptive target reached), waited (the "
            "oldest request waited max_wait_ms), refill (the wait for the clients the last "
            "batch answered ended), drain.",
            ["model", "reason"],
            registry=r,
        )
        self.batch_failures = Counter(
            "batchserve_batch_failures",
            "Batched forward passes that raised and were retried by halves.",
            labelnames=["model"],
            registry=r,
        )
        self.out_of_memory = Counter(
            "batchserve_out_of_memory",
            "Batches that ran out of device memory (then split and retried by halves).",
            labelnames=["model"],
            registry=r,
        )
        self.effective_max_batch_size = Gauge(
            "batchserve_effective_max_batch_size",
            "Rows per batch allowed now: max_batch_size, or less for a while after running out "
            "of device memory, by model version (each version loaded has its own batcher).",
            labelnames=["model", "version"],
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

        self.time_to_first_token = Histogram(
            "batchserve_time_to_first_token_seconds",
            "Time from a generation request's arrival in the engine to its first token.",
            buckets=LATENCY_BUCKETS_S,
            labelnames=["model"],
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "batchserve_inter_token_latency_seconds",
            "Time between two tokens of one generated stream.",
            buckets=LATENCY_BUCKETS_S,
            labelnames=["model"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "batchserve_generated_tokens",
            "Tokens generated (its rate: tokens per second).",
            labelnames=["model"],
            registry=r,
        )
        self.running_sequences = Gauge(
            "batchserve_running_sequences",
            "Sequences a generative version generates now (decoding or prefilling).",
            labelnames=["model", "version"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waiting_sequences = Gauge(
            "batchserve_waiting_sequences",
            "Generation requests waiting for a KV-cache slot of a generative version.",
            labelnames=["model", "version"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_cache_slots = Gauge(
            "batchserve_kv_cache_slots",
            "KV-cache slots (one per running sequence) of a generative version: kind=used or "
            "kind=total (while a switch finishes the old version's streams, both count).",
            ["model", "version", "kind"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.shadow_compared = Counter(
            "batchserve_shadow_compared",
            "Shadowed requests whose candidate answer was compared with the served answer.",
            ["model", "version"],
            registry=r,
        )
        self.shadow_disagreed = Counter(
            "batchserve_shadow_disagreed",
            "Shadowed requests on which the candidate's answer disagreed with the served one "
            "(another label, a token, or a tensor beyond the tolerance).",
            ["model", "version"],
            registry=r,
        )
        self.shadow_dropped = Counter(
            "batchserve_shadow_dropped",
            "Requests chosen for a shadow but not run on the candidate, by reason: "
            "shadow_full (its bounded queue), served_busy (the served queue is long), "
            "refused (the candidate's batcher refused it), expired (its deadline passed before "
            "the device was idle for it), failed (the candidate raised).",
            ["model", "version", "reason"],
            registry=r,
        )
        self.shadow_latency = Histogram(
            "batchserve_shadow_latency_seconds",
            "From a shadowed request's queueing on the candidate to its answer, by version "
            "(it waits for an idle device, so it is an upper bound of the candidate's own).",
            buckets=LATENCY_BUCKETS_S,
            labelnames=["model", "version"],
            registry=r,
        )

    def for_model(self, model: str, version: str) -> ModelMetrics:
        """The series of one model version's batcher."""
        return ModelMetrics(self, model, version)

    def forget_version(self, model: str, version: str) -> None:
        """Drop the gauges of a version unloaded (zeroed first: with several processes the
        value lives on in this process's metrics file, which remove() does not touch)."""
        for gauge in (self.queue_depth, self.effective_max_batch_size):
            gauge.labels(model, version).set(0)
            gauge.remove(model, version)


class ModelMetrics:
    """One model version's batcher series: ``EngineMetrics`` with the ``model`` label filled
    in, and ``version`` for the gauges (two versions' batchers would overwrite each other's
    value; their counters and histograms add up under the model)."""

    def __init__(self, metrics: EngineMetrics, model: str, version: str) -> None:
        self.model = model
        self.queue_depth = metrics.queue_depth.labels(model, version)
        self.queue_wait = metrics.queue_wait.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.batch_sources = metrics.batch_sources.labels(model)
        self.inference_latency = metrics.inference_latency.labels(model)
        self.batch_failures = metrics.batch_failures.labels(model)
        self.out_of_memory = metrics.out_of_memory.labels(model)
        self.effective_max_batch_size = metrics.effective_max_batch_size.labels(model, version)
        self._real_tokens = metrics.batch_tokens.labels(model, "real")
        self._padding_tokens = metrics.batch_tokens.labels(model, "padding")
        self._padding_ratio = metrics.batch_padding.labels(model)
        self._dropped = metrics.dropped
        self._dispatches = metrics.batch_dispatches
        self._dispatch_counters: dict[str, Counter] = {}

    def batch_positions(self, real: int, padded: int) -> None:
        """A forward pass ran ``padded`` positions of a variable-length input, ``real`` of
        them tokens (the rest padding)."""
        self._real_tokens.inc(real)
        self._padding_tokens.inc(padded - real)
        self._padding_ratio.observe((padded - real) / padded if padded else 0.0)

    def dropped(self, reason: str) -> Counter:
        """The counter of this model's requests dropped for ``reason``."""
        return self._dropped.labels(self.model, reason)

    def dispatched(self, reason: str) -> None:
        """One batch taken, for ``reason`` (``engine.batcher.policy.DispatchReason``)."""
        counter = self._dispatch_counters.get(reason)
        if counter is None:
            counter = self._dispatch_counters[reason] = self._dispatches.labels(self.model, reason)
        counter.inc()


class ProcessMetrics:
    """The resident memory of this process, labelled with its role."""

    def __init__(self, role: ProcessRole, registry: CollectorRegistry | None = None) -> None:
        self.registry = _fresh_registry(registry)
        self.role = role
        self._resident_memory = Gauge(
            "batchserve_process_resident_memory_bytes",
            "Resident memory of the serving processes, by role: frontend, engine, or server "
            "(one process doing both).",
            ["role"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    def refresh(self) -> None:
        self._resident_memory.labels(self.role).set(resident_memory_bytes())


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of ``registry``, or of every process of the server in
    multiprocess mode."""
    return generate_latest(_collected(registry))


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """``render``'s metrics and their media type, in OpenMetrics when ``accept`` asks for it:
    only that format carries exemplars (the trace of a sampled request in latency buckets).
    prometheus-client's multiprocess mode keeps no exemplars."""
    encode, media_type = choose_encoder(accept or "")
    if not media_type.startswith("application/openmetrics-text"):
        return render(registry), METRICS_CONTENT_TYPE
    return encode(_collected(registry)), media_type


def _collected(registry: CollectorRegistry) -> CollectorRegistry:
    if os.environ.get(MULTIPROCESS_DIR_ENV):
        aggregate = CollectorRegistry()
        CollectorOfStartedFiles(aggregate)  # type: ignore[no-untyped-call]
        return aggregate
    return registry


def resident_memory_bytes() -> int:
    """Current resident set size of this process (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
