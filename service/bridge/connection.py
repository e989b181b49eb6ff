"""The front end's connection to one engine process, re-established whenever lost.

A connection that is lost, or an engine that has gone quiet for longer than the heartbeat
timeout, fails every request waiting on it at once with 503 and ``Retry-After`` (nothing waits
out its deadline on a dead engine); the connection is then retried until the engine is back.
Requests submitted in one event-loop turn go in one SUBMITS frame, generation requests in one
GENERATES frame, cancels in one CANCELS frame; each ANSWERS frame answers several, each TOKENS
frame carries a generation step's tokens for several streams. Deadlines: one heap and one timer
per connection, not a timer per request; a request past its deadline is answered 504 here and
withdrawn in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from service.bridge import contract, wire
from service.bridge.interface import (
    EngineStatus,
    GenerateRequest,
    InferenceRequest,
    InferenceResult,
    Phase,
)
from service.bridge.streams import TokenQueue
from service.errors import DeadlineExceededError, EngineUnavailableError, error_from_wire

logger = logging.getLogger("service.bridge.client")

#: First and longest wait between attempts to reach an engine that is not there. A refused
#: connection to a Unix socket costs microseconds, so the front end keeps trying every 0.1 s
#: and reaches a restarted engine as soon as its socket is up.
RECONNECT_FIRST_S = 0.05
RECONNECT_LONGEST_S = 0.1
#: A switch step (loading and warming up a version) may take this long on each engine.
CONTROL_TIMEOUT_S = 900.0


class EngineConnection(asyncio.Protocol):
    """One front end's connection to one engine process, re-established whenever lost."""

    def __init__(
        self,
        path: Path,
        device: str,
        heartbeat_timeout_s: float,
        on_status: Callable[[], None],
        request_timeout_ms: float = 0.0,
    ) -> None:
        """``request_timeout_ms``: named in the 504 of a request past its deadline."""
        self.path = path
        self._request_timeout_ms = request_timeout_ms
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._armed_s = float("inf")
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
        self._streams: dict[int, TokenQueue] = {}
        """Each generation stream not finished, by call id."""
        self._generates: list[contract.Generate] = []
        """Generation requests of this event-loop turn, sent together at its end."""
        self._controls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = wire.FrameReader()
        self._writer: wire.FrameWriter | None = None
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Event = asyncio.Event()
        self.last_heard_s = 0.0
        """When the engine last sent anything (``time.monotonic()``): a frame of any kind,
        a heartbeat repeating its status too; kept once the connection is lost."""
        self._status_document: dict[str, Any] | None = None
        """The engine's last STATUS header, as sent: ``status`` was built from it."""

    @property
    def outstanding(self) -> int:
        return len(self._requests) + len(self._streams)

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
            quiet_s = time.monotonic() - self.last_heard_s
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
        self.last_heard_s = time.monotonic()
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
        self._status_document = None
        requests, self._requests = self._requests, {}
        controls, self._controls = self._controls, {}
        streams, self._streams = self._streams, {}
        self._submits, self._cancels, self._deadlines = [], [], []
        self._generates = []
        self._packer = contract.DataPacker()
        for future in requests.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(f"{detail}; retry shortly"))
        for reply in controls.values():
            if not reply.done():
                reply.set_exception(EngineUnavailableError(f"{detail}; retry shortly"))
        for stream in streams.values():
            stream.failed(EngineUnavailableError(f"{detail}; retry shortly"))
        self._on_status()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ----------------------------------------------------------------- frames in

    def data_received(self, data: bytes) -> None:
        self.last_heard_s = time.monotonic()
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
            elif frame.kind == wire.Kind.TOKENS:
                try:
                    self._tokens_received(frame)
                except wire.ProtocolError as error:
                    logger.error("bridge_protocol_error", extra={"error": str(error)})
                    self.close()
                    return
            elif frame.kind == wire.Kind.REPLY:
                reply = self._controls.pop(int(frame.header["id"]), None)
                if reply is not None and not reply.done():
                    reply.set_result(frame.header)
            elif frame.kind == wire.Kind.STATUS:
                self._status_received(frame.header)

    def _status_received(self, document: dict[str, Any]) -> None:
        """A heartbeat repeats the status the engine sent last: rebuilding it (its manifests
        validated by pydantic) and telling every listener four times a second is skipped."""
        if document == self._status_document:
            return
        self.status = EngineStatus.from_wire(document)
        self._status_document = document
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

    def _tokens_received(self, frame: wire.Frame) -> None:
        """A generation step's tokens for our streams (or a stream's refusal or error)."""
        streams = self._streams
        for tokens in contract.decode_tokens(frame.typed_header).streams:
            stream = streams.get(tokens.id)
            if stream is None:
                continue  # cancelled here meanwhile
            if tokens.error is not None:
                del streams[tokens.id]
                stream.failed(tokens.error.rebuilt())
                continue
            if tokens.finish_reason is not None:
                del streams[tokens.id]
            stream.tokens(tokens.item())

    # ----------------------------------------------------------------- frames out

    def generate(self, request: GenerateRequest) -> tuple[int, TokenQueue]:
        """Queue ``request`` for this turn's GENERATES frame; its tokens come to the queue."""
        if self._writer is None:
            raise EngineUnavailableError("the engine is not connected; retry shortly")
        call_id = next(self._ids)
        stream = TokenQueue()
        self._streams[call_id] = stream
        if not self._generates:
            asyncio.get_running_loop().call_soon(self._send_generates)
        self._generates.append(contract.Generate.of(call_id, request))
        return call_id, stream

    def _send_generates(self) -> None:
        generates, self._generates = self._generates, []
        if generates:
            header = contract.encode(contract.Generates(generates))
            self._write_now(wire.encode_typed(wire.Kind.GENERATES, header))

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
        self._watch_deadline(request.deadline_s, call_id)
        return call_id, future

    def _watch_deadline(self, deadline_s: float, call_id: int) -> None:
        """One heap and one timer for every request's deadline (not a timer each)."""
        heap = self._deadlines
        while heap and heap[0][1] not in self._requests:  # answered already
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline_s, call_id))
        if deadline_s < self._armed_s:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._armed_s = deadline_s
            delay_s = max(0.0, deadline_s - time.monotonic())
            self._deadline_timer = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def _expire(self) -> None:
        """504 for every request past its deadline; the engine drops them."""
        self._deadline_timer, self._armed_s = None, float("inf")
        heap, now_s = self._deadlines, time.monotonic()
        while heap and (heap[0][0] <= now_s or heap[0][1] not in self._requests):
            _, call_id = heapq.heappop(heap)
            future = self._requests.get(call_id)
            if future is not None and not future.done():
                self.cancel(call_id)
                future.set_exception(
                    DeadlineExceededError(
                        f"the request was not answered within {self._request_timeout_ms:.0f} ms"
                    )
                )
        if heap:
            self._watch_deadline(*heapq.heappop(heap))

    def _send_submits(self) -> None:
        submits, self._submits = self._submits, []
        packer, self._packer = self._packer, contract.DataPacker()
        if submits:
            header = contract.encode(contract.Submits(load=self._load, requests=submits))
            self._write_now(wire.encode_typed(wire.Kind.SUBMITS, header, packer.buffers))

    def _write_now(self, frame: list[bytes | memoryview]) -> None:
        """Write ``frame`` now: called at the end of the turn that gathered it already, so
        the writer's own end-of-turn queue would only hold it one more loop turn."""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.writelines(frame)

    def cancel(self, call_id: int) -> None:
        """Stop waiting for ``call_id``; the engine drops it if it has not run yet, or ends
        its stream (one not sent yet is never sent)."""
        request = self._requests.pop(call_id, None)
        stream = self._streams.pop(call_id, None)
        if (request is None and stream is None) or self._writer is None:
            return
        if any(submit.id == call_id for submit in self._submits):
            self._submits = [submit for submit in self._submits if submit.id != call_id]
            return  # its arrays still go in the frame, unreferenced: cheaper than repacking
        if any(generate.id == call_id for generate in self._generates):
            self._generates = [generate for generate in self._generates if generate.id != call_id]
            return
        if not self._cancels:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._cancels.append(call_id)

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        if cancels:
            self._write_now(
                wire.encode_typed(wire.Kind.CANCELS, contract.encode(contract.Cancels(ids=cancels)))
            )

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
