"""``TensorLayout``: one input tensor's instances parsed from JSON or ``.npy`` and validated
against its spec (shape, dtype, range), with messages that say what was expected and what was
received. Variable-length instances are padded with the spec's ``pad_value`` to the request's
longest one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import (
    BadRequestError,
    InvalidInputError,
)
from service.frontend.bodies import NPY_MEDIA_TYPE, ZIP_MAGICS, check_npy_data_size, read_instances
from service.frontend.numeric_json import FAST_DTYPES, plain_float_rows
from service.manifest import TensorSpec
from service.types import Array

# numpy dtype kinds a JSON number array may arrive as, per kind of model input.
_ACCEPTED_JSON_KINDS: dict[str, frozenset[str]] = {
    "f": frozenset("fiu"),  # float inputs take integers too (0 and 1 are fine pixels)
    "i": frozenset("iu"),  # integer inputs (token ids) refuse fractions
    "u": frozenset("iu"),  # unsigned ones too; negative values fail the range check
    "b": frozenset("b"),  # boolean inputs take true/false only
}


@dataclass(frozen=True)
class TensorLayout:
    """How one input tensor is parsed and validated."""

    spec: TensorSpec
    length_edges: tuple[int, ...] = ()
    max_instances: int = 1024
    dtype: np.dtype[Any] = field(init=False, repr=False, compare=False)
    """The spec's ``numpy_dtype`` (a property that builds it), read once."""
    variable_axis: int | None = field(init=False, repr=False, compare=False)
    """The spec's ``variable_axis`` (a property that searches its shape), read once."""
    bounds: tuple[float, float] | None = field(init=False, repr=False, compare=False)
    """The spec's value range, infinite where it is open; None without one."""
    plain_shape: tuple[int, ...] | None = field(init=False, repr=False, compare=False)
    """The instance shape when a JSON body may take ``numeric_json.plain_float_rows`` (a
    float32 or float64 tensor of fixed shape), else None."""
    plain_range: tuple[float, float] | None = field(init=False, repr=False, compare=False)
    """The spec's value range when the dtype holds both ends exactly, else None. Rounding to
    the dtype is monotonic, so float64 values within it stay within it once cast: the
    reductions ``plain_float_rows`` makes anyway check it."""

    def __post_init__(self) -> None:
        spec = self.spec
        object.__setattr__(self, "dtype", spec.numpy_dtype)
        object.__setattr__(self, "variable_axis", spec.variable_axis)
        bounds = None
        if spec.min_value is not None or spec.max_value is not None:
            bounds = (
                -math.inf if spec.min_value is None else spec.min_value,
                math.inf if spec.max_value is None else spec.max_value,
            )
        object.__setattr__(self, "bounds", bounds)
        plain = spec.variable_axis is None and spec.numpy_dtype in FAST_DTYPES
        object.__setattr__(self, "plain_shape", spec.instance_shape if plain else None)
        object.__setattr__(self, "plain_range", _exact_range(spec.numpy_dtype, bounds))

    def parse(self, body: bytes, media_type: str) -> Array:
        if media_type == NPY_MEDIA_TYPE:
            return self.parse_npy(body)
        return self.parse_json(body)

    def parse_json(self, body: bytes) -> Array:
        """``{"instances": [...]}`` -> one array in the spec's dtype."""
        plain = self.parse_plain_json(body)
        if plain is not None:
            return plain
        return self.parse_instances(read_instances(body), body)

    def parse_plain_json(self, body: bytes) -> Array | None:
        """The body's instances as the general path (``parse_instances``) would give them,
        read by ``numeric_json.plain_float_rows``; None when only the general path can say
        (it then answers or refuses)."""
        if self.plain_shape is None:
            return None
        bounds = self.plain_range or _UNBOUNDED
        rows = plain_float_rows(body, self.plain_shape, self.max_instances, *bounds)
        if rows is None:
            return None  # not plain, or a value outside the range: the general path says
        array = rows.astype(self.dtype)  # a copy: the parsed buffer is read-only
        if self.bounds is not None and self.plain_range is None:
            self._check_range(array, *self.bounds)
        return array

    def parse_instances(self, instances: list[Any], body: bytes) -> Array:
        """The JSON instances of this tensor (``body`` is the whole request's) as one array."""
        self.check_count(len(instances))
        if self.variable_axis is None:
            array = _json_to_array(instances, self.spec)
        else:
            array = self._pad_together([_json_to_array(item, self.spec) for item in instances])
        # numpy reads true/false beside numbers as 1/0. Any other string in the body has made the
        # array non-numeric by now, and the body's keys are "instances" and input names, so
        # these bytes are boolean literals (or a name holding the word: then look closer).
        if array.dtype.kind != "b" and _may_hold_booleans(body) and _holds_booleans(instances):
            raise InvalidInputError(
                f"instances must contain only numbers ({self.spec.dtype}); got booleans"
            )
        return self.validated(array)

    def parse_npy(self, body: bytes) -> Array:
        """A ``.npy`` array: one instance, or a batch of them; the dtype must match exactly."""
        if body.startswith(ZIP_MAGICS):  # np.load would open it as an .npz archive
            raise BadRequestError("the body must be one .npy array, not an .npz archive")
        try:
            check_npy_data_size(body)
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
        if array.size == 0 or (array.dtype.kind != "f" and self.bounds is None):
            return array
        top, bottom = _largest_and_smallest(array)
        if array.dtype.kind == "f" and not (math.isfinite(top) and math.isfinite(bottom)):
            raise InvalidInputError(
                f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, "
                "or beyond its range)"
            )
        low, high = self.bounds or _UNBOUNDED
        if not (low <= bottom and top <= high):
            self._check_range(array, low, high)  # one outside, unless it is the padding value
        return array

    def _check_range(self, array: Array, low: float, high: float) -> None:
        spec = self.spec
        values = array.astype(np.float64)
        outside = ((values < low) | (values > high)) & (values != spec.pad_value)
        if outside.any():
            value = values[outside].flat[0]
            raise InvalidInputError(
                f"values must lie in [{_number(low)}, {_number(high)}] "
                f"(or be the padding value {_number(spec.pad_value)}), got {_number(value)}"
            )


