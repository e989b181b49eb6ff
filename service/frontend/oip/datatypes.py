"""The one table between V2 datatypes (``FP32``, ``INT64``...) and the manifest's dtypes."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.errors import BadRequestError
from service.manifest import DType, TensorSpec

#: V2 datatype -> manifest dtype. BYTES is not served: batchserve models take numbers.
MANIFEST_DTYPES: dict[str, DType] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "BF16": "bfloat16",
    "FP32": "float32",
    "FP64": "float64",
}
V2_DATATYPES: dict[str, str] = {dtype: datatype for datatype, dtype in MANIFEST_DTYPES.items()}
#: Datatypes the protocol defines that no batchserve model takes (named in errors).
UNSERVED = frozenset({"UINT16", "UINT32", "UINT64", "BYTES"})


def datatype_of(spec: TensorSpec) -> str:
    return V2_DATATYPES[spec.dtype]


def check_datatype(spec: TensorSpec, datatype: str) -> None:
    """400 unless ``datatype`` is the V2 name of the model's dtype for ``spec``."""
    expected = datatype_of(spec)
    if datatype != expected:
        raise BadRequestError(
            f"input {spec.name!r} has datatype {datatype!r}; the model takes {expected} "
            f"({spec.dtype})"
        )


def wire_dtype(datatype: str) -> np.dtype[Any]:
    """How a tensor of ``datatype`` is laid out in binary data (little-endian; BF16 as the
    upper halves of float32, read by ``from_bf16``)."""
    if datatype == "BF16":
        return np.dtype("<u2")
    return np.dtype(MANIFEST_DTYPES[datatype]).newbyteorder("<")


def from_bf16(halves: np.ndarray[Any, np.dtype[np.uint16]]) -> np.ndarray[Any, Any]:
    """bfloat16 bit patterns -> float32 (how bfloat16 travels in batchserve)."""
    return (halves.astype(np.uint32) << 16).view(np.float32)


def to_bf16(values: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    halves: np.ndarray[Any, np.dtype[np.uint16]] = (rounded >> 16).astype(np.uint16)
    return halves
