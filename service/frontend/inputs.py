"""Decode ``/predict`` bodies (JSON or ``.npy``) and validate them against the input spec.

Everything a client can get wrong is caught here, before queuing, so one bad request can never
reach a batch and fail its batch-mates. Messages say what was expected and what was received.
The result is one array of shape (instances, *instance shape); variable-length instances are
padded with the spec's ``pad_value`` to the request's longest one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from numpy.lib import format as npy_format

from service.buckets import group_and_cost
from service.errors import BadRequestError, InvalidInputError, UnsupportedMediaTypeError
from service.manifest import TensorSpec
from service.types import Array

JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/x-npy"
#: Media types read and written as a NumPy ``.npy`` array.
NPY_MEDIA_TYPES = frozenset({NPY_MEDIA_TYPE, "application/octet-stream"})
#: How a zip file (an ``.npz`` archive, or an empty zip) starts.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")

# numpy dtype kinds a JSON number array may arrive as, per kind of model input.
_ACCEPTED_JSON_KINDS: dict[str, frozenset[str]] = {
    "f": frozenset("fiu"),  # float inputs take integers too (0 and 1 are fine pixels)
    "i": frozenset("iu"),  # integer inputs (token ids) refuse fractions
}


def body_media_type(content_type: str | None) -> str:
    """JSON or NPY by ``Content-Type`` (a missing header is read as JSON); else 415."""
    media_type = (content_type or JSON_MEDIA_TYPE).split(";", 1)[0].strip().lower()
    if media_type in (JSON_MEDIA_TYPE, ""):
        return JSON_MEDIA_TYPE
    if media_type in NPY_MEDIA_TYPES:
        return NPY_MEDIA_TYPE
    raise UnsupportedMediaTypeError(
        f"send the body as {JSON_MEDIA_TYPE} or {NPY_MEDIA_TYPE}, got content-type {media_type!r}"
    )


def wants_npy(accept: str | None) -> bool:
    """Whether the ``Accept`` header prefers a ``.npy`` answer: named with a higher quality
    than JSON (``q`` is 1 unless given; ``q=0`` means not acceptable; JSON wins a tie)."""
    if not accept:
        return False
    npy_quality = json_quality = 0.0
    for part in accept.split(","):
        media_type, _, parameters = part.partition(";")
        media_type = media_type.strip().lower()
        quality = _quality(parameters)
        if media_type in NPY_MEDIA_TYPES:
            npy_quality = max(npy_quality, quality)
        elif media_type == JSON_MEDIA_TYPE:
            json_quality = max(json_quality, quality)
    return npy_quality > json_quality


def _quality(parameters: str) -> float:
    """The ``q`` of one ``Accept`` entry's parameters (``;q=0.5``); 1 when absent, 0 when
    unreadable or out of range, so a malformed entry is never preferred."""
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "q":
            try:
                quality = float(value.strip())
            except ValueError:
                return 0.0
            return quality if 0.0 <= quality <= 1.0 else 0.0
    return 1.0


def encode_npy(array: Array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@dataclass(frozen=True)
class InputLayout:
    """How requests for one model are validated, grouped into batches and costed."""

    spec: TensorSpec
    length_edges: tuple[int, ...] = ()
    max_instances: int = 1024

    def parse(self, body: bytes, media_type: str) -> Array:
        if media_type == NPY_MEDIA_TYPE:
            return self.parse_npy(body)
        return self.parse_json(body)

    def parse_json(self, body: bytes) -> Array:
        """``{"instances": [...]}`` -> one array in the spec's dtype."""
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise BadRequestError(f"the body is not valid JSON: {error}") from None
        if not isinstance(document, dict):
            raise InvalidInputError(
                f'the body must be a JSON object {{"instances": [...]}}, got {_json_type(document)}'
            )
        unknown = sorted(set(document) - {"instances"})
        if unknown:
            raise InvalidInputError(f"unknown field(s) {unknown}; the body takes only 'instances'")
        if "instances" not in document:
            raise InvalidInputError("missing field 'instances' (a list of instances)")
        instances = document["instances"]
        if not isinstance(instances, list):
            raise InvalidInputError(f"'instances' must be a list, got {_json_type(instances)}")
        self._check_count(len(instances))
        if self.spec.variable_axis is None:
            array = _json_to_array(instances, self.spec)
        else:
            array = self._pad_together([_json_to_array(item, self.spec) for item in instances])
        # numpy reads true/false beside numbers as 1/0. Any other string in the body has made the
        # array non-numeric by now, and the only key left is "instances", so these bytes can only
        # be boolean literals.
        if b"true" in body or b"false" in body:
            raise InvalidInputError(
                f"instances must contain only numbers ({self.spec.dtype}); got booleans"
            )
        return self._validated(array)

    def parse_npy(self, body: bytes) -> Array:
        """A ``.npy`` array: one instance, or a batch of them; the dtype must match exactly."""
        if body.startswith(_ZIP_MAGICS):  # np.load would open it as an .npz archive
            raise BadRequestError("the body must be one .npy array, not an .npz archive")
        try:
            _check_npy_data_size(body)
            array = np.load(io.BytesIO(body), allow_pickle=False)
        except Exception as error:
            # numpy parses the header with Python's tokenizer, which raises what it likes on a
            # forged one (TokenError, SyntaxError, MemoryError...): all the body's fault.
            raise BadRequestError(f"the body is not a valid .npy array: {error}") from None
        if not isinstance(array, np.ndarray):
            raise BadRequestError("the body must be one .npy array, not an .npz archive")
        if array.ndim == len(self.spec.shape) - 1:
            array = array[np.newaxis, ...]
        expected = np.dtype(self.spec.dtype)
        if array.dtype.newbyteorder("=") != expected:
            raise InvalidInputError(f"expected dtype {self.spec.dtype}, got {array.dtype.name}")
        self._check_count(len(array) if array.ndim else 0)
        return self._validated(np.ascontiguousarray(array, dtype=expected))

    def group_and_cost(self, instances: Array) -> tuple[tuple[int, ...], int]:
        """Requests with the same group may share a batch; cost is padded positions per row."""
        return group_and_cost(instances.shape[1:], self.spec.variable_axis, self.length_edges)

    def _check_count(self, count: int) -> None:
        if count == 0:
            raise InvalidInputError("'instances' is empty; send at least one instance")
        if count > self.max_instances:
            raise InvalidInputError(
                f"{count} instances in one request; at most {self.max_instances} are accepted"
            )

    def _pad_together(self, instances: list[Array]) -> Array:
        axis = self.spec.variable_axis
        assert axis is not None
        for instance in instances:
            if instance.ndim != len(self.spec.instance_shape):
                raise InvalidInputError(
                    f"expected instances of shape {_describe_shape(self.spec.shape)}; "
                    f"got an instance with {instance.ndim} dimension(s) instead of "
                    f"{len(self.spec.instance_shape)}"
                )
        lengths = [instance.shape[axis] for instance in instances]
        if min(lengths) < 1:
            raise InvalidInputError(
                f"instance {lengths.index(min(lengths))} is empty; every instance needs at "
                "least one element on its variable axis"
            )
        longest = max(lengths)
        padded = []
        for instance in instances:
            widths = [(0, 0)] * instance.ndim
            widths[axis] = (0, longest - instance.shape[axis])
            padded.append(np.pad(instance, widths, constant_values=self.spec.pad_value))
        try:
            return np.stack(padded)
        except ValueError:
            raise InvalidInputError(
                f"expected instances of shape {_describe_shape(self.spec.shape)}"
            ) from None

    def _validated(self, array: Array) -> Array:
        """Check rank, fixed sizes, variable length, finiteness and value range."""
        spec = self.spec
        if array.ndim != len(spec.shape) or any(
            size not in (-1, got) for size, got in zip(spec.shape, array.shape, strict=True)
        ):
            raise InvalidInputError(
                f"expected instances of shape {_describe_shape(spec.shape)}, "
                f"got {_describe_shape(array.shape)}"
            )
        axis = spec.variable_axis
        if axis is not None:
            length = array.shape[axis + 1]
            limit = spec.max_length or (self.length_edges[-1] if self.length_edges else None)
            if length < 1 or (limit is not None and length > limit):
                raise InvalidInputError(
                    f"instances must be 1 to {limit} long on their variable axis, got {length}"
                )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidInputError(
                f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, "
                "or beyond its range)"
            )
        self._check_range(array)
        return array

    def _check_range(self, array: Array) -> None:
        spec = self.spec
        if spec.min_value is None and spec.max_value is None:
            return
        low = -np.inf if spec.min_value is None else spec.min_value
        high = np.inf if spec.max_value is None else spec.max_value
        values = array.astype(np.float64, copy=False)
        outside = ((values < low) | (values > high)) & (values != spec.pad_value)
        if outside.any():
            value = values[outside].flat[0]
            raise InvalidInputError(
                f"values must lie in [{_number(low)}, {_number(high)}] "
                f"(or be the padding value {_number(spec.pad_value)}), got {_number(value)}"
            )


