"""The bridge's frames: how front ends and engines talk over a local stream socket.

A frame is a 9-byte prefix (header length, data length, kind), a small header, and raw data
bytes: the rows of the requests' or the answers' named arrays, each in C order at an offset
aligned to 16 bytes, whose names, dtypes, shapes and offsets the header gives. Arrays cross
the socket as their bytes, never pickled, and are rebuilt with one copy on arrival. The
headers of requests and answers are typed msgpack (``contract.py``); those of status and
control frames are JSON documents.

``FrameReader`` takes bytes as they come off the socket and returns whole frames; it never
copies a frame's data twice. ``FrameWriter`` gathers the frames written during one turn of the
event loop and hands them to the transport in one call, so a batch of 64 answers costs one
system call rather than 64.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import orjson

_PREFIX = struct.Struct("<IIB")
PREFIX_BYTES = _PREFIX.size
#: Largest header accepted: headers are a few hundred bytes; more means a corrupt stream.
MAX_HEADER_BYTES = 1 << 20
#: Largest data accepted in one frame (the largest request body is 1 GiB; outputs can be
#: larger than inputs).
MAX_DATA_BYTES = 4 << 30


class Kind(IntEnum):
    """What a frame carries. Front end to engine: SUBMITS (the requests of one event-loop
    turn), GENERATES (its generation requests), CANCELS (of either), CONTROL. Engine to front
    end: ANSWERS (a batch's results and errors for this front end), TOKENS (a generation
    step's tokens for this front end's streams), STATUS (on connect, on every change, and as
    a heartbeat), REPLY (to a CONTROL)."""

    CONTROL = 3
    SUBMITS = 4
    CANCELS = 5
    GENERATES = 6
    STATUS = 13
    REPLY = 14
    ANSWERS = 15
    TOKENS = 16

    @property
    def typed(self) -> bool:
        """Its header is a ``contract`` struct (msgpack), not a JSON document."""
        return self in _TYPED


_TYPED = frozenset((Kind.SUBMITS, Kind.CANCELS, Kind.GENERATES, Kind.ANSWERS, Kind.TOKENS))


class ProtocolError(Exception):
    """The peer sent bytes that are not a frame: the connection must be closed."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    header: dict[str, Any]
    """A JSON kind's header; empty for a typed kind."""
    data: bytearray | None = None
    typed_header: bytes = b""
    """A typed kind's header, for ``contract`` to decode."""


Data = Sequence[bytes | memoryview]
#: Each array starts at a multiple of this many bytes within a frame's data, so the arrays
#: rebuilt in place are aligned for every dtype.
ALIGNMENT = 16
#: Frames up to this size are joined into one buffer before they are written.
JOIN_BYTES = 256 << 10


def encode(kind: Kind, header: dict[str, Any], data: Data = ()) -> list[bytes | memoryview]:
    """One frame with a JSON header as the buffers to write (the data is not copied)."""
    return encode_typed(kind, orjson.dumps(header), data)


def encode_typed(kind: Kind, header: bytes, data: Data = ()) -> list[bytes | memoryview]:
    """One frame whose header is encoded already, as the buffers to write."""
    prefix = _PREFIX.pack(len(header), sum(len(part) for part in data), kind)
    return [prefix + header, *data]


class FrameReader:
    """Splits a byte stream into frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: bytearray | None = None
        self._pending: tuple[Kind, dict[str, Any], bytes, int] | None = None

    def feed(self, chunk: bytes) -> list[Frame]:
        """The frames completed by ``chunk``; raises ``ProtocolError`` on a corrupt stream."""
        frames: list[Frame] = []
        view = memoryview(chunk)
        while view:
            if self._pending is not None:
                view = self._fill_data(view, frames)
                continue
            self._buffer += view
            view = memoryview(b"")
            self._split_buffer(frames)
        return frames

    def _split_buffer(self, frames: list[Frame]) -> None:
        buffer = self._buffer
        offset = 0
        while len(buffer) - offset >= PREFIX_BYTES:
            header_length, data_length, kind = _PREFIX.unpack_from(buffer, offset)
            if header_length > MAX_HEADER_BYTES or data_length > MAX_DATA_BYTES:
                raise ProtocolError(f"frame of {header_length} + {data_length} bytes refused")
            header_end = offset + PREFIX_BYTES + header_length
            if len(buffer) < header_end:
                break
            raw = bytes(buffer[offset + PREFIX_BYTES : header_end])
            try:
                frame_kind = Kind(kind)
                header = {} if frame_kind.typed else orjson.loads(raw)
            except (orjson.JSONDecodeError, ValueError) as error:
                raise ProtocolError(f"unreadable frame header: {error}") from error
            typed = raw if frame_kind.typed else b""
            available = len(buffer) - header_end
            if data_length <= available:
                data = buffer[header_end : header_end + data_length] if data_length else None
                frames.append(Frame(frame_kind, header, data, typed))
                offset = header_end + data_length
                continue
            # A large frame: keep its data in a buffer of its own, filled as chunks arrive.
            self._data = bytearray(buffer[header_end:])
            self._pending = (frame_kind, header, typed, data_length)
            offset = len(buffer)
            break
        del buffer[:offset]

    def _fill_data(self, view: memoryview, frames: list[Frame]) -> memoryview:
        assert self._pending is not None
        assert self._data is not None
        kind, header, typed, data_length = self._pending
        missing = data_length - len(self._data)
        self._data += view[:missing]
        if len(self._data) == data_length:
            frames.append(Frame(kind, header, self._data, typed))
            self._pending = None
            self._data = None
        return view[missing:]


class FrameWriter:
    """Queues frames and writes everything queued in one turn of the event loop at once."""

    def __init__(self, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._queued: list[bytes | memoryview] = []

    def send(self, kind: Kind, header: dict[str, Any], data: Data = ()) -> None:
        self.send_typed(kind, orjson.dumps(header), data)

    def send_typed(self, kind: Kind, header: bytes, data: Data = ()) -> None:
        if self._transport.is_closing():
            return
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.extend(encode_typed(kind, header, data))

    def send_now(self, kind: Kind, header: bytes, data: Data = ()) -> None:
        """Write a frame at once, after anything queued (kept in order): for a frame that
        already gathers a turn's work (a batch's answers), which the end-of-turn queue would
        only hold one more loop turn."""
        if self._transport.is_closing():
            return
        queued, self._queued = self._queued, []
        queued.extend(encode_typed(kind, header, data))
        if len(queued) > 2 and sum(len(part) for part in queued) <= JOIN_BYTES:
            # Many small buffers (a batch's answers, one or two each): one copy into one
            # buffer costs less than the transport's handling of each.
            self._transport.write(b"".join(queued))
        else:
            self._transport.writelines(queued)

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        if queued and not self._transport.is_closing():
            self._transport.writelines(queued)
