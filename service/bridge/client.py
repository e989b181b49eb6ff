"""The front end's end of the bridge: one connection to each engine, as one ``EngineClient``.

Each request goes to the ready engine with the fewest requests outstanding from this front
end. A connection that is lost, or an engine that has gone quiet for longer than the
heartbeat timeout, fails every request waiting on it at once with 503 and ``Retry-After``
(nothing waits out its deadline on a dead engine); the connection is then retried until the
engine is back. A request is answered 504 at its deadline here too, and a request whose client
left is cancelled in the engine, so it is never computed.

A version switch reaches every engine or none: each engine first loads and warms up the
version beside the one it serves (``prepare``); only when all have it does each switch
(``commit``); if any refuses, the others discard it (``abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from service.bridge import contract, wire
from service.bridge.interface import (
    EngineStatus,
    InferenceRequest,
    InferenceResult,
    Phase,
    SwitchResult,
)
from service.errors import (
    DeadlineExceededError,
    EngineUnavailableError,
    ServiceError,
    error_from_wire,
)
from service.manifest import Manifest

logger = logging.getLogger(__name__)

#: First and longest wait between attempts to reach an engine that is not there.
RECONNECT_FIRST_S = 0.05
RECONNECT_LONGEST_S = 1.0
#: A switch step (loading and warming up a version) may take this long on each engine.
CONTROL_TIMEOUT_S = 900.0
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


class EngineConnection(asyncio.Protocol):
    """One front end's connection to one engine process, re-established whenever lost."""

    def __init__(
        self,
        path: Path,
        device: str,
        heartbeat_timeout_s: float,
        on_status: Callable[[], None],
    ) -> None:
        self.path = path
        self.status = EngineStatus(phase="connecting", device=device)
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_status = on_status
        self._ids = itertools.count(1)
        self._requests: dict[int, asyncio.Future[InferenceResult]] = {}
        self._submits: list[contract.Submit] = []
        """Requests of this event-loop turn, sent together at its end (one frame)."""
        self._packer = contract.DataPacker()
        self._load = 0
        self._cancels: list[int] = []
        self._controls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = wire.FrameReader()
        self._writer: wire.FrameWriter | None = None
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Event = asyncio.Event()
        self._last_heard_s = 0.0

    @property
    def outstanding(self) -> int:
        return len(self._requests)

    # ----------------------------------------------------------------- connecting

    async def run(self) -> None:
        """Connect, serve until the connection is lost, and connect again; until cancelled."""
        loop = asyncio.get_running_loop()
        wait_s = RECONNECT_FIRST_S
        while True:
            try:
                await loop.create_unix_connection(lambda: self, str(self.path))
            except OSError:
                await asyncio.sleep(wait_s)
                wait_s = min(RECONNECT_LONGEST_S, wait_s * 2)
                continue
            wait_s = RECONNECT_FIRST_S
            await self._watch_heartbeat()

    async def _watch_heartbeat(self) -> None:
        """Return once the connection is lost; close it when the engine goes quiet too long."""
        while not self._lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), timeout=self._heartbeat_timeout_s / 4)
            quiet_s = time.monotonic() - self._last_heard_s
            if not self._lost.is_set() and quiet_s > self._heartbeat_timeout_s:
                logger.error(
                    "engine_unresponsive",
                    extra={"engine": str(self.path), "quiet_s": round(quiet_s, 1)},
                )
                self._fail_everything(
                    "down", f"the engine sent nothing for {quiet_s:.1f} s (heartbeat timeout)"
                )
                if self._transport is not None:
                    self._transport.abort()
                await self._lost.wait()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._writer = wire.FrameWriter(self._transport, asyncio.get_running_loop())
        self._reader = wire.FrameReader()
        self._last_heard_s = time.monotonic()
        self._lost.clear()
        logger.info("engine_connected", extra={"engine": str(self.path)})

    def connection_lost(self, error: Exception | None) -> None:
        self._writer = None
        self._transport = None
        if self.status.phase != "down":  # given up already (heartbeat): keep that reason
            self._fail_everything("down", "the connection to the engine was lost")
        self._lost.set()
        logger.warning("engine_connection_lost", extra={"engine": str(self.path)})

    def _fail_everything(self, phase: Phase, detail: str) -> None:
        """The engine is gone: answer every request waiting on it now (503, Retry-After)."""
        self.status = EngineStatus(phase=phase, device=self.status.device, detail=detail)
        requests, self._requests = self._requests, {}
        controls, self._controls = self._controls, {}
        self._submits, self._cancels = [], []
        self._packer = contract.DataPacker()
        for future in requests.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(f"{detail}; retry shortly"))
        for reply in controls.values():
            if not reply.done():
                reply.set_exception(EngineUnavailableError(f"{detail}; retry shortly"))
        self._on_status()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ----------------------------------------------------------------- frames in

    def data_received(self, data: bytes) -> None:
        self._last_heard_s = time.monotonic()
        try:
            frames = self._reader.feed(data)
        except wire.ProtocolError as error:
            logger.error("bridge_protocol_error", extra={"error": str(error)})
            self.close()
            return
        for frame in frames:
            if frame.kind == wire.Kind.ANSWERS:
                try:
                    self._answered(frame)
                except wire.ProtocolError as error:
                    logger.error("bridge_protocol_error", extra={"error": str(error)})
                    self.close()
                    return
            elif frame.kind == wire.Kind.REPLY:
                reply = self._controls.pop(int(frame.header["id"]), None)
                if reply is not None and not reply.done():
                    reply.set_result(frame.header)
            elif frame.kind == wire.Kind.STATUS:
                self.status = EngineStatus.from_wire(frame.header)
                self._on_status()

    def _answered(self, frame: wire.Frame) -> None:
        """An engine's batch answered these requests of ours (or refused them)."""
        requests = self._requests
        for answer in contract.decode_answers(frame.typed_header).answers:
            future = requests.pop(answer.id, None)
            if future is None or future.done():
                continue  # cancelled or expired here meanwhile
            if answer.error is not None:
                future.set_exception(answer.error.rebuilt())
            else:
                future.set_result(
                    InferenceResult(
                        outputs=contract.unpack(answer.arrays, frame.data),
                        version=answer.version,
                        batches=tuple(answer.batches),
                    )
                )

    # ----------------------------------------------------------------- frames out

    def submit(self, request: InferenceRequest) -> tuple[int, asyncio.Future[InferenceResult]]:
        """Queue ``request`` for this turn's SUBMITS frame; its future gets the answer."""
        if self._writer is None:
            raise EngineUnavailableError("the engine is not connected; retry shortly")
        call_id = next(self._ids)
        future: asyncio.Future[InferenceResult] = asyncio.get_running_loop().create_future()
        self._requests[call_id] = future
        if not self._submits:
            asyncio.get_running_loop().call_soon(self._send_submits)
        self._submits.append(
            contract.Submit(
                id=call_id,
                model=request.model,
                version=request.version,
                priority=request.priority,
                deadline_s=request.deadline_s,
                request_id=request.request_id,
                arrays=self._packer.pack(request.instances),
                trace=request.traceparent,
            )
        )
        self._load = request.frontend_load
        return call_id, future

    def _send_submits(self) -> None:
        submits, self._submits = self._submits, []
        packer, self._packer = self._packer, contract.DataPacker()
        if self._writer is not None and submits:
            header = contract.encode(contract.Submits(load=self._load, requests=submits))
            self._writer.send_typed(wire.Kind.SUBMITS, header, packer.buffers)

    def cancel(self, call_id: int) -> None:
        """Stop waiting for ``call_id``; the engine drops it if it has not run yet (one not
        sent yet is never sent)."""
        if self._requests.pop(call_id, None) is None or self._writer is None:
            return
        if any(submit.id == call_id for submit in self._submits):
            self._submits = [submit for submit in self._submits if submit.id != call_id]
            return  # its arrays still go in the frame, unreferenced: cheaper than repacking
        if not self._cancels:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._cancels.append(call_id)

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        if self._writer is not None and cancels:
            header = contract.encode(contract.Cancels(ids=cancels))
            self._writer.send_typed(wire.Kind.CANCELS, header)

    async def control(self, op: str, **args: object) -> Any:
        """One step of a version switch on this engine; its result, or its ``ServiceError``."""
        if self._writer is None:
            raise EngineUnavailableError(f"the engine at {self.path.name} is not connected")
        call_id = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._controls[call_id] = reply
        self._writer.send(wire.Kind.CONTROL, {"id": call_id, "op": op, "args": args})
        try:
            header = await asyncio.wait_for(reply, timeout=CONTROL_TIMEOUT_S)
        finally:
            self._controls.pop(call_id, None)
        if "error" in header:
            raise error_from_wire(header["error"])
        return header.get("result")


