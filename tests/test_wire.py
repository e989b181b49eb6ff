"""The bridge's frames and its typed contract: frames split and joined however the socket
delivers them, arrays rebuilt exactly, corrupt streams and headers refused."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import numpy as np
import orjson
import pytest

from service.bridge import contract, wire
from service.tensors import NamedArrays


def frames_of(chunks: list[bytes]) -> list[wire.Frame]:
    reader = wire.FrameReader()
    return [frame for chunk in chunks for frame in reader.feed(chunk)]


def encoded(kind: wire.Kind, header: dict[str, object], data: wire.Data = ()) -> bytes:
    return b"".join(bytes(part) for part in wire.encode(kind, header, data))


def encoded_answer(named: NamedArrays, call_id: int = 1) -> bytes:
    """One ANSWERS frame holding ``named`` as the outputs of ``call_id``."""
    packer = contract.DataPacker()
    answers = contract.Answers([contract.Answer(call_id, "v1", packer.pack(named))])
    parts = wire.encode_typed(wire.Kind.ANSWERS, contract.encode(answers), packer.buffers)
    return b"".join(bytes(part) for part in parts)


def rebuilt_of(frame: wire.Frame) -> NamedArrays:
    [answer] = contract.decode_answers(frame.typed_header).answers
    return contract.unpack(answer.arrays, frame.data)


def crossed(named: NamedArrays) -> NamedArrays:
    [frame] = frames_of([encoded_answer(named)])
    return rebuilt_of(frame)


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "int64", "int32", "float64", "uint8", "int8", "bool"]
)
def test_an_array_crosses_with_its_dtype_and_shape(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) * 3 % 7).astype(dtype)
    [frame] = frames_of([encoded_answer(NamedArrays({"y": array}), call_id=7)])
    rebuilt = rebuilt_of(frame)
    assert frame.kind == wire.Kind.ANSWERS
    assert contract.decode_answers(frame.typed_header).answers[0].id == 7
    assert rebuilt.names == ("y",)
    assert rebuilt["y"].dtype == array.dtype
    assert rebuilt["y"].shape == array.shape
    np.testing.assert_array_equal(rebuilt["y"], array)
    rebuilt["y"][0, 0, 0] = 1  # writable: torch.from_numpy needs no copy and warns about none
    assert array[0, 0, 0] == 0


def test_several_named_arrays_of_different_dtypes_cross_in_one_frame_each_aligned() -> None:
    # Sizes that are no multiple of 16 bytes: every array after the first needs padding.
    named = NamedArrays(
        {
            "input_ids": np.arange(3 * 5, dtype=np.int64).reshape(3, 5) + 1,
            "attention_mask": np.array([[1, 1, 0, 0, 0]] * 3, dtype=bool),
            "pixels": np.arange(3 * 7, dtype=np.uint8).reshape(3, 7),
            "scale": np.array([0.5, -1.25, 3.0], dtype=np.float16),
            "logits": np.linspace(-1, 1, 3 * 3, dtype=np.float32).reshape(3, 3),
            "score": np.array([1e-300, 2.5, -7.0], dtype=np.float64),
        }
    )
    packer = contract.DataPacker()
    specs = packer.pack(named)

    offsets = [spec.offset for spec in specs]
    assert [spec.name for spec in specs] == list(named.names)
    assert all(offset % wire.ALIGNMENT == 0 for offset in offsets)
    assert offsets == sorted(set(offsets)), "each array has a place of its own"
    assert sum(len(part) for part in packer.buffers) % wire.ALIGNMENT == 0
    [frame] = frames_of([encoded_answer(named, call_id=3)])
    rebuilt = rebuilt_of(frame)

    assert rebuilt.names == named.names
    assert len(rebuilt) == 3
    for name in named.names:
        assert rebuilt[name].dtype == named[name].dtype, name
        assert rebuilt[name].shape == named[name].shape, name
        np.testing.assert_array_equal(rebuilt[name], named[name])
        # Rebuilt in place, each at an aligned address: no dtype is read misaligned.
        assert rebuilt[name].ctypes.data % wire.ALIGNMENT == (
            rebuilt[named.names[0]].ctypes.data % wire.ALIGNMENT
        )
        assert rebuilt[name].flags.aligned, name
        assert rebuilt[name].flags.writeable, name


def test_a_bool_and_a_uint8_array_keep_their_dtypes() -> None:
    mask = np.array([[True, False, True], [False, False, True]])
    pixels = np.array([[0, 128, 255], [1, 254, 7]], dtype=np.uint8)

    rebuilt = crossed(NamedArrays({"mask": mask, "pixels": pixels}))

    assert rebuilt["mask"].dtype == np.bool_
    assert rebuilt["pixels"].dtype == np.uint8
    np.testing.assert_array_equal(rebuilt["mask"], mask)
    np.testing.assert_array_equal(rebuilt["pixels"], pixels)


def test_a_slice_of_named_rows_crosses_as_those_rows_only() -> None:
    named = NamedArrays(
        {
            "x": np.arange(5 * 3, dtype=np.float32).reshape(5, 3),
            "ids": np.arange(5 * 2, dtype=np.int32).reshape(5, 2),
        }
    )

    rebuilt = crossed(named[1:4])

    assert len(rebuilt) == 3
    np.testing.assert_array_equal(rebuilt["x"], named["x"][1:4])
    np.testing.assert_array_equal(rebuilt["ids"], named["ids"][1:4])


def test_arrays_with_no_elements_cross() -> None:
    # Zero rows, or rows of length 0 on a variable axis (an output may have such a shape).
    for named in (
        NamedArrays({"x": np.zeros((0, 4), dtype=np.float32)}),
        NamedArrays({"y": np.zeros((2, 0), dtype=np.int64), "z": np.ones((2, 3), np.float16)}),
    ):
        rebuilt = crossed(named)
        for name in named.names:
            assert rebuilt[name].dtype == named[name].dtype
            np.testing.assert_array_equal(rebuilt[name], named[name], strict=True)


def test_a_non_contiguous_array_is_sent_in_c_order() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    strided = np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]

    rebuilt = crossed(NamedArrays({"x": array, "strided": strided}))

    np.testing.assert_array_equal(rebuilt["x"], array)
    np.testing.assert_array_equal(rebuilt["strided"], strided)


def test_frames_split_at_every_byte_and_joined_in_one_read_come_out_whole() -> None:
    big = np.random.default_rng(0).random((300, 256)).astype(np.float32)  # 300 KiB of data
    mask = np.random.default_rng(1).random((300, 5)) < 0.5
    named = NamedArrays({"x": big, "mask": mask})
    cancels = contract.encode(contract.Cancels([1]))
    stream = (
        encoded(wire.Kind.STATUS, {"phase": "ready"})
        + encoded_answer(named, call_id=1)
        + b"".join(bytes(part) for part in wire.encode_typed(wire.Kind.CANCELS, cancels))
    )
    whole = frames_of([stream])
    byte_by_byte = frames_of([stream[i : i + 1] for i in range(len(stream))])
    in_odd_pieces = frames_of([stream[i : i + 4099] for i in range(0, len(stream), 4099)])
    for frames in (whole, byte_by_byte, in_odd_pieces):
        assert [frame.kind for frame in frames] == [
            wire.Kind.STATUS,
            wire.Kind.ANSWERS,
            wire.Kind.CANCELS,
        ]
        assert contract.decode_cancels(frames[2].typed_header).ids == [1]
        rebuilt = rebuilt_of(frames[1])
        np.testing.assert_array_equal(rebuilt["x"], big)
        np.testing.assert_array_equal(rebuilt["mask"], mask)


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


@pytest.mark.parametrize(
    ("entries", "size"),
    [
        ([["x", "<f4", [2, 3], 0]], 20),  # 24 bytes of data needed
        ([["x", "<f4", [2, 2], 0], ["m", "|b1", [2, 3], 16]], 20),  # the second runs past
        ([["x", "<f4", [2, 2], 0], ["m", "|b1", [3, 1], 16]], 32),  # rows differ
        ([["x", "<f4", [2, 2], -16]], 32),  # before the data
        ([["x", "<f4", [-1], 0]], 32),  # a negative size (numpy would fill it in)
        ([["x", "<f4", [-1, 4], 0]], 32),
        ([["x", "|O", [1], 0]], 8),  # objects
        ([["x", "<f4", [2], 0, "extra"]], 8),  # not name, dtype, shape, offset
        ([], 0),  # no arrays at all
    ],
)
def test_data_that_does_not_fit_its_shapes_or_objects_are_refused(
    entries: list[list[object]], size: int
) -> None:
    def read() -> NamedArrays:
        [answer] = contract.decode_answers(msgspec.msgpack.encode([[[1, "v1", entries]]])).answers
        return contract.unpack(answer.arrays, bytearray(size))

    with pytest.raises(wire.ProtocolError):
        read()


@pytest.mark.parametrize(
    "header",
    [
        {"dtype": "<f4", "shape": [2, 3]},  # not an Answers struct
        [[[1, "v1", [["x", "<f4", [2], 0]], [], {"status": 500}]]],  # an error missing fields
        [[["one", "v1"]]],  # an id that is no integer
        b"\xc1",  # not msgpack
    ],
)
def test_an_unreadable_answers_header_is_refused(header: object) -> None:
    encoded_header = header if isinstance(header, bytes) else msgspec.msgpack.encode(header)
    with pytest.raises(wire.ProtocolError):
        contract.decode_answers(encoded_header)


def test_a_submit_names_every_field_of_the_request_once() -> None:
    """The contract's round trip: what a front end sends is what the engine reads."""
    packer = contract.DataPacker()
    named = NamedArrays({"x": np.ones((2, 3), dtype=np.float32)})
    submits = contract.Submits(
        load=5,
        requests=[
            contract.Submit(
                id=9,
                model="m",
                version="v",
                priority="high",
                deadline_s=12.5,
                request_id="r",
                arrays=packer.pack(named),
                trace="00-abc-def-01",
            )
        ],
    )
    decoded = contract.decode_submits(contract.encode(submits))
    assert decoded == submits
    with pytest.raises(wire.ProtocolError):  # a priority that does not exist
        contract.decode_submits(
            msgspec.msgpack.encode([5, [[9, "m", "v", "urgent", 1.0, "r", []]]])
        )


