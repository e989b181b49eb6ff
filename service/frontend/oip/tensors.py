"""V2 inference requests and responses as batchserve's named tensors, for REST and gRPC alike.

``InferInput`` is one tensor of a V2 request whatever it arrived as (JSON ``data``, binary
data, gRPC contents or raw bytes): ``to_request`` checks names, datatypes and shapes against
the model and returns its named inputs; ``answer_outputs`` selects and orders the requested
outputs, with the classification extension. Errors are 400 naming what was expected and what
was received, as the protocol asks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import BadRequestError
from service.frontend.inputs import InputLayout
from service.frontend.oip.datatypes import (
    MANIFEST_DTYPES,
    UNSERVED,
    check_datatype,
    datatype_of,
    from_bf16,
    wire_dtype,
)
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays
from service.types import Array


@dataclass(frozen=True)
class InferInput:
    """One input tensor of a V2 request: its JSON ``data`` or its raw little-endian bytes."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any = None
    raw: bytes | None = None


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool = False
    classification: int = 0
    """Top-k labels instead of the tensor (the classification extension); 0: the tensor."""


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    array: Array
    binary: bool = False


@dataclass(frozen=True)
class InferOptions:
    """What a request asks besides its inputs."""

    outputs: tuple[RequestedOutput, ...] = ()
    binary_outputs: bool = False
    """``binary_data_output``: every output not asked otherwise comes back as binary data."""
    parameters: Mapping[str, Any] = field(default_factory=dict)


def to_request(
    manifest: Manifest, layout: InputLayout, inputs: Sequence[InferInput]
) -> NamedArrays:
    """The request's named inputs, validated like ``/predict``'s (400 for what the protocol
    checks: names, datatypes, shapes against their data)."""
    specs = {spec.name: spec for spec in manifest.inputs}
    names = [tensor.name for tensor in inputs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise BadRequestError(f"inputs {repeated} are given more than once")
    unknown = sorted(set(names) - set(specs))
    missing = [name for name in specs if name not in names and specs[name].default_value is None]
    if unknown or missing:
        raise BadRequestError(
            f"{manifest.name} takes the inputs {list(specs)}"
            + (f"; unknown {unknown}" if unknown else "")
            + (f"; missing {missing}" if missing else "")
        )
    arrays = {tensor.name: _array(specs[tensor.name], tensor) for tensor in inputs}
    return layout.check(arrays)


def _array(spec: TensorSpec, tensor: InferInput) -> Array:
    if tensor.datatype in UNSERVED:
        raise BadRequestError(
            f"input {spec.name!r} has datatype {tensor.datatype}; the model takes "
            f"{datatype_of(spec)} ({spec.dtype})"
        )
    if tensor.datatype not in MANIFEST_DTYPES:
        raise BadRequestError(f"input {spec.name!r}: unknown datatype {tensor.datatype!r}")
    check_datatype(spec, tensor.datatype)
    if any(size < 0 for size in tensor.shape):
        raise BadRequestError(
            f"input {spec.name!r}: shape {list(tensor.shape)} has a negative size"
        )
    count = math.prod(tensor.shape)
    if tensor.raw is not None:
        dtype = wire_dtype(tensor.datatype)
        if len(tensor.raw) != count * dtype.itemsize:
            raise BadRequestError(
                f"input {spec.name!r}: shape {list(tensor.shape)} of {tensor.datatype} needs "
                f"{count * dtype.itemsize} bytes, got {len(tensor.raw)}"
            )
        flat = np.frombuffer(tensor.raw, dtype=dtype)
        if tensor.datatype == "BF16":
            flat = from_bf16(flat)
        # A copy: the body's bytes are read-only, and torch refuses to wrap those.
        return np.array(flat, dtype=spec.numpy_dtype).reshape(tensor.shape)
    values = _flat_json(spec, tensor.data)
    if len(values) != count:
        raise BadRequestError(
            f"input {spec.name!r}: shape {list(tensor.shape)} holds {count} values, the data "
            f"has {len(values)}"
        )
    return values.reshape(tensor.shape)


def _flat_json(spec: TensorSpec, data: Any) -> Array:
    """JSON ``data`` (flat or nested row-major lists) as a flat array of the spec's dtype."""
    if not isinstance(data, list):
        raise BadRequestError(f"input {spec.name!r}: 'data' must be a list")
    try:
        values = np.asarray(data)
    except (ValueError, TypeError, RecursionError):
        raise BadRequestError(f"input {spec.name!r}: 'data' is ragged") from None
    target = spec.numpy_dtype
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}[target.kind]
    if values.size and values.dtype.kind not in kinds:
        raise BadRequestError(
            f"input {spec.name!r}: 'data' of {datatype_of(spec)} must hold "
            f"{'booleans' if target.kind == 'b' else 'numbers'}, got {values.dtype.name} values"
        )
    flat = values.reshape(-1)
    converted = flat.astype(target)
    if target.kind in "iu" and not np.array_equal(converted, flat):
        raise BadRequestError(
            f"input {spec.name!r}: values outside the range of {datatype_of(spec)}"
        )
    return converted


def answer_outputs(
    manifest: Manifest, outputs: NamedArrays, options: InferOptions
) -> list[OutputTensor]:
    """The outputs to answer, in the order asked (all, in the manifest's order, by default)."""
    specs = {spec.name: spec for spec in manifest.outputs}
    requested = options.outputs or tuple(
        RequestedOutput(name, binary=options.binary_outputs) for name in specs
    )
    unknown = sorted({output.name for output in requested} - set(specs))
    if unknown:
        raise BadRequestError(f"{manifest.name} has the outputs {list(specs)}; unknown {unknown}")
    answered = []
    for output in requested:
        spec = specs[output.name]
        array = outputs[output.name]
        if output.classification:
            answered.append(
                OutputTensor(
                    output.name, "BYTES", (len(array), output.classification),
                    classify(spec, array, output.classification), output.binary,
                )
            )  # fmt: skip
            continue
        answered.append(
            OutputTensor(output.name, datatype_of(spec), array.shape, array, output.binary)
        )
    return answered


def check_requested_outputs(manifest: Manifest, outputs: Sequence[RequestedOutput]) -> None:
    """400 before the model runs: each output asked for once, by a name the model has, and
    classification only with labels and a k within them."""
    specs = {spec.name: spec for spec in manifest.outputs}
    names = [output.name for output in outputs]
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise BadRequestError(f"{manifest.name} has the outputs {list(specs)}; unknown {unknown}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise BadRequestError(f"outputs {repeated} are asked for more than once; ask once")
    for output in outputs:
        check_classification(specs[output.name], output)


def check_classification(spec: TensorSpec, output: RequestedOutput) -> None:
    if not output.classification:
        return
    if spec.labels is None:
        raise BadRequestError(
            f"output {output.name!r} has no labels in the model's manifest: classification "
            "needs them"
        )
    if not 1 <= output.classification <= len(spec.labels):
        raise BadRequestError(
            f"classification of {output.name!r} must be 1 to {len(spec.labels)}, got "
            f"{output.classification}"
        )


def classify(spec: TensorSpec, values: Array, k: int) -> Array:
    """The classification extension's answer, as Triton gives it: per row the k largest
    values of the output, ``"value:index:label"``, largest first."""
    assert spec.labels is not None
    rows = values.reshape(len(values), -1).astype(np.float64)
    best = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
    answer = [
        [f"{rows[row, index]:g}:{index}:{spec.labels[index]}" for index in indices]
        for row, indices in enumerate(best)
    ]
    return np.array(answer, dtype=object)
