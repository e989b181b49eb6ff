"""Shadow traffic: a candidate version runs a share of one model's requests too, and its answers
are compared with the served version's, in the engine where both are.

The client never waits for the candidate. A chosen request is served as any other; only once
its answer has gone to its front end (``_ServedTap``) is a copy of its instances queued on the
candidate, whose batches take the device only when no served model wants it
(``DeviceTurns``'s background turns). Shadows are shed first: a copy is dropped, and counted,
when ``SHADOW_QUEUE_REQUESTS`` are queued on the candidate already, when the served model's
own queue holds a batch's worth of requests, or when a copy's deadline passes before the
device was idle for it. A candidate that raises or is slow changes nothing but its own
counters.

Each answer pair is compared output by output (``service/comparison.py``); a disagreement is
counted and kept in a bounded log with both version ids. A generative model's greedy requests
(temperature 0) are copied once their stream has finished, and agree when the candidate
generates the same token ids (``ShadowedGeneration``); sampled ones are never copied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bridge.interface import GeneratedTokens, GenerateRequest, ShadowReport
from service.comparison import Disagreement, DisagreementLog, compare_answers, same_tokens
from service.engine.batcher import Sink, Ticket
from service.engine.generation_loop import GenerationLoop, TokenSink
from service.engine.state import ServedModel
from service.errors import DeadlineExceededError, ServiceError
from service.metrics import EngineMetrics
from service.tensors import NamedArrays

#: Shadowed requests queued or running on a candidate at most; more are dropped.
SHADOW_QUEUE_REQUESTS = 64
#: Latencies kept per version for the report's percentiles (the most recent ones).
LATENCY_WINDOW = 2048
#: Disagreements kept for the report (the most recent ones).
DISAGREEMENT_LOG_SIZE = 32


class LatencyWindow:
    """The last ``size`` latencies of one version, and their percentiles."""

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        self._seconds: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)

    def percentile_s(self, percent: float) -> float | None:
        """None when nothing was measured."""
        if not self._seconds:
            return None
        return float(np.percentile(np.fromiter(self._seconds, dtype=np.float64), percent))


@dataclass(frozen=True, slots=True)
class _Watched:
    """A served request chosen for the shadow, until its answer comes."""

    instances: NamedArrays
    request_id: str
    queued_s: float


@dataclass(frozen=True, slots=True)
class _Pending:
    """A shadowed request queued on the candidate: the served answer it is compared with."""

    served: NamedArrays
    request_id: str
    queued_s: float


class Shadow:
    """One model's shadow: its candidate version, the share of requests copied to it, and what
    the comparisons found so far."""

    def __init__(
        self,
        served: ServedModel,
        candidate: ServedModel,
        percent: int,
        metrics: EngineMetrics,
        *,
        busy_requests: int,
        max_queued: int = SHADOW_QUEUE_REQUESTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``busy_requests``: the served model's queue depth from which copies are dropped."""
        self.model = served.manifest.name
        self.served_version = served.manifest.version
        self.candidate = candidate
        self.percent = percent
        self._served = served
        self._specs = {spec.name: spec for spec in served.manifest.outputs}
        self._metrics = metrics
        self._busy_requests = busy_requests
        self._max_queued = max_queued
        self._clock = clock
        self._credit = 0
        self._watched: dict[int, _Watched] = {}
        self._taps: dict[int, _ServedTap] = {}
        self._queued = 0
        self._candidate_sink = _CandidateSink(self)
        self.chosen_count = 0
        self.compared = 0
        self.disagreed = 0
        self.failed = 0
        self.dropped = 0
        self.log = DisagreementLog(DISAGREEMENT_LOG_SIZE)
        self.served_latency = LatencyWindow()
        self.candidate_latency = LatencyWindow()

    @property
    def candidate_version(self) -> str:
        return self.candidate.manifest.version

    def shadows(self, served: ServedModel) -> bool:
        """Whether ``served`` is the version this shadow was started beside (after a switch,
        it copies nothing until it is started again)."""
        return served is self._served

    def chooses(self) -> bool:
        """Whether the next request is copied: exactly ``percent`` of every 100, spread
        evenly (a running credit, no randomness)."""
        self._credit += self.percent
        if self._credit < 100:
            return False
        self._credit -= 100
        return True

    def watch(self, ticket: Ticket[NamedArrays], instances: NamedArrays, request_id: str) -> None:
        """Copy ``ticket``'s request to the candidate once it is answered: its finished ticket
        passes through a tap on its way to its own sink (its front end, or none)."""
        self.chosen_count += 1
        sink = ticket.sink
        tap = self._taps.get(id(sink))
        if tap is None:
            tap = self._taps[id(sink)] = _ServedTap(self, sink)
        ticket.sink = tap
        self._watched[id(ticket)] = _Watched(instances, request_id, self._clock())

    def forget(self, sink: Sink | None) -> None:
        """``sink``'s tap is no longer handed out (its front end left)."""
        self._taps.pop(id(sink), None)

    def served_answered(self, ticket: Ticket[Any]) -> None:
        """A watched request was answered (its client has its answer): queue its copy."""
        watched = self._watched.pop(id(ticket), None)
        if watched is None:
            return
        try:
            outputs = NamedArrays.concatenate(ticket.outputs(), ticket.order)
        except BaseException:  # the served request failed or was withdrawn: nothing to compare
            return
        now_s = self._clock()
        self.served_latency.add(now_s - watched.queued_s)
        if self._queued >= self._max_queued:
            self._drop("shadow_full")
            return
        if self._served.batcher.queue_depth >= self._busy_requests:
            self._drop("served_busy")
            return
        try:
            queued = self.candidate.queued(watched.instances)
            self.candidate.batcher.enqueue(
                queued.payload,
                group=queued.group,
                cost_per_row=queued.cost_per_row,
                more=queued.more,
                order=queued.order,
                request_id=watched.request_id,
                sink=self._candidate_sink,
                tag=_Pending(outputs, watched.request_id, now_s),
            )
        except ServiceError:
            self._drop("refused")
            return
        self._queued += 1

    def generated(self, request: GenerateRequest, served_ids: tuple[int, ...]) -> None:
        """A chosen greedy stream finished on the served version with ``served_ids``: queue
        the same request on the candidate's generation."""
        generation = self.candidate.generation
        if generation is None:
            return
        if self._queued >= self._max_queued:
            self._drop("shadow_full")
            return
        copy = dataclasses.replace(request, deadline_s=float("inf"), traceparent=None)
        sink = _CandidateTokens(self, request.request_id, served_ids, self._clock())
        try:
            generation.submit(copy, sink)
        except ServiceError:
            self._drop("refused")
            return
        self._queued += 1

    def generation_compared(
        self, request_id: str, served_ids: tuple[int, ...], candidate_ids: tuple[int, ...] | None,
        queued_s: float,
    ) -> None:  # fmt: skip
        """The candidate's copy of a stream ended: ``candidate_ids`` (None: it failed)."""
        self._queued -= 1
        labels = (self.model, self.candidate_version)
        if candidate_ids is None:
            self.failed += 1
            self._metrics.shadow_dropped.labels(*labels, "failed").inc()
            return
        seconds = self._clock() - queued_s
        self.candidate_latency.add(seconds)
        self._metrics.shadow_latency.labels(*labels).observe(seconds)
        result = same_tokens(served_ids, candidate_ids)
        self._count(
            result.agreed,
            request_id,
            f"tokens: {len(served_ids)} served, {len(candidate_ids)} candidate, "
            f"token agreement {result.token_agreement:.3f}",
        )

    def candidate_answered(self, ticket: Ticket[Any]) -> None:
        pending = ticket.tag
        assert isinstance(pending, _Pending)  # as served_answered queued it
        self._queued -= 1
        labels = (self.model, self.candidate_version)
        try:
            outputs = NamedArrays.concatenate(ticket.outputs(), ticket.order)
        except (DeadlineExceededError, asyncio.CancelledError):
            self._drop("expired")  # never ran: shed, not the candidate's failure
            return
        except BaseException:  # the candidate raised
            self.failed += 1
            self._metrics.shadow_dropped.labels(*labels, "failed").inc()
            return
        seconds = self._clock() - pending.queued_s
        self.candidate_latency.add(seconds)
        self._metrics.shadow_latency.labels(*labels).observe(seconds)
        result = compare_answers(pending.served.arrays, outputs.arrays, self._specs)
        self._count(result.agreed, pending.request_id, result.first_disagreement or "")

    def _count(self, agreed: bool, request_id: str, detail: str) -> None:
        labels = (self.model, self.candidate_version)
        self.compared += 1
        self._metrics.shadow_compared.labels(*labels).inc()
        if agreed:
            return
        self.disagreed += 1
        self._metrics.shadow_disagreed.labels(*labels).inc()
        self.log.add(
            Disagreement(
                self.model, self.served_version, self.candidate_version, request_id, detail
            )
        )

    def report(self) -> ShadowReport:
        return ShadowReport(
            model=self.model,
            version=self.candidate_version,
            served_version=self.served_version,
            percent=self.percent,
            chosen=self.chosen_count,
            compared=self.compared,
            disagreed=self.disagreed,
            failed=self.failed,
            dropped=self.dropped,
            candidate_p50_s=self.candidate_latency.percentile_s(50),
            candidate_p99_s=self.candidate_latency.percentile_s(99),
            served_p99_s=self.served_latency.percentile_s(99),
            disagreements=tuple(entry.to_json() for entry in self.log.entries()),
        )

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self._metrics.shadow_dropped.labels(self.model, self.candidate_version, reason).inc()