class RecordingTransport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[bytes]] = []

    def writelines(self, data: object) -> None:
        self.writes.append([bytes(part) for part in data])  # type: ignore[attr-defined]

    def write(self, data: object) -> None:
        self.writes.append([bytes(data)])  # type: ignore[call-overload]

    def is_closing(self) -> bool:
        return False


async def test_frames_sent_in_one_turn_of_the_loop_are_written_at_once() -> None:
    transport = RecordingTransport()
    writer = wire.FrameWriter(transport, asyncio.get_running_loop())
    for call_id in range(64):
        writer.send(wire.Kind.REPLY, {"id": call_id})
    assert transport.writes == []
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    assert len(frames_of(transport.writes[0])) == 64


async def test_a_frame_sent_now_goes_out_at_once_after_what_was_queued_before_it() -> None:
    """A batch's answers are written in the turn that delivers them, not one loop turn later,
    and never ahead of a frame queued before them."""
    transport = RecordingTransport()
    writer = wire.FrameWriter(transport, asyncio.get_running_loop())
    writer.send(wire.Kind.REPLY, {"id": 1})
    writer.send_now(wire.Kind.REPLY, orjson.dumps({"id": 2}))
    assert len(transport.writes) == 1
    frames = frames_of(transport.writes[0])
    assert [frame.header["id"] for frame in frames] == [1, 2]
    await asyncio.sleep(0)
    assert len(transport.writes) == 1  # nothing left for the end of the turn


