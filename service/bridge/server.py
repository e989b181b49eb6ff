"""The engine's end of the bridge: a local socket that front ends connect to.

Each front end keeps one connection to each engine. A SUBMIT frame is queued in the engine at
once (no task per request) and answered by a RESULT or an ERROR frame when its batch has run;
a CANCEL frame withdraws it, which drops it from the queue if it has not run yet. A CONTROL
frame runs one step of a version switch (``prepare``, ``commit``, ``abort``), or unloads a
model (``unload``), and is answered by a REPLY. The engine's status goes to every front end
when it connects, whenever it changes, and once a ``heartbeat_interval_s``, so that a front
end can tell a hung engine from a quiet one.

When a front end's connection closes, its requests still queued are dropped (nobody is left
to answer) and a switch it prepared but did not finish is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Hashable
from functools import partial
from pathlib import Path
from typing import Any, Protocol, Self, cast

from service.bridge import wire
from service.bridge.interface import EngineStatus, InferenceRequest, SwitchResult
from service.errors import ConflictError, InvalidInputError, ServiceError
from service.manifest import Manifest, manifest_summary
from service.tensors import NamedArrays

logger = logging.getLogger(__name__)

#: A switch prepared and neither committed nor aborted within this long is aborted, so a front
#: end that hangs between the two steps cannot block every later switch.
PREPARED_TIMEOUT_S = 120.0


class QueuedRequest(Protocol):
    """A request queued in an engine (``engine.batching.Ticket``)."""

    def add_done_callback(self, callback: Callable[[Self], None]) -> None: ...

    def outputs(self) -> list[NamedArrays]: ...

    def cancel(self) -> None: ...

    def batches(self) -> tuple[tuple[str, int], ...]: ...


class EngineBackend(Protocol):
    """What the bridge needs of an engine (``engine.Engine`` provides it)."""

    def status(self) -> EngineStatus: ...

    def enqueue(self, request: InferenceRequest, source: Hashable) -> tuple[QueuedRequest, str]:
        """Queue ``request`` from the front end ``source``."""
        ...

    async def prepare(self, name: str, version: str) -> Manifest: ...

    async def commit(self) -> SwitchResult: ...

    async def abort(self) -> None: ...

    async def unload(self, name: str) -> str: ...


class BridgeServer:
    """Serves one engine to every front end, on a Unix socket at ``path``."""

    def __init__(self, backend: EngineBackend, path: Path, heartbeat_interval_s: float) -> None:
        self.backend = backend
        self.path = path
        self._heartbeat_interval_s = heartbeat_interval_s
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._status_wire: dict[str, Any] | None = None
        self._prepared_by: _Connection | None = None
        self._prepared_timer: asyncio.TimerHandle | None = None
        self._all_closed = asyncio.Event()
        self._all_closed.set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.path.unlink(missing_ok=True)  # left by an engine that was killed
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=str(self.path))
        os.chmod(self.path, 0o600)  # only this user's front ends
        self._heartbeat = loop.create_task(self._send_heartbeats(), name="bridge-heartbeat")

    async def wait_for_frontends_to_leave(self, timeout_s: float) -> bool:
        """Wait until no front end is connected (they have drained), at most ``timeout_s``;
        whether they all left."""
        try:
            await asyncio.wait_for(self._all_closed.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def status_changed(self) -> None:
        """Send the engine's new status to every front end now."""
        self._status_wire = None
        for connection in self._connections:
            connection.send_status()

    def status_wire(self) -> dict[str, Any]:
        if self._status_wire is None:
            self._status_wire = self.backend.status().to_wire()
        return self._status_wire

    async def close(self) -> None:
        """Stop accepting, then close every connection (after the answers already queued)."""
        if self._server is not None:
            self._server.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for connection in list(self._connections):
            connection.close()
        self.path.unlink(missing_ok=True)

    async def _send_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            for connection in self._connections:
                connection.send_status()

    # ----------------------------------------------------------------- switches

    async def control(self, connection: _Connection, op: str, args: dict[str, Any]) -> object:
        """One step of a version switch, for the front end on ``connection``."""
        if op == "prepare":
            manifest = await self.backend.prepare(str(args["name"]), str(args["version"]))
            self._prepared_by = connection
            self._prepared_timer = asyncio.get_running_loop().call_later(
                PREPARED_TIMEOUT_S, self._abort_abandoned_switch, connection
            )
            return manifest_summary(manifest)
        if op in ("commit", "abort"):
            if self._prepared_by is not connection:
                raise ConflictError(f"nothing prepared by this front end to {op}")
            self._forget_prepare()
            if op == "abort":
                await self.backend.abort()
                return None
            result = await self.backend.commit()
            return {"serving": manifest_summary(result.serving), "replaced": result.replaced}
        if op == "unload":
            return {"unloaded": await self.backend.unload(str(args["name"]))}
        raise InvalidInputError(f"unknown bridge control operation {op!r}")

    def connection_opened(self, connection: _Connection) -> None:
        self._connections.add(connection)
        self._all_closed.clear()

    def connection_closed(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._all_closed.set()
        if self._prepared_by is connection:
            self._abort_abandoned_switch(connection)

    def _abort_abandoned_switch(self, connection: _Connection) -> None:
        if self._prepared_by is not connection:
            return
        self._forget_prepare()
        logger.warning("prepared_switch_abandoned")
        task = asyncio.get_running_loop().create_task(self.backend.abort())
        task.add_done_callback(_log_failure)

    def _forget_prepare(self) -> None:
        self._prepared_by = None
        if self._prepared_timer is not None:
            self._prepared_timer.cancel()
            self._prepared_timer = None


class _Connection(asyncio.Protocol):
    """One front end's connection: its frames in, its answers out."""

    def __init__(self, server: BridgeServer) -> None:
        self._server = server
        self._reader = wire.FrameReader()
        self._writer: wire.FrameWriter | None = None
        self._transport: asyncio.Transport | None = None
        self._queued: dict[int, QueuedRequest] = {}
        self._calls: dict[int, asyncio.Task[None]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._writer = wire.FrameWriter(self._transport, asyncio.get_running_loop())
        self._server.connection_opened(self)
        self.send_status()

    def connection_lost(self, error: Exception | None) -> None:
        # Nobody is left to answer: drop this front end's requests from the queue.
        for queued in list(self._queued.values()):
            queued.cancel()
        for call in self._calls.values():
            call.cancel()
        self._server.connection_closed(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def send_status(self) -> None:
        if self._writer is not None:
            self._writer.send(wire.Kind.STATUS, self._server.status_wire())

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
            for frame in frames:
                self._handle(frame)
        except wire.ProtocolError as error:
            logger.error("bridge_protocol_error", extra={"error": str(error)})
            self.close()

    def _handle(self, frame: wire.Frame) -> None:
        header = frame.header
        if frame.kind == wire.Kind.SUBMIT:
            call_id = int(header["id"])
            request = InferenceRequest(
                model=header["model"],
                version=header["version"],
                instances=wire.arrays_from(header, frame.data),
                group=tuple(header["group"]),
                cost_per_row=int(header["cost"]),
                priority=header["priority"],
                deadline_s=float(header["deadline"]),
                request_id=header["request_id"],
                frontend_load=int(header.get("load", 1)),
                traceparent=header.get("trace"),
            )
            self._enqueue(call_id, request)
        elif frame.kind == wire.Kind.CANCEL:
            queued = self._queued.get(int(header["id"]))
            if queued is not None:
                queued.cancel()
        elif frame.kind == wire.Kind.CONTROL:
            call_id = int(header["id"])
            self._start(call_id, self._control(call_id, header["op"], header.get("args") or {}))
        else:
            raise wire.ProtocolError(f"a front end does not send {frame.kind.name} frames")

    def _start(self, call_id: int, work: Any) -> None:
        call = asyncio.get_running_loop().create_task(work)
        self._calls[call_id] = call
        call.add_done_callback(lambda _: self._calls.pop(call_id, None))

    def _enqueue(self, call_id: int, request: InferenceRequest) -> None:
        assert self._writer is not None
        try:
            queued, version = self._server.backend.enqueue(request, id(self))
        except ServiceError as error:
            self._writer.send(wire.Kind.ERROR, {"id": call_id, "error": error.to_wire()})
            return
        self._queued[call_id] = queued
        queued.add_done_callback(partial(self._answer, call_id, version, request.request_id))

    def _answer(self, call_id: int, version: str, request_id: str, queued: QueuedRequest) -> None:
        """The request's batch has run (or it failed, expired or was cancelled): answer it."""
        self._queued.pop(call_id, None)
        writer = self._writer
        if writer is None:
            return
        try:
            chunks = queued.outputs()
        except asyncio.CancelledError:
            return  # withdrawn by its front end, which expects no answer
        except ServiceError as error:
            writer.send(wire.Kind.ERROR, {"id": call_id, "error": error.to_wire()})
            return
        except Exception:
            logger.exception("bridge_request_failed", extra={"request_id": request_id})
            failure = ServiceError("internal error in the engine")
            writer.send(wire.Kind.ERROR, {"id": call_id, "error": failure.to_wire()})
            return
        header, data = wire.arrays_frame(NamedArrays.concatenate(chunks))
        header["id"] = call_id
        header["version"] = version
        batches = queued.batches()
        if batches:
            header["batches"] = batches
        writer.send(wire.Kind.RESULT, header, data)

    async def _control(self, call_id: int, op: str, args: dict[str, Any]) -> None:
        assert self._writer is not None
        try:
            result = await self._server.control(self, op, args)
        except ServiceError as error:
            self._writer.send(wire.Kind.REPLY, {"id": call_id, "error": error.to_wire()})
        except Exception as error:
            logger.exception("bridge_control_failed", extra={"op": op})
            failure = ServiceError(f"{op} failed in the engine: {type(error).__name__}")
            self._writer.send(wire.Kind.REPLY, {"id": call_id, "error": failure.to_wire()})
        else:
            self._writer.send(wire.Kind.REPLY, {"id": call_id, "result": result})


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("prepared_switch_abort_failed", exc_info=task.exception())
