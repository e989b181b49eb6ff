"""The engine's end of the bridge: a local socket that front ends connect to.

Each front end keeps one connection to each engine. The requests of a SUBMITS frame (all a
front end submitted in one event-loop turn) are queued in the engine at once (no task, future
or timer per request); each batch's answers for one front end go back in one ANSWERS frame
(``contract.py`` types both), as do the refusals of one SUBMITS frame. A GENERATES frame starts
generation streams; the tokens one generation step gave this front end's streams go back in one
TOKENS frame, as does each stream's refusal or error. A CANCELS frame withdraws requests, which
drops them from the queue if they have not run yet, and ends streams (their slots are free at
the next step). A CONTROL frame runs one step of a version switch (``prepare``, or
``prepare_split`` for a traffic split, then ``commit`` or ``abort``), or unloads a model
(``unload``), and is answered by a REPLY. The engine's status goes to every front end when it
connects, whenever it changes, and once a ``heartbeat_interval_s``, so that a front end can
tell a hung engine from a quiet one.

When a front end's connection closes, its requests still queued are dropped and its streams
cancelled (nobody is left to answer), and a switch it prepared but did not finish is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from service.bridge import contract, wire
from service.bridge.interface import (
    EngineStatus,
    GeneratedTokens,
    GenerateRequest,
    ShadowReport,
    SwitchResult,
)
from service.errors import ConflictError, InvalidInputError, ServiceError
from service.manifest import Manifest, manifest_summary
from service.tensors import NamedArrays
from service.traffic_window import TrafficReport

logger = logging.getLogger(__name__)

#: A switch prepared and neither committed nor aborted within this long is aborted, so a front
#: end that hangs between the two steps cannot block every later switch.
PREPARED_TIMEOUT_S = 120.0


class QueuedRequest(Protocol):
    """A request queued in an engine (``engine.batcher.Ticket``)."""

    tag: Any
    """The bridge's: the request's call id and the version computing it."""
    order: Sequence[int] | None
    """Where each of its rows is among its chunks' rows joined (None: in order)."""

    def outputs(self) -> list[NamedArrays]:
        """Its outputs, one per chunk; raises its error, or ``CancelledError`` if withdrawn."""
        ...

    def cancel(self) -> None:
        """Withdraw it: dropped from the queue unless it is running already."""
        ...

    def traced_batches(self) -> tuple[tuple[str, int], ...]: ...


class FrontEnd(Protocol):
    """A front end's connection, as an engine hands it finished requests: once per batch."""

    def deliver(self, tickets: Sequence[Any]) -> None: ...


class TokenSink(Protocol):
    """Where one stream's tokens go (``engine.generation_loop.TokenSink``)."""

    def tokens(self, item: GeneratedTokens) -> None: ...

    def failed(self, error: ServiceError) -> None: ...


class Generation(Protocol):
    """A generative version's streams (``engine.generation_loop.GenerationLoop``)."""

    def submit(self, request: GenerateRequest, sink: TokenSink) -> int:
        """Start a stream; its key for ``cancel``. Raises the ``ServiceError`` refusing it."""
        ...

    def cancel(self, key: int) -> None: ...


