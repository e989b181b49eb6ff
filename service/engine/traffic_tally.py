"""Every request's answer, counted by version in the engine: the engine sees the requests of
every front end, so its ``TrafficWindow`` covers them all (a front end's would cover its own).

A request's finished ticket passes through a tap (``TallySink``) on its way to its own sink
(its front end, or none for a caller in this process waiting on it): the tap records the
version's answer (its latency from the engine's receipt, and whether it failed with a server
error) and hands the ticket on. A generated stream is counted when it ends
(``TalliedStreams``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from service.bridge.interface import GeneratedTokens, GenerateRequest
from service.engine.batcher import Sink, Ticket
from service.engine.generation_loop import TokenSink
from service.errors import ServiceError
from service.traffic_window import TrafficReport, TrafficWindow


class TrafficTally:
    """One engine's answers by model and version, over the recent window."""

    def __init__(
        self, window: TrafficWindow | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window or TrafficWindow()
        self._clock = clock
        self._received: dict[int, tuple[str, str, float]] = {}
        self._taps: dict[int, TallySink] = {}

    def sink_for(self, sink: Sink | None) -> TallySink:
        """The tap to queue a request with, in place of ``sink``."""
        tap = self._taps.get(id(sink))
        if tap is None:
            tap = self._taps[id(sink)] = TallySink(self, sink)
        return tap

    def forget(self, sink: Sink) -> TallySink | None:
        """``sink``'s tap, no longer handed out (its front end left), if it had one."""
        return self._taps.pop(id(sink), None)

    def received(self, ticket: Ticket[Any], model: str, version: str, at_s: float) -> None:
        """``ticket`` (queued with a tap of ``sink_for``) is a request to ``model@version``
        received at ``at_s``."""
        self._received[id(ticket)] = (model, version, at_s)

    def answered(self, ticket: Ticket[Any]) -> None:
        received = self._received.pop(id(ticket), None)
        if received is None:
            return
        model, version, at_s = received
        try:
            ticket.outputs()
            status = 200
        except asyncio.CancelledError:
            return  # withdrawn: its client left, nothing was answered
        except ServiceError as error:
            status = error.status_code
        except Exception:
            status = 500
        self.record(model, version, at_s, status)

    def record(self, model: str, version: str, received_s: float, status: int) -> None:
        """An answer of ``model@version`` with ``status``, to a request received at
        ``received_s``, given now."""
        now_s = self._clock()
        self.window.record(model, version, now_s, now_s - received_s, status)

    def now_s(self) -> float:
        return self._clock()

    def report(self, model: str) -> TrafficReport:
        return self.window.report(model, self._clock())


class TallySink:
    """A request's sink as queued: counts its answer, then hands it to its own sink."""

    def __init__(self, tally: TrafficTally, sink: Sink | None) -> None:
        self._tally = tally
        self._sink = sink

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None:
        for ticket in tickets:
            self._tally.answered(ticket)
        if self._sink is not None:
            self._sink.deliver(tickets)


class Streams(Protocol):
    """A generative version's streams (``GenerationLoop``, or a shadow's watch over it)."""

    def submit(self, request: GenerateRequest, sink: TokenSink) -> int: ...

    def cancel(self, key: int) -> None: ...


class TalliedStreams:
    """A version's streams, each counted in the tally when it ends (a stream its client left
    is not)."""

    def __init__(self, streams: Streams, tally: TrafficTally, model: str, version: str) -> None:
        self._streams = streams
        self._tally = tally
        self._model = model
        self._version = version

    def submit(self, request: GenerateRequest, sink: TokenSink) -> int:
        counted = _TalliedTokens(self, self._tally.now_s(), sink)
        return self._streams.submit(request, counted)

    def cancel(self, key: int) -> None:
        self._streams.cancel(key)

    def ended(self, received_s: float, status: int) -> None:
        self._tally.record(self._model, self._version, received_s, status)


class _TalliedTokens:
    def __init__(self, streams: TalliedStreams, received_s: float, sink: TokenSink) -> None:
        self._streams = streams
        self._received_s = received_s
        self._sink = sink

    def tokens(self, item: GeneratedTokens) -> None:
        self._sink.tokens(item)
        if item.finish_reason is not None:
            self._streams.ended(self._received_s, 500 if item.finish_reason == "error" else 200)

    def failed(self, error: ServiceError) -> None:
        self._sink.failed(error)
        self._streams.ended(self._received_s, error.status_code)
