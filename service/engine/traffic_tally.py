"""Every request's answer, counted by version in the engine: the engine sees the requests of
every front end, so its ``TrafficWindow`` covers them all (a front end's would cover its own).

A request's finished ticket passes through a tap (``TallySink``) on its way to its own sink
(its front end, or none for a caller in this process waiting on it): the tap records the
version's answer (its latency from the engine's receipt, and whether it failed with a server
error) and hands the ticket on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from service.engine.batcher import Sink, Ticket
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
        now_s = self._clock()
        self.window.record(model, version, now_s, now_s - at_s, status)

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
