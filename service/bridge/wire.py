"""The bridge's frames: how front ends and engines talk over a local stream socket.

A frame is a 9-byte prefix (header length, data length, kind), a small orjson header, and raw
data bytes: the rows of a request's or an answer's named arrays, each in C order at an offset
aligned to 16 bytes, whose names, dtypes, shapes and offsets the header gives. Arrays cross
the socket as their bytes, never pickled, and are rebuilt with one copy on arrival.

``FrameReader`` takes bytes as they come off the socket and returns whole frames; it never
copies a frame's data twice. ``FrameWriter`` gathers the frames written during one turn of the
event loop and hands them to the transport in one call, so a batch of 64 answers costs one
system call rather than 64.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import orjson

from service.tensors import NamedArrays

_PREFIX = struct.Struct("<IIB")
PREFIX_BYTES = _PREFIX.size
#: Largest header accepted: headers are a few hundred bytes; more means a corrupt stream.
MAX_HEADER_BYTES = 1 << 20
#: Largest data accepted in one frame (the largest request body is 1 GiB; outputs can be
#: larger than inputs).
MAX_DATA_BYTES = 4 << 30


class Kind(IntEnum):
    """What a frame carries. Front end to engine: SUBMIT, CANCEL, CONTROL. Engine to front
    end: RESULT, ERROR (of one submitted request), STATUS (on connect, on every change, and
    as a heartbeat), REPLY (to a CONTROL)."""

    SUBMIT = 1
    CANCEL = 2
    CONTROL = 3
    RESULT = 11
    ERROR = 12
    STATUS = 13
    REPLY = 14


class ProtocolError(Exception):
    """The peer sent bytes that are not a frame: the connection must be closed."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    header: dict[str, Any]
    data: bytearray | None = None


Data = Sequence[bytes | memoryview]
#: Each array starts at a multiple of this many bytes within a frame's data, so the arrays
#: rebuilt in place are aligned for every dtype.
ALIGNMENT = 16
_PADDING = bytes(ALIGNMENT)


def encode(kind: Kind, header: dict[str, Any], data: Data = ()) -> list[bytes | memoryview]:
    """One frame as the buffers to write (the data is not copied)."""
    header_bytes = orjson.dumps(header)
    prefix = _PREFIX.pack(len(header_bytes), sum(len(part) for part in data), kind)
    return [prefix + header_bytes, *data]


def arrays_frame(named: NamedArrays) -> tuple[dict[str, Any], list[memoryview]]:
    """The header entries ``arrays_from`` needs to rebuild ``named``, and its data buffers
    (the arrays' bytes in C order, without a copy when contiguous, padded to alignment)."""
    entries = []
    data: list[memoryview] = []
    offset = 0
    for name, array in named.arrays.items():
        # As flat bytes: memoryview.cast refuses arrays with no elements (0 rows, or 0 long).
        buffer = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        entries.append([name, array.dtype.str, array.shape, offset])
        data.append(buffer)
        offset += len(buffer)
        if offset % ALIGNMENT:
            pad = ALIGNMENT - offset % ALIGNMENT
            data.append(memoryview(_PADDING)[:pad])
            offset += pad
    return {"arrays": entries}, data


def arrays_from(header: dict[str, Any], data: bytearray | None) -> NamedArrays:
    """The named arrays a frame carries; writable, sharing the frame's data buffer."""
    buffer = data if data is not None else bytearray()
    arrays = {}
    try:
        for name, dtype_text, shape_list, offset in header["arrays"]:
            dtype = np.dtype(dtype_text)
            if dtype.hasobject:
                raise ProtocolError("object arrays never cross the bridge")
            shape = tuple(int(size) for size in shape_list)
            if any(size < 0 for size in shape):  # numpy would infer a -1 from the data
                raise ProtocolError(f"array {name!r} has a negative size in {shape}")
            count = math.prod(shape)
            arrays[str(name)] = np.frombuffer(
                buffer, dtype=dtype, count=count, offset=int(offset)
            ).reshape(shape)
        return NamedArrays(arrays)
    except (ValueError, TypeError, KeyError) as error:
        raise ProtocolError(
            f"arrays of {len(buffer)} bytes are not {header.get('arrays')}"
        ) from error


class FrameReader:
    """Splits a byte stream into frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: bytearray | None = None
        self._pending: tuple[Kind, dict[str, Any], int] | None = None

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
            try:
                header = orjson.loads(buffer[offset + PREFIX_BYTES : header_end])
                frame_kind = Kind(kind)
            except (orjson.JSONDecodeError, ValueError) as error:
                raise ProtocolError(f"unreadable frame header: {error}") from error
            available = len(buffer) - header_end
            if data_length <= available:
                data = buffer[header_end : header_end + data_length] if data_length else None
                frames.append(Frame(frame_kind, header, data))
                offset = header_end + data_length
                continue
            # A large frame: keep its data in a buffer of its own, filled as chunks arrive.
            self._data = bytearray(buffer[header_end:])
            self._pending = (frame_kind, header, data_length)
            offset = len(buffer)
            break
        del buffer[:offset]

    def _fill_data(self, view: memoryview, frames: list[Frame]) -> memoryview:
        assert self._pending is not None
        assert self._data is not None
        kind, header, data_length = self._pending
        missing = data_length - len(self._data)
        self._data += view[:missing]
        if len(self._data) == data_length:
            frames.append(Frame(kind, header, self._data))
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
        if self._transport.is_closing():
            return
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.extend(encode(kind, header, data))

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        if queued and not self._transport.is_closing():
            self._transport.writelines(queued)
