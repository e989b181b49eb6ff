"""Decode ``/predict`` bodies and validate them against the model's input spec.

Everything a client can get wrong is caught here, before queuing, so one bad request can never
reach a batch and fail its batch-mates. Messages say what was expected and what was received.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from service.errors import BadRequestError, InvalidInputError, UnsupportedMediaTypeError
from service.model_store import TensorSpec

JSON_MEDIA_TYPE = "application/json"

# numpy dtype kinds a JSON number array may arrive as, per kind of model input.
_ACCEPTED_KINDS: dict[str, frozenset[str]] = {
    "f": frozenset("fiu"),  # float inputs take integers too (0 and 1 are fine pixels)
    "i": frozenset("iu"),  # integer inputs (token ids) refuse fractions
}


def check_content_type(content_type: str | None) -> None:
    """Accept JSON (with or without parameters); a missing header is read as JSON."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type not in (JSON_MEDIA_TYPE, ""):
        raise UnsupportedMediaTypeError(
            f"send the body as {JSON_MEDIA_TYPE}, got content-type {media_type!r}"
        )


def parse_json_instances(
    body: bytes, spec: TensorSpec, *, max_instances: int
) -> npt.NDArray[np.generic]:
    """``{"instances": [...]}`` -> one array of shape (n, *instance shape) in the spec's dtype."""
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
    if not instances:
        raise InvalidInputError("'instances' is empty; send at least one instance")
    if len(instances) > max_instances:
        raise InvalidInputError(
            f"{len(instances)} instances in one request; at most {max_instances} are accepted"
        )
    return to_instance_array(instances, spec)


def to_instance_array(instances: list[Any], spec: TensorSpec) -> npt.NDArray[np.generic]:
    """Convert nested lists to an array, checking rank, fixed axis sizes, dtype and finiteness."""
    expected = _describe_shape(spec.shape)
    try:
        array = np.asarray(instances)
    except (ValueError, TypeError, RecursionError):
        raise InvalidInputError(
            f"instances must be nested lists of numbers of one shape {expected}; "
            "got lists of uneven lengths"
        ) from None
    target = np.dtype(spec.dtype)
    accepted = _ACCEPTED_KINDS.get(target.kind, frozenset(target.kind))
    if array.dtype.kind not in accepted:
        wanted = "integers" if target.kind == "i" else "numbers"
        raise InvalidInputError(
            f"instances must contain only {wanted} ({spec.dtype}); got {_describe_kind(array)}"
        )
    if array.ndim != len(spec.shape) or any(
        size not in (-1, got) for size, got in zip(spec.shape, array.shape, strict=True)
    ):
        raise InvalidInputError(
            f"expected instances of shape {expected}, got {_describe_shape(array.shape)}"
        )
    with np.errstate(over="ignore"):
        converted = array.astype(target, copy=False)
    if target.kind == "f" and not np.isfinite(converted).all():
        raise InvalidInputError(
            f"instances contain values that are not finite in {spec.dtype} (NaN, infinity, or "
            "beyond its range)"
        )
    if target.kind == "i" and not np.array_equal(converted, array):
        raise InvalidInputError(f"instances contain integers outside the range of {spec.dtype}")
    return converted


def _describe_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join("N" if size == -1 else str(size) for size in shape) + ")"


def _describe_kind(array: npt.NDArray[np.generic]) -> str:
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