class BridgeClient:
    """Every engine of the server, as one ``EngineClient`` for this front end."""

    def __init__(
        self,
        engines: Sequence[tuple[Path, str]],
        *,
        heartbeat_timeout_s: float,
        request_timeout_ms: float,
        on_status: Callable[[], None] = lambda: None,
    ) -> None:
        """``engines``: the socket path and device of each engine."""
        self._request_timeout_ms = request_timeout_ms
        self._connections = [
            EngineConnection(path, device, heartbeat_timeout_s, self._status_changed)
            for path, device in engines
        ]
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
            connection.close()

    async def wait_until_settled(self) -> EngineStatus:
        """Wait until some engine is ready, or every engine has failed to load."""
        while True:
            status = self.status()
            if status.ready or status.phase == "failed":
                return status
            self._ready_changed.clear()
            await self._ready_changed.wait()

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
        return [connection.status for connection in self._connections]

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        connection = self._pick()
        call_id, future = connection.submit(request)
        loop = asyncio.get_running_loop()
        timer = loop.call_at(
            loop.time() + (request.deadline_s - time.monotonic()),
            _expire,
            future,
            self._request_timeout_ms,
        )
        try:
            return await future
        except (asyncio.CancelledError, DeadlineExceededError):
            connection.cancel(call_id)  # the engine drops it unless it is running already
            raise
        finally:
            timer.cancel()

    def _pick(self) -> EngineConnection:
        """The ready engine with the fewest of this front end's requests outstanding."""
        ready = [c for c in self._connections if c.status.ready]
        if not ready:
            raise self.status().refusal()
        return min(ready, key=lambda connection: connection.outstanding)

    async def switch(self, name: str, version: str) -> SwitchResult:
        """Prepare on every engine, then commit on all of them, or abort on all."""
        self._require_every_engine("a version switch")
        outcomes = await asyncio.gather(
            *(c.control("prepare", name=name, version=version) for c in self._connections),
            return_exceptions=True,
        )
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            prepared = [
                c
                for c, outcome in zip(self._connections, outcomes, strict=True)
                if not isinstance(outcome, BaseException)
            ]
            await asyncio.gather(*(c.control("abort") for c in prepared), return_exceptions=True)
            raise _most_telling(failures)
        results = await asyncio.gather(*(c.control("commit") for c in self._connections))
        first = results[0]
        return SwitchResult(
            serving=Manifest.model_validate(first["serving"]), replaced=first["replaced"]
        )

    async def rollback(self, name: str | None = None) -> SwitchResult:
        return await self.switch(*self.status().rollback_target(name))

    async def unload(self, name: str) -> str:
        """Unload on every engine; any refusal is the answer (each engine refuses alike)."""
        self._require_every_engine("unloading a model")
        outcomes = await asyncio.gather(
            *(c.control("unload", name=name) for c in self._connections),
            return_exceptions=True,
        )
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            raise _most_telling(failures)
        replies = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
        return str(replies[0]["unloaded"])

    def _require_every_engine(self, what: str) -> None:
        down = [c for c in self._connections if not c.status.ready]
        if down:
            phases = ", ".join(f"{c.status.device} {c.status.phase}" for c in down)
            raise EngineUnavailableError(
                f"{what} must reach every engine, and not all are ready ({phases})"
            )


def _expire(future: asyncio.Future[InferenceResult], timeout_ms: float) -> None:
    if not future.done():
        future.set_exception(
            DeadlineExceededError(f"the request was not answered within {timeout_ms:.0f} ms")
        )


def _most_telling(failures: list[BaseException]) -> BaseException:
    """The error to answer a failed switch with: a refusal (422) or conflict (409) says more
    than an engine being away, which says more than anything unexpected."""
    service_errors = [failure for failure in failures if isinstance(failure, ServiceError)]
    for status in (422, 404, 409):
        for failure in service_errors:
            if failure.status_code == status:
                return failure
    return service_errors[0] if service_errors else failures[0]
