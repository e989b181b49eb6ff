"""What a model version is: its manifest, with the names, dtypes and shapes of its tensors.

Pydantic only, no torch: the front ends validate requests against a ``TensorSpec`` and the
engines load what a ``Manifest`` describes. Names and versions are plain identifiers, checked
here before they reach a path.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.errors import ModelNotFoundError
from service.types import Array

MANIFEST_FILE = "manifest.json"
VERSION_LENGTH = 12
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
VERSION_PATTERN = re.compile(r"^[0-9a-f]{12}$")
FILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
IMPORT_PATH_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

ModelFormat = Literal["safetensors", "state_dict", "torchscript", "exported_program"]
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32"]
FORMATS_NEEDING_ARCHITECTURE: frozenset[str] = frozenset({"safetensors", "state_dict"})
ARTIFACT_SUFFIXES: dict[str, str] = {
    "safetensors": ".safetensors",
    "state_dict": ".pt",
    "torchscript": ".torchscript.pt",
    "exported_program": ".pt2",
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

    @property
    def instance_shape(self) -> tuple[int, ...]:
        """The shape of one instance: the spec without its batch axis."""
        return self.shape[1:]

    @property
    def variable_axis(self) -> int | None:
        """Index of the variable axis within an instance (not counting the batch), if any."""
        return self.instance_shape.index(-1) if -1 in self.instance_shape else None

    def example_instance(self, length: int = 1) -> Array:
        """A valid instance for warm-up, ``length`` long on the variable axis."""
        fill = self.min_value if self.min_value is not None else 0
        shape = [length if size == -1 else size for size in self.instance_shape]
        return np.full(shape, fill, dtype=self.dtype)


class Architecture(BaseModel):
    """The ``nn.Module`` class a state-dict format is loaded into, and its constructor kwargs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    import_path: str = Field(pattern=IMPORT_PATH_PATTERN.pattern)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class Manifest(BaseModel):
    """Everything the server needs to know about one model version."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    schema_version: Literal[1] = 1
    name: str = Field(pattern=NAME_PATTERN.pattern)
    version: str = Field(pattern=VERSION_PATTERN.pattern)
    format: ModelFormat
    artifact: str = Field(pattern=FILE_NAME_PATTERN.pattern)
    files: dict[str, str]
    """File name -> SHA-256 hex digest, for every file of the version except the manifest."""
    architecture: Architecture | None = None
    inputs: tuple[TensorSpec] = Field(description="Exactly one input tensor (for now).")
    outputs: tuple[TensorSpec]
    created_at: datetime
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_consistency(self) -> Manifest:
        for file_name, digest in self.files.items():
            if not FILE_NAME_PATTERN.fullmatch(file_name) or file_name == MANIFEST_FILE:
                raise ValueError(f"file names must be plain names, got {file_name!r}")
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"sha256 of {file_name!r} is not 64 hex characters")
        if self.artifact not in self.files:
            raise ValueError(f"the artifact {self.artifact!r} has no hash in files")
        if not self.files[self.artifact].startswith(self.version):
            raise ValueError("the version must be the first 12 hex characters of the artifact hash")
        if self.format in FORMATS_NEEDING_ARCHITECTURE and self.architecture is None:
            raise ValueError(f"format {self.format!r} needs an architecture (import path)")
        return self

    @property
    def input(self) -> TensorSpec:
        return self.inputs[0]

    @property
    def output(self) -> TensorSpec:
        return self.outputs[0]

    @property
    def label(self) -> str:
        """``name@version``, as answers and logs show it."""
        return f"{self.name}@{self.version}"


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
