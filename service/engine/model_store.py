"""Loading a verified version into an ``nn.Module``.

``ModelStore`` is the repository (``service/repository.py``) plus the one step that needs
torch: building the module, from the bytes whose hashes were checked as they were read
(``service/verified_files.py``). Weights are read with safetensors or
``torch.load(weights_only=True)``: no arbitrary pickles.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from service.bundled import import_attribute
from service.engine.backends import AotiModule, OnnxModule
from service.errors import ModelIntegrityError, ModelLoadError
from service.manifest import FORMATS_NEEDING_ARCHITECTURE, Architecture, Manifest
from service.repository import ModelRepository, one_line
from service.verified_files import PrivateCopy, read_verified

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    manifest: Manifest
    module: torch.nn.Module


class ModelStore(ModelRepository):
    """The repository, able to load versions into modules."""

    def load(self, name: str, version: str = "latest") -> LoadedModel:
        """Resolve, check the manifest and the small files, then build the model on the CPU
        from the artifact's bytes as verified when read."""
        manifest = self.resolve(name, version)
        self.verify(manifest, weights=False)
        module = build_module(manifest, self.version_folder(manifest.name, manifest.version))
        logger.info(
            "model_loaded",
            extra={"model": manifest.name, "version": manifest.version, "format": manifest.format},
        )
        return LoadedModel(manifest=manifest, module=module)


def build_module(manifest: Manifest, folder: Path) -> torch.nn.Module:
    """The version in ``folder`` as an ``nn.Module`` on the CPU, in eval mode: the artifact
    (and any bundled architecture) read once, hashed, and deserialized from those bytes.
    ``ModelIntegrityError`` when a file does not match its hash, ``ModelLoadError`` when the
    verified artifact cannot be deserialized."""
    try:
        if manifest.format in FORMATS_NEEDING_ARCHITECTURE:
            assert manifest.architecture is not None  # guaranteed by Manifest validation
            state = _read_state_dict(manifest, folder)  # its bytes are freed on return
            module = instantiate(manifest.architecture, manifest, folder)
            module.load_state_dict(state, strict=True)
        elif manifest.format == "aoti":
            # AOTInductor loads from a path: a private copy, written while hashing, unpacked
            # by torch when loading and no longer needed after.
            with PrivateCopy() as copy:
                return AotiModule(copy.add(manifest, folder, manifest.artifact))
        elif manifest.format == "onnx":
            return OnnxModule(read_verified(manifest, folder, manifest.artifact), manifest)
        elif manifest.format == "torchscript":
            data = io.BytesIO(read_verified(manifest, folder, manifest.artifact))
            module = torch.jit.load(data, map_location="cpu")  # type: ignore[no-untyped-call]
        else:
            # An exported module's train/eval behaviour is fixed when it is exported, and it
            # raises NotImplementedError on eval(): return it as it is.
            data = io.BytesIO(read_verified(manifest, folder, manifest.artifact))
            exported: torch.nn.Module = torch.export.load(data).module()
            return exported
    except (ModelLoadError, ModelIntegrityError):
        raise
    except Exception as error:
        raise ModelLoadError(
            f"{manifest.name}@{manifest.version}: cannot load {manifest.format} artifact: "
            f"{one_line(error)}"
        ) from error
    return module.eval() if hasattr(module, "eval") else module


def _read_state_dict(manifest: Manifest, folder: Path) -> Mapping[str, torch.Tensor]:
    data = read_verified(manifest, folder, manifest.artifact)
    if manifest.format == "safetensors":
        tensors: Mapping[str, torch.Tensor] = load_safetensors(data)
        return tensors
    # weights_only refuses any pickled object that is not tensors and plain containers.
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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
