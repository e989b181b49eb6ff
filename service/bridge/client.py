"""The front end's end of the bridge: one connection to each engine, as one ``EngineClient``.

Each request goes to the ready engine with the fewest requests outstanding from this front
end, among the active engine of each device: a device's other engines are warm standbys that
take over when the active one is lost (``engines.py``). A connection that is lost, or an
engine that has gone quiet for longer than the heartbeat timeout, fails every request
waiting on it at once with 503 and ``Retry-After`` (nothing waits out its deadline on a dead
engine); the connection is then retried until the engine is back (``connection.py``). A
request is answered 504 at its deadline here too, and a request whose client left is
cancelled in the engine, so it is never computed.

A version switch reaches every engine or none: each engine first loads and warms up the
version beside the one it serves (``prepare``); only when all have it does each switch
(``commit``); if any refuses, the others discard it (``abort``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from service.bridge import changes
from service.bridge.connection import EngineConnection
from service.bridge.engines import ActiveEngines, change_targets, roles
from service.bridge.interface import (
    EngineStatus,
    GeneratedTokens,
    GenerateRequest,
    InferenceRequest,
    InferenceResult,
    Phase,
    ShadowReport,
    SwitchResult,
)
from service.errors import ServiceError
from service.traffic_window import TrafficReport
from service.types import Priority

logger = logging.getLogger(__name__)

#: When no engine is ready, the phase the front end reports: the first of these that some
#: engine is in (an engine loading will serve soon; one that failed will not).
_PHASE_ORDER: tuple[Phase, ...] = (
    "loading",
    "draining",
    "stalled",
    "connecting",
    "down",
    "failed",
)


class BridgeClient:
    """Every engine of the server, as one ``EngineClient`` for this front end."""

    def __init__(
        self,
        engines: Sequence[tuple[Path, str]],
        *,
        heartbeat_timeout_s: float,
        request_timeout_ms: float,
        on_status: Callable[[], None] = lambda: None,
        on_takeover: Callable[[str, float, bool], None] = lambda device, s, failover: None,
    ) -> None:
        """``engines``: the socket path and device of each engine (standbys included);
        ``on_takeover``: see ``engines.Takeovers``."""
        self._request_timeout_ms = request_timeout_ms
        self._connections = [
            EngineConnection(
                path,
                device,
                heartbeat_timeout_s,
                self._engine_changed,
                request_timeout_ms,
            )
            for path, device in engines
        ]
        self._choice = ActiveEngines([device for _, device in engines], on_takeover)
        self._active: list[EngineConnection] = []
        self._on_status = on_status
        self._runs: list[asyncio.Task[None]] = []
        self._status: EngineStatus | None = None
        self._ready_changed = asyncio.Event()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._runs = [
            loop.create_task(connection.run(), name=f"bridge-{connection.path.name}")
            for connection in self._connections
        ]

    async def close(self) -> None:
        for run in self._runs:
            run.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)
        for connection in self._connections:
            connection.stop()

    async def wait_until_settled(self) -> EngineStatus:
        """Wait until some engine is ready, or every engine has failed to load."""
        while True:
            status = self.status()
            if status.ready or status.phase == "failed":
                return status
            self._ready_changed.clear()
            await self._ready_changed.wait()

    def _engine_changed(self) -> None:
        connections = self._connections
        active = self._choice.changed(
            [c.status for c in connections], [c.last_heard_s for c in connections]
        )
        self._active = [self._connections[i] for i in active]
        self._status_changed()

    def _status_changed(self) -> None:
        self._status = None
        self._ready_changed.set()
        self._on_status()

    # ----------------------------------------------------------------- EngineClient

    def status(self) -> EngineStatus:
        if self._status is None:
            statuses = [connection.status for connection in self._connections]
            ready = [status for status in statuses if status.ready]
            if ready:
                self._status = ready[0]
            else:
                by_phase = {status.phase: status for status in reversed(statuses)}
                phase = next(phase for phase in _PHASE_ORDER if phase in by_phase)
                self._status = by_phase[phase]
        return self._status

    def engines(self) -> list[EngineStatus]:
        statuses = [connection.status for connection in self._connections]
        return roles(statuses, self._choice.active)

    def refusal_before_body(
        self, model: str, version: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        """None: the engine's queue is behind the bridge, and refuses after the parse."""
        return None

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        """Submit ``request`` to an engine; its connection answers 504 at its deadline."""
        connection = self._pick()
        call_id, future = connection.submit(request)
        try:
            return await future
        except asyncio.CancelledError:
            connection.cancel(call_id)  # the engine drops it unless it is running already
            raise

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GeneratedTokens]:
        """Start ``request`` on an engine and yield its tokens as its frames bring them;
        closing early cancels the stream in the engine."""
        connection = self._pick()
        call_id, stream = connection.generate(request)
        try:
            async for item in stream.until_finished():
                yield item
        finally:
            connection.cancel(call_id)  # nothing is sent once it finished

    def _pick(self) -> EngineConnection:
        """The active engine with the fewest of this front end's requests outstanding."""
        ready = self._active
        if not ready:
            raise self.status().refusal()
        return min(ready, key=lambda connection: connection.outstanding)

    async def switch(self, name: str, version: str) -> SwitchResult:
        """Prepare on every engine, then commit on all of them, or abort on all (see
        ``bridge/changes.py``)."""
        before = self.status().find(name)
        return await changes.switch_everywhere(self._change_targets(), name, version, before)

    async def rollback(self, name: str | None = None) -> SwitchResult:
        return await self.switch(*self.status().rollback_target(name))

    async def split(self, name: str, weights: dict[str, int]) -> SwitchResult:
        """Prepare the split on every engine, then commit on all of them, or abort on all."""
        before = self.status().find(name)
        return await changes.split_everywhere(self._change_targets(), name, weights, before)

    async def unload(self, name: str) -> str:
        """Unload on every engine; any refusal is the answer (each engine refuses alike)."""
        served = self.status().find(name)
        return await changes.unload_everywhere(self._change_targets(), name, served)

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport:
        """On every engine or none: any refusal stops the shadows the others started."""
        engines = self._change_targets()
        changes.require_every_engine(engines, "a shadow")
        outcomes = await changes.every_engine_or_none(
            engines,
            ("shadow_start", {"name": name, "version": version, "percent": percent}),
            ("shadow_stop", {"name": name}),
        )
        return ShadowReport.summed([ShadowReport.from_wire(outcome) for outcome in outcomes])

    async def shadow_report(self, name: str) -> ShadowReport:
        return await self._shadow_everywhere("shadow_report", name)

    async def traffic(self, name: str) -> TrafficReport:
        """Every active engine's answers summed (an engine restarted since counts from its
        start)."""
        engines = self._active
        if not engines:
            raise self.status().refusal()
        reports = await asyncio.gather(
            *(engine.control("traffic", name=name) for engine in engines)
        )
        return TrafficReport.summed([TrafficReport.from_wire(report) for report in reports])

    async def stop_shadow(self, name: str) -> ShadowReport:
        return await self._shadow_everywhere("shadow_stop", name)

    async def _shadow_everywhere(self, op: str, name: str) -> ShadowReport:
        """``op`` on every engine: the reports of those that have the shadow, summed; the
        first refusal when none has (an engine restarted since has none)."""
        engines = self._change_targets()
        outcomes = await asyncio.gather(
            *(engine.control(op, name=name) for engine in engines), return_exceptions=True
        )
        reports = [
            ShadowReport.from_wire(outcome)
            for outcome in outcomes
            if not isinstance(outcome, BaseException)
        ]
        if reports:
            return ShadowReport.summed(reports)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        raise changes.most_telling(failures) if failures else self.status().refusal()

    def _change_targets(self) -> list[EngineConnection]:
        """Every engine, standbys included, but one that failed to load (``engines.py``)."""
        statuses = [connection.status for connection in self._connections]
        return [self._connections[i] for i in change_targets(statuses)]
