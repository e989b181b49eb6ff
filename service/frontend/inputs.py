"""Decode ``/predict`` bodies (JSON, ``.npy`` or ``.npz``) and validate them against the
model's input specs.

Everything a client can get wrong is caught here, before queuing, so one bad request can never
reach a batch and fail its batch-mates. Messages say what was expected and what was received.
``TensorLayout`` checks one tensor; ``InputLayout`` a model's named inputs. The result is one
array per input of shape (instances, *instance shape); variable-length instances are padded
with each spec's ``pad_value`` to the request's longest one, and inputs with a variable axis
(token ids and their mask) must have the same length for each instance.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from numpy.lib import format as npy_format

from service.errors import (
    BadRequestError,
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from service.frontend.optional_inputs import fill_defaults
from service.frontend.per_token import padded_instances
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays
from service.types import Array

JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/x-npy"
NPZ_MEDIA_TYPE = "application/x-npz"
#: Media types read and written as a NumPy ``.npy`` array.
NPY_MEDIA_TYPES = frozenset({NPY_MEDIA_TYPE, "application/octet-stream"})
#: Media types a version without a handler reads.
TENSOR_MEDIA_TYPES = frozenset({JSON_MEDIA_TYPE, NPZ_MEDIA_TYPE} | NPY_MEDIA_TYPES)
#: How a zip file (an ``.npz`` archive, or an empty zip) starts.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")

# numpy dtype kinds a JSON number array may arrive as, per kind of model input.
_ACCEPTED_JSON_KINDS: dict[str, frozenset[str]] = {
    "f": frozenset("fiu"),  # float inputs take integers too (0 and 1 are fine pixels)
    "i": frozenset("iu"),  # integer inputs (token ids) refuse fractions
    "u": frozenset("iu"),  # unsigned ones too; negative values fail the range check
    "b": frozenset("b"),  # boolean inputs take true/false only
}


def body_media_type(content_type: str | None, accepted: frozenset[str] = TENSOR_MEDIA_TYPES) -> str:
    """The body's media type by ``Content-Type`` (a missing header is read as JSON; the
    ``.npy`` aliases as ``application/x-npy``), if among ``accepted``; else 415."""
    media_type = (content_type or JSON_MEDIA_TYPE).split(";", 1)[0].strip().lower()
    if media_type == "":
        media_type = JSON_MEDIA_TYPE
    if media_type in accepted:
        return NPY_MEDIA_TYPE if media_type in NPY_MEDIA_TYPES else media_type
    named = sorted(
        accepted - {"application/octet-stream"}, key=lambda name: (name != JSON_MEDIA_TYPE, name)
    )
    raise UnsupportedMediaTypeError(
        f"send the body as {', '.join(named[:-1])}{' or ' if len(named) > 1 else ''}{named[-1]}"
        f", got content-type {media_type!r}"
    )


def answer_media_type(accept: str | None) -> str:
    """The answer's media type the ``Accept`` header prefers: JSON, ``.npy`` or ``.npz``,
    whichever is named with the highest quality (``q`` is 1 unless given; ``q=0`` means not
    acceptable; JSON wins a tie, and is the answer when none of them is named)."""
    if not accept:
        return JSON_MEDIA_TYPE
    qualities = {JSON_MEDIA_TYPE: 0.0, NPY_MEDIA_TYPE: 0.0, NPZ_MEDIA_TYPE: 0.0}
    for part in accept.split(","):
        media_type, _, parameters = part.partition(";")
        media_type = media_type.strip().lower()
        media_type = NPY_MEDIA_TYPE if media_type in NPY_MEDIA_TYPES else media_type
        if media_type in qualities:
            qualities[media_type] = max(qualities[media_type], _quality(parameters))
    best = max(qualities.values())
    return next(media for media, quality in qualities.items() if quality == best)


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


def encode_npz(arrays: NamedArrays) -> bytes:
    """An uncompressed ``.npz`` archive, one ``.npy`` member per name (no pickles)."""
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays.arrays)
    return buffer.getvalue()


@dataclass(frozen=True)
class InputLayout:
    """How requests for one model are parsed into its named inputs and validated (their batch
    group and cost: ``buckets.batch_group``)."""

    manifest: Manifest
    length_edges: tuple[int, ...] = ()
    max_instances: int = 1024

    def __post_init__(self) -> None:
        tensors = {
            spec.name: TensorLayout(spec, self.length_edges, self.max_instances)
            for spec in self.manifest.inputs
        }
        object.__setattr__(self, "tensors", tensors)

    tensors: dict[str, TensorLayout] = field(init=False, repr=False, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.manifest.inputs)

    def parse(self, body: bytes, media_type: str) -> NamedArrays:
        """The body as the model's named inputs: JSON, one ``.npy`` array (a model with one
        input) or an ``.npz`` archive with one array per input name."""
        if media_type == NPY_MEDIA_TYPE:
            if len(self.tensors) > 1:
                raise InvalidInputError(
                    f"this model takes {len(self.tensors)} inputs {list(self.names)}: send them "
                    f"as one {NPZ_MEDIA_TYPE} archive with an array per name, or as JSON"
                )
            name = self.names[0]
            return NamedArrays({name: self.tensors[name].parse_npy(body)})
        if media_type == NPZ_MEDIA_TYPE:
            return self.parse_npz(body)
        if media_type != JSON_MEDIA_TYPE:
            raise UnsupportedMediaTypeError(
                f"this model reads {JSON_MEDIA_TYPE}, {NPY_MEDIA_TYPE} or {NPZ_MEDIA_TYPE} "
                f"bodies, got {media_type!r}"
            )
        return self.parse_json(body)

    def parse_json(self, body: bytes) -> NamedArrays:
        """``{"instances": [...]}``: each instance the bare value of a one-input model, or an
        object keyed by input name."""
        instances = read_instances(body)
        if len(self.tensors) == 1 and not (instances and isinstance(instances[0], dict)):
            name = self.names[0]
            parsed = NamedArrays({name: self.tensors[name].parse_instances(instances, body)})
            spec = self.tensors[name].spec
            own = (
                [_length(value, spec.variable_axis) or 0 for value in instances]
                if spec.variable_axis is not None
                else None
            )
            return self._with_own_lengths(parsed, own)
        columns: dict[str, list[Any]] = {name: [] for name in self.names}
        for index, instance in enumerate(instances):
            if not isinstance(instance, dict):
                raise InvalidInputError(
                    f"instance {index} must be an object keyed by input name "
                    f"{list(self.names)}, got {json_type(instance)}"
                )
            if self.required <= instance.keys() <= columns.keys() and (
                instance.keys() != instances[0].keys()
            ):
                raise InvalidInputError(
                    f"every instance must give the same inputs: instance 0 gives "
                    f"{sorted(instances[0])}, instance {index} {sorted(instance)}"
                )
            if not self.required <= instance.keys() <= columns.keys():
                missing = sorted(self.required - instance.keys())
                unknown = sorted(instance.keys() - columns.keys())
                raise InvalidInputError(
                    f"instance {index} must have exactly the inputs {list(self.names)}; "
                    + "; ".join(
                        text
                        for text in (
                            f"missing {missing}" if missing else "",
                            f"unknown {unknown}" if unknown else "",
                        )
                        if text
                    )
                )
            for name, value in instance.items():
                columns[name].append(value)
        columns = {name: column for name, column in columns.items() if column}
        self._check_shared_lengths(columns)
        arrays = {
            name: self.tensors[name].parse_instances(column, body)
            for name, column in columns.items()
        }
        variable = next(
            (name for name in columns if self.tensors[name].spec.variable_axis is not None), None
        )
        lengths = (
            [
                _length(value, self.tensors[variable].spec.variable_axis or 0) or 0
                for value in columns[variable]
            ]
            if variable is not None
            else None
        )
        filled = NamedArrays(self.filled(arrays, lengths))
        return self._with_own_lengths(self._checked_lengths(filled), lengths)

    @property
    def required(self) -> frozenset[str]:
        """The inputs a request must send: those without a ``default_value``."""
        return frozenset(spec.name for spec in self.manifest.inputs if spec.default_value is None)

    def filled(
        self, arrays: Mapping[str, Array], lengths: Sequence[int] | None = None
    ) -> dict[str, Array]:
        """``arrays`` with the optional inputs left out filled (``optional_inputs``)."""
        return fill_defaults(self.manifest.inputs, arrays, lengths)

    def parse_npz(self, body: bytes) -> NamedArrays:
        """An ``.npz`` archive (``np.savez``, no pickles) with one array per input name."""
        members = _npz_members(body, self.tensors[self.names[0]].max_body_bytes(body))
        if not self.required <= members.keys() <= set(self.names):
            raise InvalidInputError(
                f"the .npz archive must hold exactly the arrays {list(self.names)}, "
                f"got {sorted(members)}"
            )
        arrays = {}
        for name in (name for name in self.names if name in members):
            try:
                arrays[name] = self.tensors[name].parse_npy(members[name])
            except (InvalidInputError, BadRequestError) as error:
                raise type(error)(f"input {name!r}: {error.message}") from None
        counts = {name: len(array) for name, array in arrays.items()}
        if len(set(counts.values())) > 1:
            raise InvalidInputError(f"every input needs one row per instance, got {counts}")
        return self._checked_lengths(NamedArrays(self.filled(arrays)))

    def check(self, arrays: Mapping[str, Array]) -> NamedArrays:
        """Validate named arrays a handler built against the input specs (dtype, shape,
        length, range) and return them as the request's inputs; optional inputs left out are
        filled with their default."""
        arrays = self.filled(arrays)
        if arrays.keys() != set(self.names):
            raise InvalidInputError(
                f"the handler built inputs {sorted(arrays)}; the model takes {list(self.names)}"
            )
        checked = {}
        for name in self.names:
            tensor = self.tensors[name]
            array = np.asarray(arrays[name])
            if array.dtype != tensor.spec.numpy_dtype:
                raise InvalidInputError(
                    f"input {name!r} must be {tensor.spec.dtype}, got {array.dtype.name}"
                )
            tensor.check_count(len(array) if array.ndim else 0)
            checked[name] = tensor.validated(np.ascontiguousarray(array))
        counts = {name: len(array) for name, array in checked.items()}
        if len(set(counts.values())) > 1:
            raise InvalidInputError(f"every input needs one row per instance, got {counts}")
        return self._checked_lengths(NamedArrays(checked))

    def _check_shared_lengths(self, columns: dict[str, list[Any]]) -> None:
        """Inputs with a variable axis (ids and mask) must be as long as each other, instance
        by instance, before they are padded."""
        variable = [
            (name, self.tensors[name].spec.variable_axis)
            for name in columns
            if self.tensors[name].spec.variable_axis is not None
        ]
        if len(variable) < 2:
            return
        for index in range(len(columns[variable[0][0]])):
            lengths = {name: _length(columns[name][index], axis or 0) for name, axis in variable}
            if None not in lengths.values() and len(set(lengths.values())) > 1:
                raise InvalidInputError(
                    f"instance {index}: inputs with a variable axis must be equally long, "
                    f"got lengths {lengths}"
                )

    def _with_own_lengths(self, arrays: NamedArrays, lengths: Sequence[int] | None) -> NamedArrays:
        """The parsed instances with each one's own length (``lengths``: of the variable
        inputs, when some are shorter than the longest): per-token outputs answer each at its
        length (``per_token``)."""
        if lengths is None:
            return arrays
        return padded_instances(arrays, lengths, self.manifest.inputs)

    def _checked_lengths(self, arrays: NamedArrays) -> NamedArrays:
        lengths = {
            name: arrays[name].shape[spec.variable_axis + 1]
            for name, spec in ((name, self.tensors[name].spec) for name in self.names)
            if spec.variable_axis is not None
        }
        if len(set(lengths.values())) > 1:
            raise InvalidInputError(
                f"inputs with a variable axis must be equally long, got lengths {lengths}"
            )
        return arrays


@dataclass(frozen=True)
class TensorLayout:
    """How one input tensor is parsed and validated."""

    spec: TensorSpec
    length_edges: tuple[int, ...] = ()
    max_instances: int = 1024

    def parse(self, body: bytes, media_type: str) -> Array:
        if media_type == NPY_MEDIA_TYPE:
            return self.parse_npy(body)
        return self.parse_json(body)

    def parse_json(self, body: bytes) -> Array:
        """``{"instances": [...]}`` -> one array in the spec's dtype."""
        return self.parse_instances(read_instances(body), body)

    def parse_instances(self, instances: list[Any], body: bytes) -> Array:
        """The JSON instances of this tensor (``body`` is the whole request's) as one array."""
        self.check_count(len(instances))
        if self.spec.variable_axis is None:
            array = _json_to_array(instances, self.spec)
        else:
            array = self._pad_together([_json_to_array(item, self.spec) for item in instances])
        # numpy reads true/false beside numbers as 1/0. Any other string in the body has made the
        # array non-numeric by now, and the body's keys are "instances" and input names, so
        # these bytes are boolean literals (or a name holding the word: then look closer).
        if (
            array.dtype.kind != "b"
            and (b"true" in body or b"false" in body)
            and _holds_booleans(instances)
        ):
            raise InvalidInputError(
                f"instances must contain only numbers ({self.spec.dtype}); got booleans"
            )
        return self.validated(array)

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
        expected = self.spec.numpy_dtype
        if array.dtype.newbyteorder("=") != expected:
            raise InvalidInputError(f"expected dtype {expected.name}, got {array.dtype.name}")
        self.check_count(len(array) if array.ndim else 0)
        return self.validated(np.ascontiguousarray(array, dtype=expected))

    def max_body_bytes(self, body: bytes) -> int:
        """The most bytes an ``.npz`` member may expand to: the body's size (members are
        stored, or compressed at most to what the request size limit already allowed) times
        a generous ratio, so a zip bomb is refused before it is inflated."""
        return max(len(body) * 64, 1 << 20)

    def check_count(self, count: int) -> None:
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

    def validated(self, array: Array) -> Array:
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