_UNBOUNDED = (-math.inf, math.inf)


def _exact_range(
    dtype: np.dtype[Any], bounds: tuple[float, float] | None
) -> tuple[float, float] | None:
    """``bounds`` (infinite where open) when ``dtype``, a float dtype, holds both exactly."""
    if dtype.kind != "f" or bounds is None:
        return None
    with np.errstate(over="ignore"):  # a bound beyond float32 casts to infinity: not exact
        exact = all(float(dtype.type(bound)) == bound for bound in bounds)
    return bounds if exact else None


def _largest_and_smallest(array: Array) -> tuple[float, float]:
    """The largest and smallest values of a non-empty array (NaN when it holds one), as
    Python floats. The reductions are called as ufuncs: ``array.max()`` goes through a
    Python wrapper."""
    return float(np.maximum.reduce(array, None)), float(np.minimum.reduce(array, None))


def _may_hold_booleans(body: bytes) -> bool:
    """Whether ``body`` holds ``true`` or ``false``: one byte of each is looked for first,
    which most bodies of numbers lack."""
    return (b"u" in body or b"l" in body) and (b"true" in body or b"false" in body)


def _holds_booleans(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, list) and any(_holds_booleans(item) for item in value)


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
    # A float64 beyond float32 or float16 is checked before the cast, which would warn and give
    # infinity (NaN fails the comparison too).
    if target.kind == "f" and array.dtype.kind == "f" and array.itemsize > target.itemsize:
        top, bottom = _largest_and_smallest(array)
        limit = float(np.finfo(target).max)
        if not (-limit <= bottom and top <= limit):
            raise InvalidInputError(
                f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, "
                "or beyond its range)"
            )
    if target.itemsize == 2 and array.dtype.kind in "iu":
        with np.errstate(over="ignore"):  # an integer beyond float16: infinity, refused as such
            return array.astype(target)
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
