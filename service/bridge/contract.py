"""The request contract: what crosses the bridge for each request and answer, in one codec.

One typed definition, used by both ends (``client.py`` and ``server.py``): a new request field
is added here and where the front end sets it and the engine reads it, nowhere else. Frames are
batched: everything a front end submits in one event-loop turn travels as one ``Submits``
frame, and the answers an engine's batch produced for one front end as one ``Answers`` frame;
likewise a turn's generation requests as one ``Generates`` frame, and the tokens one generation
step gave a front end's streams as one ``TokenFrame``. Headers are msgpack (``msgspec``,
validated against these types as they are decoded); the arrays are raw bytes after the header,
each at an offset aligned to 16 bytes, rebuilt in place without a copy.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from service.bridge.interface import FinishReason, GeneratedTokens, GenerateRequest
from service.bridge.wire import ALIGNMENT, ProtocolError
from service.errors import ServiceError, error_from_wire
from service.tensors import NamedArrays
from service.types import Priority


class ArraySpec(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    """numpy's ``dtype.str`` (e.g. ``<f4``); object arrays never cross."""
    shape: tuple[int, ...]
    offset: int
    """Where its bytes start within the frame's data."""


class Submit(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """One request (``interface.InferenceRequest``) as a front end sends it. The batch
    group and token cost are not sent: the engine computes them from the arrays."""

    id: int
    model: str
    version: str
    priority: Priority
    deadline_s: float
    """``time.monotonic()`` at which the request is answered 504 (system-wide clock)."""
    request_id: str
    arrays: list[ArraySpec]
    trace: str | None = None


class Submits(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    load: int
    """Requests the front end holds now (``InferenceRequest.frontend_load``)."""
    requests: list[Submit]


class Cancels(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ids: list[int]


class WireError(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    status: int
    code: str
    message: str
    headers: dict[str, str] = {}

    @classmethod
    def of(cls, error: ServiceError) -> WireError:
        return cls(error.status_code, error.code, error.message, dict(error.headers))

    def rebuilt(self) -> ServiceError:
        return error_from_wire(
            {
                "status": self.status,
                "code": self.code,
                "message": self.message,
                "headers": self.headers,
            }
        )


class Answer(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """One request's outputs (``interface.InferenceResult``), or its error."""

    id: int
    version: str = ""
    arrays: list[ArraySpec] = []
    batches: list[tuple[str, int]] = []
    error: WireError | None = None


class Answers(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    answers: list[Answer]


class Generate(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """One generation request (``interface.GenerateRequest``) as a front end sends it."""

    id: int
    model: str
    version: str
    prompt_ids: list[int]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    priority: Priority = "normal"
    deadline_s: float = float("inf")
    stream_deadline_s: float = float("inf")
    request_id: str = ""
    trace: str | None = None
    # Last, so that a request without penalties sends none of them (trailing defaults).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, call_id: int, request: GenerateRequest) -> Generate:
        return cls(
            call_id,
            request.model,
            request.version,
            list(request.prompt_ids),
            request.max_tokens,
            request.temperature,
            request.top_p,
            request.top_k,
            request.seed,
            request.logprobs,
            list(request.stop_token_ids),
            request.ignore_eos,
            request.priority,
            request.deadline_s,
            request.stream_deadline_s,
            request.request_id,
            request.traceparent,
            request.frequency_penalty,
            request.presence_penalty,
            request.repetition_penalty,
        )

    def request(self) -> GenerateRequest:
        return GenerateRequest(
            model=self.model,
            version=self.version,
            prompt_ids=tuple(self.prompt_ids),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=self.logprobs,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            deadline_s=self.deadline_s,
            stream_deadline_s=self.stream_deadline_s,
            request_id=self.request_id,
            traceparent=self.trace,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )


class Generates(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    requests: list[Generate]


class Tokens(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """New tokens of one stream (``interface.GeneratedTokens``), or its error (its end)."""

    id: int
    token_ids: list[int] = []
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    version: str = ""
    error: WireError | None = None

    @classmethod
    def of(cls, call_id: int, item: GeneratedTokens) -> Tokens:
        return cls(
            call_id,
            list(item.token_ids),
            None if item.logprobs is None else list(item.logprobs),
            None if item.top_logprobs is None else [list(top) for top in item.top_logprobs],
            item.finish_reason,
            item.version,
        )

    def item(self) -> GeneratedTokens:
        return GeneratedTokens(
            token_ids=tuple(self.token_ids),
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            top_logprobs=None
            if self.top_logprobs is None
            else tuple(tuple(top) for top in self.top_logprobs),
            finish_reason=self.finish_reason,
            version=self.version,
        )


class TokenFrame(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    streams: list[Tokens]


T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_submits = msgspec.msgpack.Decoder(Submits)
_cancels = msgspec.msgpack.Decoder(Cancels)
_answers = msgspec.msgpack.Decoder(Answers)
_generates = msgspec.msgpack.Decoder(Generates)
_tokens = msgspec.msgpack.Decoder(TokenFrame)


def encode(message: Submits | Cancels | Answers | Generates | TokenFrame) -> bytes:
    return _encoder.encode(message)


def decode_generates(header: bytes) -> Generates:
    return _decode(_generates, header)


def decode_tokens(header: bytes) -> TokenFrame:
    return _decode(_tokens, header)


def decode_submits(header: bytes) -> Submits:
    return _decode(_submits, header)


def decode_cancels(header: bytes) -> Cancels:
    return _decode(_cancels, header)


def decode_answers(header: bytes) -> Answers:
    return _decode(_answers, header)


def _decode(decoder: msgspec.msgpack.Decoder[T], header: bytes) -> T:
    try:
        return decoder.decode(header)
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise ProtocolError(f"unreadable frame header: {error}") from error


_PADDING = bytes(ALIGNMENT)
#: The padding that follows data ending ``misaligned`` bytes past an aligned offset.
_PADDINGS = [memoryview(_PADDING)[: ALIGNMENT - misaligned] for misaligned in range(ALIGNMENT)]


#: Arrays up to this size are copied into the frame's buffers rather than viewed.
COPY_BYTES = 4096


class DataPacker:
    """Gathers the arrays of many requests or answers into one frame's data buffers (not
    copied when C-contiguous), each at an aligned offset."""

    def __init__(self) -> None:
        self.buffers: list[bytes | memoryview] = []
        self._offset = 0

    def pack(self, named: NamedArrays) -> list[ArraySpec]:
        specs = []
        buffers = self.buffers
        for name, array in named.arrays.items():
            buffer: bytes | memoryview
            if array.nbytes <= COPY_BYTES:
                # A small array (an answer's row) copied costs a third of a view of it, and
                # the frame that holds it is joined into one buffer anyway (wire.JOIN_BYTES).
                buffer = array.tobytes()
            else:
                if not array.flags.c_contiguous:
                    array = np.ascontiguousarray(array)
                # As flat bytes, a third of reshape(-1).view(uint8).data's cost; but
                # memoryview.cast refuses arrays with no elements (0 rows, or 0 long).
                buffer = (
                    array.data.cast("B") if array.size else array.reshape(-1).view(np.uint8).data
                )
            offset = self._offset
            dtype = array.dtype
            dtype_name = _DTYPE_NAMES.get(dtype)
            if dtype_name is None:
                dtype_name = _DTYPE_NAMES[dtype] = dtype.str
            specs.append(ArraySpec(name, dtype_name, array.shape, offset))
            buffers.append(buffer)
            offset += array.nbytes
            misaligned = offset % ALIGNMENT
            if misaligned:
                buffers.append(_PADDINGS[misaligned])
                offset += ALIGNMENT - misaligned
            self._offset = offset
        return specs

    def pack_all(self, outputs: Sequence[NamedArrays]) -> list[list[ArraySpec]]:
        """``pack`` of each of ``outputs`` (a batch's answers for one front end). Where each
        holds one small array of one name, dtype and row shape whose rows need no padding
        (a batch's rows cut per request), their bytes are packed as one block: one spec per
        answer and one buffer for all, instead of the steps ``pack`` takes per array."""
        block = _answer_block(outputs)
        if block is None:
            return [self.pack(named) for named in outputs]
        name, dtype_name, row_bytes, arrays, shapes = block
        ends = list(itertools.accumulate([shape[0] * row_bytes for shape in shapes]))
        start = self._offset
        specs = [
            [ArraySpec(name, dtype_name, shape, start + offset)]
            for shape, offset in zip(shapes, [0, *ends[:-1]], strict=True)
        ]
        self.buffers.append(b"".join(map(np.ndarray.tobytes, arrays)))
        self._offset = start + ends[-1]  # a multiple of ALIGNMENT: every row is
        return specs


def _answer_block(
    outputs: Sequence[NamedArrays],
) -> tuple[str, str, int, list[np.ndarray[Any, Any]], list[tuple[int, ...]]] | None:
    """The one array of each of ``outputs`` and its shape, with their name, dtype name and
    bytes a row,
    when they are alike but for their rows, small, and rows of a multiple of ``ALIGNMENT``
    bytes; else None. Runs once per answer: each check reads every answer in C (``map``)."""
    if len(outputs) < 2 or len(outputs[0].arrays) != 1:
        return None
    [(name, first)] = outputs[0].arrays.items()
    dtype, row_shape = first.dtype, first.shape[1:]
    if dtype.hasobject or not first.ndim:
        return None
    row_bytes = first.itemsize
    for size in row_shape:
        row_bytes *= size
    if row_bytes == 0 or row_bytes % ALIGNMENT:
        return None
    named_arrays = list(map(_arrays, outputs))
    if set(map(len, named_arrays)) != {1}:
        return None
    try:
        arrays = list(map(operator.getitem, named_arrays, itertools.repeat(name)))
    except KeyError:
        return None
    shapes: list[tuple[int, ...]] = list(map(_shape, arrays))
    if set(map(_dtype_of, arrays)) != {dtype} or {shape[1:] for shape in shapes} != {row_shape}:
        return None
    if sum(map(_nbytes, arrays)) > COPY_BYTES * 16:
        return None  # large answers: viewed, not copied (``pack``)
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES[dtype] = dtype.str
    return name, dtype_name, row_bytes, arrays, shapes


_arrays = operator.attrgetter("arrays")
_shape = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_nbytes = operator.attrgetter("nbytes")


#: numpy dtypes by ``dtype.str``, as the arrays of every request name them (a few kinds).
_DTYPES: dict[str, np.dtype[Any]] = {}
#: And their names: ``dtype.str`` builds its string anew each time.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def _dtype(name: str) -> np.dtype[Any]:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = np.dtype(name)
        if dtype.hasobject:
            raise ProtocolError("object arrays never cross the bridge")
        if len(_DTYPES) < 64:
            _DTYPES[name] = dtype
    return dtype


def unpack_all(requests: Sequence[Submit], data: bytearray | None) -> list[NamedArrays]:
    """The named arrays of every request of a SUBMITS frame. Where the requests hold one
    array each of one dtype and row shape, one after the other (a front end's frame of like
    requests), they are rows of one block: the block is checked and rebuilt once, and each
    request's array is a slice of it (a third of rebuilding each)."""
    block = _block_of(requests, data)
    if block is None:
        return [unpack(request.arrays, data) for request in requests]
    name, array, bounds = block
    of_rows = NamedArrays.of_rows
    return [of_rows({name: array[start:end]}) for start, end in bounds]


def _block_of(
    requests: Sequence[Submit], data: bytearray | None
) -> tuple[str, np.ndarray[Any, Any], list[tuple[int, int]]] | None:
    """One array over the rows of every request, and each request's rows in it; None unless
    every request's one array follows the previous one's directly, alike but for its rows."""
    if len(requests) < 2 or data is None:
        return None
    first = requests[0].arrays
    if len(first) != 1:
        return None
    spec = first[0]
    name, dtype_name, shape, start = spec.name, spec.dtype, spec.shape, spec.offset
    if not shape or start < 0:
        return None
    row_shape = shape[1:]
    row_bytes = _dtype(dtype_name).itemsize
    for size in row_shape:
        if size < 0:
            return None
        row_bytes *= size
    if row_bytes == 0 or row_bytes % ALIGNMENT:
        return None  # the requests' rows would not follow one another directly
    bounds = []
    rows = 0
    expected = start
    for request in requests:
        arrays = request.arrays
        if len(arrays) != 1:
            return None
        spec = arrays[0]
        shape = spec.shape
        if (
            spec.offset != expected
            or spec.name != name
            or spec.dtype != dtype_name
            or not shape
            or shape[1:] != row_shape
            or shape[0] < 0
        ):
            return None
        bounds.append((rows, rows + shape[0]))
        rows += shape[0]
        expected += shape[0] * row_bytes
    try:
        array = np.ndarray((rows, *row_shape), _dtype(dtype_name), data, start)
    except (ValueError, TypeError):
        return None  # one by one says which request does not fit
    return name, array, bounds


def unpack(specs: Sequence[ArraySpec], data: bytearray | None) -> NamedArrays:
    """The named arrays ``specs`` describe; writable, sharing the frame's data buffer."""
    buffer = data if data is not None else bytearray()
    arrays = {}
    rows = -1
    try:
        for spec in specs:
            dtype = _dtype(spec.dtype)
            shape = spec.shape
            if spec.offset < 0:
                raise ProtocolError(f"array {spec.name!r} starts before the data: {spec.offset}")
            for size in shape:
                if size < 0:
                    raise ProtocolError(f"array {spec.name!r} has a negative size in {shape}")
            if not shape or (rows >= 0 and shape[0] != rows):
                raise ValueError(f"named arrays need one row count for all, got {shape}")
            rows = shape[0]
            # One C call (numpy checks that the buffer holds it); as frombuffer then reshape
            # did, but a request's arrays cost this once each.
            arrays[spec.name] = np.ndarray(shape, dtype, buffer, spec.offset)
        if not arrays:
            raise ValueError("no arrays")
        return NamedArrays.of_rows(arrays)  # their row counts checked above
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"arrays of {len(buffer)} bytes are not {list(specs)}") from error
