"""Loading a verified version into an ``nn.Module``, and packaging a new one.

``ModelStore`` is the repository (``service/repository.py``) plus the one step that needs
torch: building the module. Loading verifies every file's hash before anything is
deserialized; a mismatch raises ``ModelIntegrityError`` and the model is never built. Weights
are read with safetensors or ``torch.load(weights_only=True)``: no arbitrary pickles.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from service.bundled import import_attribute
from service.engine.backends import AotiModule, OnnxModule
from service.engine.length_check import check_max_length
from service.engine.length_ties import tie_lengths
from service.engine.outputs import check_forward
from service.errors import ModelIntegrityError, ModelLoadError
from service.manifest import (
    ARTIFACT_SUFFIXES,
    FILE_NAME_PATTERN,
    FORMATS_NEEDING_ARCHITECTURE,
    MANIFEST_FILE,
    Architecture,
    HandlerSpec,
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
        folder = self.version_folder(manifest.name, manifest.version)
        module = build_module(manifest, folder / manifest.artifact, folder)
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
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        architecture: Architecture | None = None,
        handler: HandlerSpec | None = None,
        files: Sequence[Path] = (),
        metadata: Mapping[str, Any] | None = None,
        check_version: Callable[[Manifest, Path], None] | None = None,
    ) -> Manifest:
        """Copy ``artifact`` and ``files`` (a tokenizer, ``.py`` modules holding the
        architecture or the handler) into a new version folder and write its manifest.

        The version id covers all of it (``Manifest.content_digest``). The model is built
        and run once on example inputs first (``check``, with torch, in this process), so a
        version that cannot be served as declared is never written. Packaging the same
        things twice returns the existing version. ``check_version(manifest, folder)`` may
        check more (the CLI builds the handler), in a scratch folder holding every file but
        the artifact.
        """
        check_name(name)
        artifact_name = "model" + ARTIFACT_SUFFIXES[format]
        sources = {artifact_name: artifact}
        for path in files:
            if not FILE_NAME_PATTERN.fullmatch(path.name) or path.name == MANIFEST_FILE:
                raise ValueError(f"a packaged file needs a plain name, got {path.name!r}")
            if path.name in sources:
                raise ValueError(f"two packaged files are named {path.name!r}")
            sources[path.name] = path
        manifest = Manifest.create(
            name=name,
            format=format,
            artifact=artifact_name,
            files={file_name: sha256_of(path) for file_name, path in sources.items()},
            architecture=architecture,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            handler=handler,
            created_at=datetime.now(UTC),
            metadata=dict(metadata or {}),
        )
        if not self.has(manifest):
            manifest = check_module(manifest, sources, check_version)
        return self.add(manifest, sources)


def check_module(
    manifest: Manifest,
    sources: Mapping[str, Path],
    check_version: Callable[[Manifest, Path], None] | None = None,
) -> Manifest:
    """Build the module from ``sources`` (in a scratch copy of the version folder, so
    bundled modules import as they will when served) and run a forward on example inputs,
    checking the outputs against the manifest; raises ``ModelLoadError`` naming a mismatch.
    Returns the manifest with the outputs that follow an input's length tied to it
    (``length_ties``)."""
    with tempfile.TemporaryDirectory(prefix="batchserve-package-") as scratch:
        folder = Path(scratch)
        for file_name, source in sources.items():
            if file_name != manifest.artifact:
                shutil.copyfile(source, folder / file_name)
        module = build_module(manifest, sources[manifest.artifact], folder)
        manifest = tie_lengths(module, manifest)
        check_forward(module, manifest)
        check_max_length(module, manifest)
        if check_version is not None:
            check_version(manifest, folder)
    return manifest


def build_module(manifest: Manifest, artifact: Path, folder: Path) -> torch.nn.Module:
    """Deserialize ``artifact`` by format into an ``nn.Module`` on the CPU, in eval mode;
    an architecture bundled with the version is imported from ``folder``."""
    try:
        if manifest.format in FORMATS_NEEDING_ARCHITECTURE:
            assert manifest.architecture is not None  # guaranteed by Manifest validation
            module = instantiate(manifest.architecture, manifest, folder)
            state = _read_state_dict(manifest.format, artifact)
            module.load_state_dict(state, strict=True)
        elif manifest.format == "aoti":
            return AotiModule(artifact)
        elif manifest.format == "onnx":
            return OnnxModule(artifact, manifest)
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


def instantiate(architecture: Architecture, manifest: Manifest, folder: Path) -> torch.nn.Module:
    """Import the architecture's class (bundled with the version, or installed) and build
    it; only ``nn.Module`` subclasses are allowed."""
    cls = import_attribute(architecture.import_path, manifest, folder)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModelLoadError(f"{architecture.import_path!r} is not a torch.nn.Module subclass")
    module: torch.nn.Module = cls(**architecture.kwargs)
    return module
