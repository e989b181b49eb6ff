"""A front end's request counts, latencies and in-flight gauge, tallied in its own memory and
written to the Prometheus metrics a batch at a time.

With several processes each write to a metric is a write to a memory-mapped file under a lock,
five per request (the count, the latency's sum and bucket, in-flight up and down), a share of
a front end's CPU under load. Here a request adds to a dict; the tally is
written when the front end goes idle (nothing in flight: what a quiet server or a test then
scrapes is exact), when a request arrives at an idle front end (so in-flight shows at once),
when this process renders ``/metrics`` (``flush``), and otherwise at most ``FLUSH_EVERY_S``
apart, so a scrape of another process lags this one's counts by that much at most.

Going idle and leaving it are written once a loop turn (``call_soon``), for all the requests
of the turn: a request served without waiting (its body in, its answer computed at
once, as the HTTP ceiling's) starts and ends in one step of its task, and would otherwise
write the files at both ends.

A request traced with an exemplar is written at once: the exemplar belongs to its own
observation (HTTP requests bring theirs from their span, ``request_spans.EXEMPLAR_STATE``).
"""

from __future__ import annotations

import asyncio
import time

from service.metrics import FrontendMetrics

FLUSH_EVERY_S = 0.1


class RequestTally:
    """Requests of one front end (HTTP and gRPC): every request when answered, and inference
    requests in flight from arrival (``started``) to answer (``stopped``). One event loop uses
    it: no lock."""

    def __init__(self, metrics: FrontendMetrics, flush_every_s: float = FLUSH_EVERY_S) -> None:
        self._metrics = metrics
        self._flush_every_s = flush_every_s
        self.in_flight = 0
        self._in_flight_written = 0
        self._latencies: dict[tuple[str, str], list[float]] = {}
        self._by_version: dict[tuple[str, str, str], int] = {}
        self._flushed_s = time.perf_counter()
        self._flush_pending = False

    def started(self) -> None:
        """An inference request arrived: in flight until ``stopped``."""
        self.in_flight += 1
        if self.in_flight == 1:
            self._flush_soon()

    def stopped(self) -> None:
        """An inference request that ``started`` has its answer (or its client left)."""
        self.in_flight -= 1

    def answered(
        self, route: str, status: str, latency_s: float, exemplar: dict[str, str] | None = None
    ) -> None:
        """One request of ``route`` answered ``status`` after ``latency_s``; ``exemplar``: the
        sampled trace it belongs to, if any (``tracing.current_exemplar``)."""
        if exemplar is not None:
            self._metrics.requests.labels(route, status).inc()
            self._metrics.request_latency.labels(route, status).observe(latency_s, exemplar)
        else:
            latencies = self._latencies.get((route, status))
            if latencies is None:
                self._latencies[route, status] = [latency_s]
            else:
                latencies.append(latency_s)
        if self.in_flight == 0:
            self._flush_soon()
        elif time.perf_counter() - self._flushed_s >= self._flush_every_s:
            self.flush()

    def answered_by(self, model: str, version: str, status: str) -> None:
        """An inference request validated for ``model@version`` answered ``status``
        (``batchserve_model_requests_total``); written with the next flush, which the
        request's ``answered`` brings."""
        key = (model, version, status)
        self._by_version[key] = self._by_version.get(key, 0) + 1

    def _flush_soon(self) -> None:
        """``flush`` at the end of this turn of the event loop (at once outside one)."""
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_pending = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what was tallied since the last flush to the metrics."""
        self._flush_pending = False
        self._flushed_s = time.perf_counter()
        if self.in_flight != self._in_flight_written:
            self._metrics.in_flight.set(self.in_flight)
            self._in_flight_written = self.in_flight
        if self._by_version:
            counted, self._by_version = self._by_version, {}
            for labels, count in counted.items():
                self._metrics.model_requests.labels(*labels).inc(count)
        if not self._latencies:
            return
        tallied, self._latencies = self._latencies, {}
        for (route, status), latencies in tallied.items():
            self._metrics.requests.labels(route, status).inc(len(latencies))
            histogram = self._metrics.request_latency.labels(route, status)
            for latency in latencies:
                histogram.observe(latency)
