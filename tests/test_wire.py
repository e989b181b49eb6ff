"""The bridge's frames: split and joined however the socket delivers them, arrays rebuilt
exactly, corrupt streams refused."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from service.bridge import wire


def frames_of(chunks: list[bytes]) -> list[wire.Frame]:
    reader = wire.FrameReader()
    return [frame for chunk in chunks for frame in reader.feed(chunk)]


def encoded(kind: wire.Kind, header: dict[str, object], data: bytes = b"") -> bytes:
    return b"".join(bytes(part) for part in wire.encode(kind, header, data))


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "int32", "float64", "uint8"])
def test_an_array_crosses_with_its_dtype_and_shape(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
    header = wire.array_header(array) | {"id": 7}
    [frame] = frames_of([encoded(wire.Kind.RESULT, header, bytes(wire.array_bytes(array)))])
    rebuilt = wire.array_from(frame.header, frame.data)
    assert frame.kind == wire.Kind.RESULT
    assert frame.header["id"] == 7
    assert rebuilt.dtype == array.dtype
    np.testing.assert_array_equal(rebuilt, array)
    rebuilt[0, 0, 0] = 99  # writable: torch.from_numpy needs no copy and warns about none
    assert array[0, 0, 0] == 0


def test_a_non_contiguous_array_is_sent_in_c_order() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    data = bytes(wire.array_bytes(array))
    [frame] = frames_of([encoded(wire.Kind.RESULT, wire.array_header(array), data)])
    np.testing.assert_array_equal(wire.array_from(frame.header, frame.data), array)


def test_frames_split_at_every_byte_and_joined_in_one_read_come_out_whole() -> None:
    big = np.random.default_rng(0).random((300, 256)).astype(np.float32)  # 300 KiB of data
    stream = (
        encoded(wire.Kind.STATUS, {"phase": "ready"})
        + encoded(wire.Kind.SUBMIT, wire.array_header(big) | {"id": 1}, big.tobytes())
        + encoded(wire.Kind.CANCEL, {"id": 1})
    )
    whole = frames_of([stream])
    byte_by_byte = frames_of([stream[i : i + 1] for i in range(len(stream))])
    in_odd_pieces = frames_of([stream[i : i + 4099] for i in range(0, len(stream), 4099)])
    for frames in (whole, byte_by_byte, in_odd_pieces):
        assert [frame.kind for frame in frames] == [
            wire.Kind.STATUS,
            wire.Kind.SUBMIT,
            wire.Kind.CANCEL,
        ]
        np.testing.assert_array_equal(wire.array_from(frames[1].header, frames[1].data), big)


@pytest.mark.parametrize(
    "stream",
    [
        struct.pack("<IIB", 2 << 20, 0, wire.Kind.STATUS) + b"x",  # a header of 2 MiB
        struct.pack("<IIB", 2, 0, wire.Kind.STATUS) + b"{]",  # not JSON
        struct.pack("<IIB", 2, 0, 99) + b"{}",  # no such kind
    ],
)
def test_a_corrupt_stream_is_refused(stream: bytes) -> None:
    with pytest.raises(wire.ProtocolError):
        frames_of([stream])


def test_data_that_does_not_fit_its_shape_or_objects_are_refused() -> None:
    with pytest.raises(wire.ProtocolError):
        wire.array_from({"dtype": "<f4", "shape": [2, 3]}, bytearray(20))
    with pytest.raises(wire.ProtocolError):
        wire.array_from({"dtype": "|O", "shape": [1]}, bytearray(8))


class RecordingTransport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[bytes]] = []

    def writelines(self, data: object) -> None:
        self.writes.append([bytes(part) for part in data])  # type: ignore[attr-defined]

    def is_closing(self) -> bool:
        return False


async def test_frames_sent_in_one_turn_of_the_loop_are_written_at_once() -> None:
    transport = RecordingTransport()
    writer = wire.FrameWriter(transport, asyncio.get_running_loop())
    for call_id in range(64):
        writer.send(wire.Kind.ERROR, {"id": call_id})
    assert transport.writes == []
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    assert len(frames_of(transport.writes[0])) == 64