class _ServedTap:
    """The sink of a watched served request: hands it on to its own sink first (its client is
    answered), then to the shadow."""

    def __init__(self, shadow: Shadow, sink: Sink | None) -> None:
        self._shadow = shadow
        self._sink = sink

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None:
        try:
            if self._sink is not None:
                self._sink.deliver(tickets)
        finally:
            for ticket in tickets:
                self._shadow.served_answered(ticket)


class _CandidateSink:
    def __init__(self, shadow: Shadow) -> None:
        self._shadow = shadow

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None:
        for ticket in tickets:
            self._shadow.candidate_answered(ticket)


class ShadowedGeneration:
    """A served version's generation with a shadow: each greedy stream the shadow chooses is
    watched on its way to its sink, and copied to the candidate once it has finished."""

    def __init__(self, generation: GenerationLoop, shadow: Shadow) -> None:
        self._generation = generation
        self._shadow = shadow

    def submit(self, request: GenerateRequest, sink: TokenSink) -> int:
        if request.temperature == 0 and self._shadow.chooses():
            self._shadow.chosen_count += 1
            sink = _ServedTokens(self._shadow, request, sink)
        return self._generation.submit(request, sink)

    def cancel(self, key: int) -> None:
        self._generation.cancel(key)


class _ServedTokens:
    """A chosen stream's sink: hands each item on first, keeps its token ids, and gives them
    to the shadow once the stream has finished (not when it failed)."""

    def __init__(self, shadow: Shadow, request: GenerateRequest, sink: TokenSink) -> None:
        self._shadow = shadow
        self._request = request
        self._sink = sink
        self._ids: list[int] = []

    def tokens(self, item: GeneratedTokens) -> None:
        self._sink.tokens(item)
        self._ids += item.token_ids
        if item.finish_reason in ("stop", "length"):
            self._shadow.generated(self._request, tuple(self._ids))

    def failed(self, error: ServiceError) -> None:
        self._sink.failed(error)


class _CandidateTokens:
    """The sink of a stream's copy on the candidate: its token ids, compared at its end."""

    def __init__(
        self, shadow: Shadow, request_id: str, served_ids: tuple[int, ...], queued_s: float
    ) -> None:
        self._shadow = shadow
        self._request_id = request_id
        self._served_ids = served_ids
        self._queued_s = queued_s
        self._ids: list[int] = []

    def tokens(self, item: GeneratedTokens) -> None:
        self._ids += item.token_ids
        if item.finish_reason is not None:
            ids = None if item.finish_reason == "error" else tuple(self._ids)
            self._shadow.generation_compared(
                self._request_id, self._served_ids, ids, self._queued_s
            )

    def failed(self, error: ServiceError) -> None:
        self._shadow.generation_compared(self._request_id, self._served_ids, None, self._queued_s)