class EngineBackend(Protocol):
    """What the bridge needs of an engine (``engine.Engine`` provides it)."""

    def status(self) -> EngineStatus: ...

    def generation_of(self, model: str, version: str) -> Generation:
        """The streams of ``model`` for requests prepared for ``version``; raises the
        ``ServiceError`` refusing them."""
        ...

    def enqueue_frame(
        self, requests: Sequence[tuple[contract.Submit, NamedArrays]], frontend_load: int, sink: Any
    ) -> Sequence[tuple[QueuedRequest, str] | ServiceError]:
        """Queue the requests of one frame from the front end ``sink``, which gets each back
        when answered: for each, in order, its queued request and version, or its refusal."""
        ...

    def frontend_left(self, sink: Any) -> None:
        """The front end ``sink`` (of ``enqueue_frame``) closed its connection."""
        ...

    async def prepare(self, name: str, version: str) -> Manifest: ...

    async def prepare_split(self, name: str, weights: dict[str, int]) -> Manifest: ...

    async def commit(self) -> SwitchResult: ...

    async def abort(self) -> None: ...

    async def unload(self, name: str) -> str: ...

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport: ...

    async def shadow_report(self, name: str) -> ShadowReport: ...

    async def traffic(self, name: str) -> TrafficReport: ...

    async def stop_shadow(self, name: str) -> ShadowReport: ...


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
        if op in ("prepare", "prepare_split"):
            if op == "prepare":
                manifest = await self.backend.prepare(str(args["name"]), str(args["version"]))
            else:
                weights = {str(v): int(w) for v, w in dict(args["weights"]).items()}
                manifest = await self.backend.prepare_split(str(args["name"]), weights)
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
        if op == "shadow_start":
            started = self.backend.start_shadow(
                str(args["name"]), str(args["version"]), int(str(args["percent"]))
            )
            return (await started).to_wire()
        if op == "traffic":
            return (await self.backend.traffic(str(args["name"]))).to_wire()
        if op == "shadow_report":
            return (await self.backend.shadow_report(str(args["name"]))).to_wire()
        if op == "shadow_stop":
            return (await self.backend.stop_shadow(str(args["name"]))).to_wire()
        raise InvalidInputError(f"unknown bridge control operation {op!r}")

    def connection_opened(self, connection: _Connection) -> None:
        self._connections.add(connection)
        self._all_closed.clear()

    def connection_closed(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        self.backend.frontend_left(connection)
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
        self._streams: dict[int, tuple[Generation, int]] = {}
        """Each stream of this front end not finished: its generation and key there."""
        self._tokens: list[contract.Tokens] = []
        """Tokens of this event-loop turn (one generation step's), sent at its end."""

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
        streams, self._streams = self._streams, {}
        for generation, key in streams.values():
            generation.cancel(key)
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
        if frame.kind == wire.Kind.SUBMITS:
            self._submitted(frame)
        elif frame.kind == wire.Kind.GENERATES:
            for generate in contract.decode_generates(frame.typed_header).requests:
                self._generate(generate)
        elif frame.kind == wire.Kind.CANCELS:
            for call_id in contract.decode_cancels(frame.typed_header).ids:
                queued = self._queued.get(call_id)
                if queued is not None:
                    queued.cancel()
                stream = self._streams.pop(call_id, None)
                if stream is not None:
                    stream[0].cancel(stream[1])
        elif frame.kind == wire.Kind.CONTROL:
            header = frame.header
            call_id = int(header["id"])
            self._start(call_id, self._control(call_id, header["op"], header.get("args") or {}))
        else:
            raise wire.ProtocolError(f"a front end does not send {frame.kind.name} frames")

    def _generate(self, generate: contract.Generate) -> None:
        """Start one stream; a refusal goes back as its TOKENS entry."""
        request = generate.request()
        try:
            generation = self._server.backend.generation_of(request.model, request.version)
            key = generation.submit(request, _StreamSink(self, generate.id))
        except ServiceError as error:
            self._send_tokens(contract.Tokens(generate.id, error=contract.WireError.of(error)))
            return
        self._streams[generate.id] = (generation, key)

    def stream_tokens(self, call_id: int, item: GeneratedTokens) -> None:
        if item.finish_reason is not None:
            self._streams.pop(call_id, None)
        self._send_tokens(contract.Tokens.of(call_id, item))

    def stream_failed(self, call_id: int, error: ServiceError) -> None:
        self._streams.pop(call_id, None)
        self._send_tokens(contract.Tokens(call_id, error=contract.WireError.of(error)))

    def _send_tokens(self, tokens: contract.Tokens) -> None:
        """Gather the tokens of this turn (a generation step delivers all its streams' in
        one turn) and send them in one frame at its end."""
        if not self._tokens:
            asyncio.get_running_loop().call_soon(self._flush_tokens)
        self._tokens.append(tokens)

    def _flush_tokens(self) -> None:
        tokens, self._tokens = self._tokens, []
        if tokens and self._writer is not None:
            header = contract.encode(contract.TokenFrame(tokens))
            self._writer.send_now(wire.Kind.TOKENS, header)

    def _start(self, call_id: int, work: Any) -> None:
        call = asyncio.get_running_loop().create_task(work)
        self._calls[call_id] = call
        call.add_done_callback(lambda _: self._calls.pop(call_id, None))

    def _submitted(self, frame: wire.Frame) -> None:
        """Queue every request of a SUBMITS frame; refusals go back in one ANSWERS frame."""
        submits = contract.decode_submits(frame.typed_header)
        data = frame.data
        requests = list(
            zip(submits.requests, contract.unpack_all(submits.requests, data), strict=True)
        )
        outcomes = self._server.backend.enqueue_frame(requests, submits.load, self)
        refused: list[contract.Answer] = []
        queued = self._queued
        # Asked once in C: a frame with no refusal (the common case) asks no request's outcome.
        any_refused = any(map(isinstance, outcomes, itertools.repeat(ServiceError)))
        for submit, outcome in zip(submits.requests, outcomes, strict=True):
            if any_refused and isinstance(outcome, ServiceError):
                refused.append(contract.Answer(submit.id, error=contract.WireError.of(outcome)))
                continue
            # Not a ServiceError (refused above), though mypy cannot narrow through ``any_refused``.
            ticket, version = outcome  # type: ignore[misc]
            ticket.tag = (submit.id, version)
            queued[submit.id] = ticket
        if refused:
            self._send_answers(refused, ())

    def deliver(self, tickets: Sequence[QueuedRequest]) -> None:
        """The requests one batch finished for this front end (or one a deadline or a cancel
        did): their answers in one frame, the arrays of all packed at once."""
        answers: list[contract.Answer] = []
        # Each computed request's id, version, traced batches and outputs, answered once the
        # outputs of all are packed.
        computed: list[tuple[int, str, tuple[tuple[str, int], ...], NamedArrays]] = []
        queued = self._queued
        for ticket in tickets:
            call_id, version = ticket.tag  # (int, str), as _submitted set it
            queued.pop(call_id, None)
            outcome = self._outcome(call_id, ticket)
            if outcome is None:
                continue
            if isinstance(outcome, NamedArrays):
                computed.append((call_id, version, ticket.traced_batches(), outcome))
            else:
                answers.append(outcome)
        packer = contract.DataPacker()
        if computed:
            specs = packer.pack_all([each[3] for each in computed])
            answers += [
                contract.Answer(call_id, version, arrays, list(batches))
                if batches  # traced
                else contract.Answer(call_id, version, arrays)
                for (call_id, version, batches, _), arrays in zip(computed, specs, strict=True)
            ]
        if answers:
            self._send_answers(answers, packer.buffers)

    def _outcome(self, call_id: int, ticket: QueuedRequest) -> NamedArrays | contract.Answer | None:
        """The request's outputs, or its error's answer (None: withdrawn, answer nobody)."""
        try:
            chunks = ticket.outputs()
        except asyncio.CancelledError:
            return None  # withdrawn by its front end, which expects no answer
        except ServiceError as error:
            return contract.Answer(call_id, error=contract.WireError.of(error))
        except Exception:
            logger.exception("bridge_request_failed", extra={"call_id": call_id})
            failure = ServiceError("internal error in the engine")
            return contract.Answer(call_id, error=contract.WireError.of(failure))
        return NamedArrays.concatenate(chunks, ticket.order)

    def _send_answers(
        self, answers: list[contract.Answer], data: Sequence[bytes | memoryview]
    ) -> None:
        if self._writer is not None:
            header = contract.encode(contract.Answers(answers))
            self._writer.send_now(wire.Kind.ANSWERS, header, data)

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


class _StreamSink:
    """One stream's tokens, to the connection of the front end that asked for them."""

    __slots__ = ("_call_id", "_connection")

    def __init__(self, connection: _Connection, call_id: int) -> None:
        self._connection = connection
        self._call_id = call_id

    def tokens(self, item: GeneratedTokens) -> None:
        self._connection.stream_tokens(self._call_id, item)

    def failed(self, error: ServiceError) -> None:
        self._connection.stream_failed(self._call_id, error)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("prepared_switch_abort_failed", exc_info=task.exception())