def _check_npy_data_size(body: bytes) -> None:
    """Refuse a ``.npy`` header that declares more data than the body holds.

    ``np.load`` allocates the declared array before reading it, so a few bytes declaring a
    terabyte-sized shape would otherwise end in a MemoryError (a 500) or a huge allocation.
    """
    if not body.startswith(npy_format.MAGIC_PREFIX):
        return  # not a .npy file; np.load says why
    stream = io.BytesIO(body)
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, _, dtype = npy_format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    if dtype.hasobject:
        return  # np.load refuses object arrays before allocating
    declared = math.prod(shape) * dtype.itemsize
    present = len(body) - stream.tell()
    if declared > present:
        raise ValueError(
            f"the header declares shape {shape} of {dtype.name} ({declared} bytes), "
            f"but only {present} bytes of data follow"
        )


def _json_to_array(instances: list[Any] | Any, spec: TensorSpec) -> Array:
    """Nested lists -> an array of the spec's dtype; refuses ragged lists and non-numbers."""
    try:
        array = np.asarray(instances)
    except (ValueError, TypeError, RecursionError):
        raise InvalidInputError(
            f"instances must be nested lists of numbers shaped {_describe_shape(spec.shape)}; "
            "got lists of uneven lengths"
        ) from None
    target = np.dtype(spec.dtype)
    accepted = _ACCEPTED_JSON_KINDS.get(target.kind, frozenset(target.kind))
    if array.size == 0:  # numpy calls an empty list float64; its shape is what matters
        return array.astype(target)
    if array.dtype.kind not in accepted:
        wanted = "integers" if target.kind == "i" else "numbers"
        raise InvalidInputError(
            f"instances must contain only {wanted} ({spec.dtype}); got {_describe_kind(array)}"
        )
    narrowing = target.kind == "f" and array.dtype.kind == "f" and array.itemsize > target.itemsize
    # Checked here rather than silenced with np.errstate, which costs more per request.
    if narrowing and not np.all(np.abs(array) <= np.finfo(target).max):
        raise InvalidInputError(
            f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, "
            "or beyond its range)"
        )
    converted = array.astype(target, copy=False)
    if target.kind == "i" and not np.array_equal(converted, array):
        raise InvalidInputError(f"instances contain integers outside the range of {spec.dtype}")
    return converted


def _describe_shape(shape: tuple[int, ...]) -> str:
    """``(N, 8, 8)``: N for the batch axis (the first -1), L for a variable length."""
    names = []
    for index, size in enumerate(shape):
        names.append(str(size) if size != -1 else ("N" if index == 0 else "L"))
    return "(" + ", ".join(names) + ")"


def _number(value: object) -> str:
    return f"{float(value):g}"  # type: ignore[arg-type]


def _describe_kind(array: Array) -> str:
    return {
        "b": "booleans",
        "U": "strings",
        "S": "strings",
        "O": "mixed values, nulls or objects",
        "f": "fractional numbers",
        "c": "complex numbers",
    }.get(array.dtype.kind, str(array.dtype))


def _json_type(value: object) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
