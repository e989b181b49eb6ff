"""What a model version is: its manifest, with the names, dtypes and shapes of its tensors.

Pydantic only, no torch: the front ends validate requests against a ``TensorSpec`` and the
engines load what a ``Manifest`` describes. Names and versions are plain identifiers, checked
here before they reach a path.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from service.errors import ModelNotFoundError
from service.types import Array

MANIFEST_FILE = "manifest.json"
VERSION_LENGTH = 12
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
VERSION_PATTERN = re.compile(r"^[0-9a-f]{12}$")
FILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
IMPORT_PATH_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

ModelFormat = Literal[
    "safetensors", "state_dict", "torchscript", "exported_program", "aoti", "onnx"
]
DType = Literal[
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
]
#: Schema of the manifests this code writes and reads; version 1 hashed only the weights.
SCHEMA_VERSION = 2
#: numpy has no bfloat16: such tensors travel as float32 outside the engine's device thread.
_NUMPY_DTYPES: dict[str, str] = {"bfloat16": "float32"}
FORMATS_NEEDING_ARCHITECTURE: frozenset[str] = frozenset({"safetensors", "state_dict"})
ARTIFACT_SUFFIXES: dict[str, str] = {
    "safetensors": ".safetensors",
    "state_dict": ".pt",
    "torchscript": ".torchscript.pt",
    "exported_program": ".pt2",
    "aoti": ".aoti.pt2",
    "onnx": ".onnx",
}


class TensorSpec(BaseModel):
    """Name, dtype and shape of one input or output; -1 marks the batch and variable axes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    dtype: DType
    shape: tuple[int, ...] = Field(min_length=1)
    max_length: int | None = Field(default=None, ge=1)
    """Longest accepted length of the variable axis (inputs with one), e.g. 512 tokens."""
    min_value: float | None = None
    """Smallest accepted value (inclusive), e.g. 1 for token ids when 0 is padding."""
    max_value: float | None = None
    """Largest accepted value (inclusive), e.g. vocabulary size - 1 for token ids."""
    pad_value: float = 0
    """Value that pads the variable axis up to the batch's length; the model must ignore it."""
    labels: tuple[str, ...] | None = None
    """Outputs: the name of each class along the last axis (classification handlers use them)."""
    default_value: float | None = None
    """Inputs: a request may leave this input out, and it is filled with this value at the
    request's shape (an attention mask of ones, type ids of zeros), as a ``forward()``
    argument with a default is optional. ``None``: the input is required."""
    length_of: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """Outputs: the input whose variable axis this output's variable axis follows (a tagger's
    ``tags`` follow its ``input_ids``): each instance is answered at its own length, never at
    the padded length of its batch."""

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if shape[0] != -1:
            raise ValueError(f"the first axis is the batch and must be -1, got {shape}")
        if any(size == 0 or size < -1 for size in shape):
            raise ValueError(f"axis sizes must be positive or -1 (variable), got {shape}")
        if shape[1:].count(-1) > 1:
            raise ValueError(f"at most one variable axis besides the batch, got {shape}")
        return shape

    @model_validator(mode="after")
    def _check_labels(self) -> TensorSpec:
        if self.labels is not None and self.shape[-1] != len(self.labels):
            raise ValueError(
                f"{self.name}: {len(self.labels)} labels for a last axis of {self.shape[-1]}"
            )
        if self.length_of is not None and self.variable_axis is None:
            raise ValueError(
                f"{self.name}: length_of={self.length_of!r} needs a variable axis (-1) besides "
                f"the batch, got shape {self.shape}"
            )
        default = self.default_value
        if default is not None and not (
            (self.min_value is None or default >= self.min_value)
            and (self.max_value is None or default <= self.max_value)
        ):
            raise ValueError(
                f"{self.name}: default_value {default:g} is outside the accepted range "
                f"[{self.min_value}, {self.max_value}]"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_keys(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Absent rather than null: the manifests (and version ids) written before the keys
        # existed stay what they were.
        document: dict[str, Any] = serialize(self)
        for key in ("length_of", "default_value"):
            if getattr(self, key) is None:
                document.pop(key, None)
        return document

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The dtype of this tensor's arrays outside the engine (bfloat16 travels as float32)."""
        return np.dtype(_NUMPY_DTYPES.get(self.dtype, self.dtype))

    @property
    def instance_shape(self) -> tuple[int, ...]:
        """The shape of one instance: the spec without its batch axis."""
        return self.shape[1:]

    @property
    def variable_axis(self) -> int | None:
        """Index of the variable axis within an instance (not counting the batch), if any."""
        return self.instance_shape.index(-1) if -1 in self.instance_shape else None

    def example_instances(self, rows: int, length: int, rng: np.random.Generator) -> Array:
        """``rows`` realistic instances for warm-up, ``length`` long on the variable axis:
        random values within the declared range, never the padding value (a batch of padding
        is not what requests send, and masked models fail on it)."""
        shape = (rows, *(length if size == -1 else size for size in self.instance_shape))
        dtype = self.numpy_dtype
        if dtype.kind == "b":
            return np.ones(shape, dtype=dtype) if self.pad_value == 0 else np.zeros(shape, dtype)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            low = int(self.min_value) if self.min_value is not None else max(info.min, 0)
            high = int(self.max_value) if self.max_value is not None else min(info.max, low + 99)
            values = rng.integers(low, high, size=shape, endpoint=True)
            if low < high:  # the padding value only where nothing else is allowed
                values[values == self.pad_value] = high if self.pad_value != high else low
            return values.astype(dtype)
        # Unbounded: [0, 1), the range of most normalised features and pixels.
        low_float = self.min_value if self.min_value is not None else 0.0
        if self.max_value is not None and self.min_value is None:
            low_float = min(0.0, self.max_value - 1.0)
        high_float = self.max_value if self.max_value is not None else low_float + 1.0
        return rng.uniform(low_float, high_float, size=shape).astype(dtype)


class Architecture(BaseModel):
    """The ``nn.Module`` class a state-dict format is loaded into, and its constructor kwargs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    import_path: str = Field(pattern=IMPORT_PATH_PATTERN.pattern)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class HandlerSpec(BaseModel):
    """The pre- and post-processing a version's front ends run around the model.

    ``import_path`` names a class (``module:Class``) in a module bundled with the version or
    in batchserve (``service.frontend.handlers.text:TextHandler``...); ``options`` are its
    constructor's keyword arguments. Operator configuration, packaged and hashed with the
    version: never taken from a request.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    import_path: str = Field(pattern=IMPORT_PATH_PATTERN.pattern)
    options: dict[str, Any] = Field(default_factory=dict)


class Manifest(BaseModel):
    """Everything the server needs to know about one model version.

    The version id is the first 12 hex characters of the SHA-256 of everything that decides
    the answers (``content_digest``): every file's hash (weights, tokenizer, bundled code),
    the format, architecture, tensors, handler and metadata. Only ``created_at`` is left out,
    so packaging the same thing twice gives the same version, and any change a new one.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    schema_version: int = SCHEMA_VERSION
    name: str = Field(pattern=NAME_PATTERN.pattern)
    version: str = Field(pattern=VERSION_PATTERN.pattern)
    format: ModelFormat
    artifact: str = Field(pattern=FILE_NAME_PATTERN.pattern)
    files: dict[str, str]
    """File name -> SHA-256 hex digest, for every file of the version except the manifest."""
    architecture: Architecture | None = None
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    handler: HandlerSpec | None = None
    created_at: datetime
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def create(cls, **fields: Any) -> Manifest:
        """A manifest whose version is computed from its content."""
        draft = cls(version="0" * VERSION_LENGTH, **fields)
        return draft.model_copy(update={"version": draft.content_digest()[:VERSION_LENGTH]})

    def content_digest(self) -> str:
        """SHA-256 of everything that decides the answers (all but version and created_at)."""
        document = self.model_dump(mode="json", exclude={"version", "created_at"})
        return hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()

    @property
    def version_matches_content(self) -> bool:
        return self.content_digest().startswith(self.version)

    @model_validator(mode="after")
    def _check_consistency(self) -> Manifest:
        for file_name, digest in self.files.items():
            if not FILE_NAME_PATTERN.fullmatch(file_name) or file_name == MANIFEST_FILE:
                raise ValueError(f"file names must be plain names, got {file_name!r}")
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"sha256 of {file_name!r} is not 64 hex characters")
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"manifest schema {self.schema_version} was written by an older batchserve, whose "
                f"version ids covered the weights only; package the model again (schema "
                f"{SCHEMA_VERSION})"
            )
        if self.artifact not in self.files:
            raise ValueError(f"the artifact {self.artifact!r} has no hash in files")
        if self.format in FORMATS_NEEDING_ARCHITECTURE and self.architecture is None:
            raise ValueError(f"format {self.format!r} needs an architecture (import path)")
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [spec.name for spec in specs]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"{kind} names must be unique, got {repeated} more than once")
        _check_length_ties(self.inputs, self.outputs)
        lengths = {spec.max_length for spec in self.inputs if spec.variable_axis is not None}
        if len(lengths) > 1:
            raise ValueError(
                "inputs with a variable axis share one length (e.g. ids and mask) and must "
                f"declare the same max_length, got {sorted(lengths, key=str)}"
            )
        return self

    @property
    def input(self) -> TensorSpec:
        """The first input: the only one of most models, and the one that decides batching."""
        return self.inputs[0]

    @property
    def output(self) -> TensorSpec:
        return self.outputs[0]

    @property
    def variable_input(self) -> TensorSpec | None:
        """The first input with a variable axis: its length buckets the requests."""
        return next((spec for spec in self.inputs if spec.variable_axis is not None), None)

    @property
    def bundled_modules(self) -> tuple[str, ...]:
        """Python modules shipped in the version folder (``name.py`` files), importable by the
        architecture and the handler without ``PYTHONPATH``."""
        return tuple(sorted(name[:-3] for name in self.files if name.endswith(".py")))

    @property
    def label(self) -> str:
        """``name@version``, as answers and logs show it."""
        return f"{self.name}@{self.version}"


def _check_length_ties(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> None:
    """``length_of`` is a key of outputs, naming an input with a variable axis."""
    variable = [spec.name for spec in inputs if spec.variable_axis is not None]
    for spec in inputs:
        if spec.length_of is not None:
            raise ValueError(
                f"input {spec.name!r}: length_of is a key of outputs (the input an output's "
                f"length follows), got length_of={spec.length_of!r} on an input"
            )
    for spec in outputs:
        if spec.length_of is not None and spec.length_of not in variable:
            raise ValueError(
                f"output {spec.name!r}: length_of must name an input with a variable axis "
                f"({variable or 'this model has none'}), got {spec.length_of!r}"
            )


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ModelNotFoundError(
            f"model names are plain identifiers (letters, digits, '_' and '-'), got {name!r}"
        )
    return name


def check_version(version: str) -> str:
    if version != "latest" and not VERSION_PATTERN.fullmatch(version):
        raise ModelNotFoundError(
            f"a version is 'latest' or {VERSION_LENGTH} lowercase hex characters, got {version!r}"
        )
    return version


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """The JSON-friendly view of a manifest shown by ``GET /models`` and the CLI."""
    return manifest.model_dump(mode="json")