def read_instances(body: bytes) -> list[Any]:
    """The ``instances`` list of a JSON body ``{"instances": [...]}``: 400 when the body is
    not JSON, 422 when it is not that object (handlers read their bodies with it too)."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidInputError(
            f'the body must be a JSON object {{"instances": [...]}}, got {json_type(document)}'
        )
    unknown = sorted(set(document) - {"instances"})
    if unknown:
        raise InvalidInputError(f"unknown field(s) {unknown}; the body takes only 'instances'")
    if "instances" not in document:
        raise InvalidInputError("missing field 'instances' (a list of instances)")
    instances = document["instances"]
    if not isinstance(instances, list):
        raise InvalidInputError(f"'instances' must be a list, got {json_type(instances)}")
    return instances


def _holds_booleans(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, list) and any(_holds_booleans(item) for item in value)


def _length(value: Any, axis: int) -> int | None:
    """The length of nested lists ``value`` along ``axis`` (None when it is not that deep:
    the tensor's own validation then says what shape it needed)."""
    for _ in range(axis):
        if not isinstance(value, list) or not value:
            return None
        value = value[0]
    return len(value) if isinstance(value, list) else None


def _npz_members(body: bytes, max_bytes: int) -> dict[str, bytes]:
    """The ``.npy`` members of an ``.npz`` archive by name (``ids.npy`` -> ``ids``), read
    with their inflated size capped at ``max_bytes`` in all."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        members = {}
        total = 0
        for info in archive.infolist():
            if not info.filename.endswith(".npy") or "/" in info.filename:
                raise BadRequestError(
                    f"an .npz archive holds only .npy members, got {info.filename[:64]!r}"
                )
            with archive.open(info) as member:
                data = member.read(max_bytes - total + 1)
            total += len(data)
            if total > max_bytes:
                raise PayloadTooLargeError(
                    f"the .npz archive inflates to more than {max_bytes} bytes"
                )
            members[info.filename[: -len(".npy")]] = data
        return members
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as error:
        raise BadRequestError(f"the body is not a valid .npz archive: {error}") from None


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
    target = spec.numpy_dtype
    accepted = _ACCEPTED_JSON_KINDS.get(target.kind, frozenset(target.kind))
    if array.size == 0:  # numpy calls an empty list float64; its shape is what matters
        return array.astype(target)
    if target.kind in "iu" and array.dtype.kind == "f":
        array = _whole_numbers(array, spec)  # 3.0 is the integer 3, as JSON Schema has it
    if array.dtype.kind not in accepted:
        wanted = {"i": "integers", "u": "integers", "b": "true or false"}.get(
            target.kind, "numbers"
        )
        raise InvalidInputError(
            f"instances must contain only {wanted} ({spec.dtype}); got {_describe_kind(array)}"
        )
    narrowing = target.kind == "f" and array.dtype.kind == "f" and array.itemsize > target.itemsize
    # Checked here rather than silenced with np.errstate, which costs more per request.
    if narrowing and not (np.abs(array) <= np.finfo(target).max).all():
        raise InvalidInputError(
            f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, "
            "or beyond its range)"
        )
    converted = array.astype(target, copy=False)
    if target.kind in "iu" and not np.array_equal(converted, array):
        raise InvalidInputError(f"instances contain integers outside the range of {spec.dtype}")
    return converted


def _whole_numbers(array: Array, spec: TensorSpec) -> Array:
    """``array`` as int64 when every value is a whole number (unchanged otherwise, to be
    refused as fractional); 422 when one is outside ``spec``'s dtype or beyond 2**53, where a
    JSON number no longer holds every integer exactly."""
    values = array.astype(np.float64, copy=False)
    if not (np.floor(values) == values).all():
        return array
    limits = np.iinfo(spec.numpy_dtype)
    lowest, highest = max(limits.min, -(2**53)), min(limits.max, 2**53)
    if values.min() < lowest or values.max() > highest:
        raise InvalidInputError(
            f"instances contain integers outside [{lowest}, {highest}], the range of "
            f"{spec.dtype} that JSON numbers hold exactly"
        )
    return values.astype(np.int64)


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


def json_type(value: object) -> str:
    """What a JSON value is, in the words of an error message."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
