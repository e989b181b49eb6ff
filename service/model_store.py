"""The model repository: ``<root>/<name>/<version>/manifest.json`` plus artifact files.

A version id is the first 12 hex characters of the artifact's SHA-256, so the same weights
always get the same version and different weights never share one. Loading verifies every
file's hash before anything is deserialized; a mismatch raises ``ModelIntegrityError`` and the
model is never built. Weights are read with safetensors or ``torch.load(weights_only=True)``:
no arbitrary pickles.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors.torch import load_file as load_safetensors

from service.errors import ModelIntegrityError, ModelLoadError, ModelNotFoundError

logger = logging.getLogger(__name__)

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

    def example_instance(self, length: int = 1) -> npt.NDArray[np.generic]:
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


@dataclass(frozen=True)
class LoadedModel:
    manifest: Manifest
    module: torch.nn.Module


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


class ModelStore:
    """Lists, verifies, loads and packages model versions under one root folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and NAME_PATTERN.fullmatch(entry.name)
        )

    def versions(self, name: str) -> list[Manifest]:
        """Every readable version of ``name``, oldest first (by manifest creation time)."""
        folder = self.root / check_name(name)
        if not folder.is_dir():
            raise ModelNotFoundError(f"no model named {name!r} in the repository")
        manifests = []
        for entry in folder.iterdir():
            if not (entry.is_dir() and VERSION_PATTERN.fullmatch(entry.name)):
                continue
            try:
                manifests.append(self._read_manifest(name, entry.name))
            except ModelIntegrityError as error:
                logger.warning(
                    "manifest_unreadable",
                    extra={"model": name, "version": entry.name, "error": str(error)},
                )
        return sorted(manifests, key=lambda manifest: (manifest.created_at, manifest.version))

    def resolve(self, name: str, version: str = "latest") -> Manifest:
        """The manifest of ``name`` at ``version`` (``latest``: newest by creation time)."""
        check_version(version)
        if version != "latest":
            if not (self.root / check_name(name) / version / MANIFEST_FILE).is_file():
                raise ModelNotFoundError(f"model {name!r} has no version {version!r}")
            return self._read_manifest(name, version)
        manifests = self.versions(name)
        if not manifests:
            raise ModelNotFoundError(f"model {name!r} has no readable version")
        return manifests[-1]

    def verify(self, manifest: Manifest) -> None:
        """Check every file against its recorded SHA-256; raise ``ModelIntegrityError`` if not."""
        folder = self._version_folder(manifest.name, manifest.version)
        for file_name, expected in manifest.files.items():
            path = folder / file_name
            if not path.is_file():
                raise ModelIntegrityError(
                    f"{manifest.name}@{manifest.version}: file {file_name!r} is missing"
                )
            actual = sha256_of(path)
            if actual != expected:
                raise ModelIntegrityError(
                    f"{manifest.name}@{manifest.version}: {file_name!r} has sha256 "
                    f"{actual[:16]}…, the manifest records {expected[:16]}…; refusing to load"
                )

    def load(self, name: str, version: str = "latest") -> LoadedModel:
        """Resolve, verify every hash, then build the model on the CPU."""
        manifest = self.resolve(name, version)
        self.verify(manifest)
        artifact = self._version_folder(manifest.name, manifest.version) / manifest.artifact
        module = build_module(manifest, artifact)
        logger.info(
            "model_loaded",
            extra={"model": manifest.name, "version": manifest.version, "format": manifest.format},
        )
        return LoadedModel(manifest=manifest, module=module)

    def package(
        self,
        *,
        name: str,
        artifact: Path,
        format: ModelFormat,
        inputs: tuple[TensorSpec],
        outputs: tuple[TensorSpec],
        architecture: Architecture | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Copy ``artifact`` into a new hash-named version folder and write its manifest.

        The artifact is loaded once first, so a version that cannot be served is never
        written. Packaging the same artifact twice returns the existing version.
        """
        check_name(name)
        digest = sha256_of(artifact)
        version = digest[:VERSION_LENGTH]
        artifact_name = "model" + ARTIFACT_SUFFIXES[format]
        manifest = Manifest(
            name=name,
            version=version,
            format=format,
            artifact=artifact_name,
            files={artifact_name: digest},
            architecture=architecture,
            inputs=inputs,
            outputs=outputs,
            created_at=datetime.now(UTC),
            metadata=dict(metadata or {}),
        )
        target = self._version_folder(name, version)
        if (target / MANIFEST_FILE).is_file():
            return self._read_manifest(name, version)
        build_module(manifest, artifact)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write into a temporary sibling and rename, so a half-written version never appears.
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
        try:
            shutil.copyfile(artifact, staging / artifact_name)
            (staging / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
            staging.chmod(0o755)  # mkdtemp makes it private; servers run as other users
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("model_packaged", extra={"model": name, "version": version})
        return manifest

    def _version_folder(self, name: str, version: str) -> Path:
        if not VERSION_PATTERN.fullmatch(version):
            raise ModelNotFoundError(f"invalid version {version!r}")
        return self.root / check_name(name) / version

    def _read_manifest(self, name: str, version: str) -> Manifest:
        path = self._version_folder(name, version) / MANIFEST_FILE
        try:
            manifest = Manifest.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as error:
            raise ModelIntegrityError(
                f"{name}@{version}: manifest unreadable or invalid: {_summary(error)}"
            ) from error
        if manifest.name != name or manifest.version != version:
            raise ModelIntegrityError(
                f"{name}@{version}: the manifest describes {manifest.name}@{manifest.version}"
            )
        return manifest


def build_module(manifest: Manifest, artifact: Path) -> torch.nn.Module:
    """Deserialize ``artifact`` by format into an ``nn.Module`` on the CPU, in eval mode."""
    try:
        if manifest.format in FORMATS_NEEDING_ARCHITECTURE:
            assert manifest.architecture is not None  # guaranteed by Manifest validation
            module = instantiate(manifest.architecture)
            state = _read_state_dict(manifest.format, artifact)
            module.load_state_dict(state, strict=True)
        elif manifest.format == "torchscript":
            module = torch.jit.load(str(artifact), map_location="cpu")  # type: ignore[no-untyped-call]
        else:
            # An exported module's train/eval behaviour is fixed when it is exported, and it
            # raises NotImplementedError on eval(): return it as it is.
            exported: torch.nn.Module = torch.export.load(artifact).module()
            return exported
    except (ModelLoadError, ModelIntegrityError):
        raise
    except Exception as error:
        raise ModelLoadError(
            f"{manifest.name}@{manifest.version}: cannot load {manifest.format} artifact: "
            f"{_summary(error)}"
        ) from error
    return module.eval() if hasattr(module, "eval") else module


def _read_state_dict(format: str, artifact: Path) -> Mapping[str, torch.Tensor]:
    if format == "safetensors":
        return load_safetensors(str(artifact), device="cpu")
    # weights_only refuses any pickled object that is not tensors and plain containers.
    state = torch.load(artifact, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise ModelLoadError(f"a state_dict artifact must hold a mapping, got {type(state)}")
    return state


def instantiate(architecture: Architecture) -> torch.nn.Module:
    """Import the architecture's class and build it; only ``nn.Module`` subclasses are allowed."""
    module_name, _, class_name = architecture.import_path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ModelLoadError(
            f"cannot import architecture {architecture.import_path!r}: {error}"
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModelLoadError(f"{architecture.import_path!r} is not a torch.nn.Module subclass")
    module: torch.nn.Module = cls(**architecture.kwargs)
    return module


def _summary(error: BaseException, limit: int = 400) -> str:
    """The error's text on one line (state-dict errors list the mismatched keys), capped."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """The JSON-friendly view of a manifest shown by ``GET /models`` and the CLI."""
    return manifest.model_dump(mode="json")