async def test_a_small_frame_of_many_buffers_is_written_as_one_buffer() -> None:
    """A batch's answers (a buffer and its padding per answer) cross as one buffer: one copy
    of a few kilobytes costs less than the transport's handling of 128 small buffers. A
    large frame keeps its buffers (never copied)."""
    transport = RecordingTransport()
    writer = wire.FrameWriter(transport, asyncio.get_running_loop())
    parts = [bytes([index]) * 16 for index in range(128)]
    writer.send_now(wire.Kind.ANSWERS, b"header", parts)
    assert len(transport.writes) == 1
    assert len(transport.writes[0]) == 1
    assert transport.writes[0][0] == b"".join(
        wire.encode_typed(wire.Kind.ANSWERS, b"header", parts)
    )
    large = [bytes(wire.JOIN_BYTES // 2 + 1)] * 2
    writer.send_now(wire.Kind.ANSWERS, b"header", large)
    assert len(transport.writes[1]) == 3  # prefix and header, then each buffer as it was


def submits_frame(requests: list[NamedArrays]) -> tuple[list[contract.Submit], bytearray]:
    """A SUBMITS frame's requests and data, packed as a front end packs them."""
    packer = contract.DataPacker()
    submits = [
        contract.Submit(call_id, "m", "v1", "normal", 1.0, "-", packer.pack(named))
        for call_id, named in enumerate(requests)
    ]
    return submits, bytearray(b"".join(bytes(part) for part in packer.buffers))


def rows(count: int, width: int, dtype: str = "float32", start: int = 0) -> NamedArrays:
    values = np.arange(start, start + count * width).reshape(count, width).astype(dtype)
    return NamedArrays({"x": values})


@pytest.mark.parametrize(
    "requests",
    [
        [rows(1, 4, start=4 * index) for index in range(64)],  # one block: the common frame
        [rows(1, 4), rows(3, 4, start=100), rows(0, 4), rows(2, 4, start=7)],  # its rows vary
        [rows(1, 4), rows(1, 8)],  # row shapes differ
        [rows(1, 4), rows(1, 4, "int32")],  # dtypes differ
        [rows(1, 3), rows(1, 3)],  # rows of 12 bytes: padded apart, not one block
        [NamedArrays({"x": np.ones((1, 4)), "m": np.ones((1, 4))}), rows(1, 4)],  # two arrays
        [rows(2, 4)],  # alone
    ],
)
def test_a_frames_requests_are_rebuilt_alike_as_one_block_or_one_by_one(
    requests: list[NamedArrays],
) -> None:
    submits, data = submits_frame(requests)
    rebuilt = contract.unpack_all(submits, data)
    assert len(rebuilt) == len(requests)
    for got, sent, submit in zip(rebuilt, requests, submits, strict=True):
        alone = contract.unpack(submit.arrays, data)
        assert got.names == sent.names == alone.names
        for name in sent.names:
            assert got[name].dtype == sent[name].dtype
            np.testing.assert_array_equal(got[name], sent[name])
            np.testing.assert_array_equal(got[name], alone[name])
        assert got[got.names[0]].flags.writeable  # as one by one: torch needs no copy


def test_a_frame_whose_block_overruns_its_data_is_refused_as_one_by_one_would() -> None:
    submits, data = submits_frame([rows(1, 4) for _ in range(8)])
    with pytest.raises(wire.ProtocolError):
        contract.unpack_all(submits, data[:-16])


def unpacked_answers(
    packer: contract.DataPacker, specs: list[list[contract.ArraySpec]]
) -> list[NamedArrays]:
    data = bytearray(b"".join(bytes(part) for part in packer.buffers))
    return [contract.unpack(arrays, data) for arrays in specs]


@pytest.mark.parametrize(
    "answers",
    [
        [rows(1, 4, start=index) for index in range(64)],  # a batch's one-row answers: a block
        [rows(count, 8, start=count) for count in (1, 3, 0, 2)],  # varying rows, one empty
        [rows(2, 4), rows(2, 4, "float64")],  # dtypes differ
        [rows(1, 3), rows(1, 3)],  # 12-byte rows: padded, one by one
        [rows(1, 4), NamedArrays({"x": np.ones((1, 2, 2), np.float32)})],  # row shapes differ
        [rows(1, 4), NamedArrays({"y": np.ones((1, 4), np.float32)})],  # names differ
        [NamedArrays({"x": np.ones((2, 4)), "y": np.ones((2, 1))})] * 2,  # two arrays each
        [NamedArrays({"x": np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2]})] * 2,  # strided
        [rows(600, 4), rows(600, 4)],  # large: viewed, not copied
        [rows(1, 4)],  # one answer
    ],
)
def test_a_batch_of_answers_packed_at_once_unpacks_as_each_packed_alone(
    answers: list[NamedArrays],
) -> None:
    """``pack_all`` (a batch's answers for one front end, as one block when alike) gives
    each answer the arrays ``pack`` gives it, after whatever the packer held before."""
    alone = contract.DataPacker()
    at_once = contract.DataPacker()
    for packer in (alone, at_once):
        packer.pack(rows(1, 3))  # something packed before: the block starts where it ends
    specs_alone = [alone.pack(named) for named in answers]
    specs_at_once = at_once.pack_all(answers)
    for one, other in zip(
        unpacked_answers(alone, specs_alone), unpacked_answers(at_once, specs_at_once), strict=True
    ):
        assert one.names == other.names
        for name in one.names:
            assert one[name].dtype == other[name].dtype
            np.testing.assert_array_equal(one[name], other[name])
    if len(answers) == 64:
        assert len(at_once.buffers) == 3  # the earlier array, its padding, and the block
