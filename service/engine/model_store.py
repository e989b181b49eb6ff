"""Loading a verified version into an ``nn.Module``, and packaging a new one.

``ModelStore`` is the repository (``service/repository.py``) plus the one step that needs
torch: building the module. Loading verifies every file's hash before anything is
deserialized; a mismatch raises ``ModelIntegrityError`` and the model is never built. Weights
are read with safetensors or ``torch.load(weights_only=True)``: no arbitrary pickles.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from service.errors import ModelIntegrityError, ModelLoadError
from service.manifest import (
    ARTIFACT_SUFFIXES,
    FORMATS_NEEDING_ARCHITECTURE,
    VERSION_LENGTH,
    Architecture,
    Manifest,
    ModelFormat,
    TensorSpec,
    check_name,
)
from service.repository import ModelRepository, one_line, sha256_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    manifest: Manifest
    module: torch.nn.Module


class ModelStore(ModelRepository):
    """The repository, able to load versions into modules and to package new ones."""

    def load(self, name: str, version: str = "latest") -> LoadedModel:
        """Resolve, verify every hash, then build the model on the CPU."""
        manifest = self.resolve(name, version)
        self.verify(manifest)
        artifact = self.version_folder(manifest.name, manifest.version) / manifest.artifact
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
        artifact_name = "model" + ARTIFACT_SUFFIXES[format]
        manifest = Manifest(
            name=name,
            version=digest[:VERSION_LENGTH],
            format=format,
            artifact=artifact_name,
            files={artifact_name: digest},
            architecture=architecture,
            inputs=inputs,
            outputs=outputs,
            created_at=datetime.now(UTC),
            metadata=dict(metadata or {}),
        )
        if not self.has(manifest):
            build_module(manifest, artifact)
        return self.add(manifest, artifact)


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
            f"{one_line(error)}"
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
