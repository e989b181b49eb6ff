"""Packaging a model as a new version: files staged while hashed, the model built and run
once on example inputs, then the version written (or an existing one repaired).

``Packager`` is what ``batchserve package``, ``batchserve export``, the scripts and the tests
call. It builds the module through the engine's own load path (``build_module``), so a version
that packaging accepts is one the engine can load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NotRequired, TypedDict, Unpack

from service.engine.length_ties import tie_lengths
from service.engine.model_store import build_module
from service.engine.outputs import check_forward, check_max_length
from service.manifest import (
    ARTIFACT_SUFFIXES,
    Architecture,
    HandlerSpec,
    Manifest,
    ModelFormat,
    TensorSpec,
    check_name,
)
from service.packaging.writing import Staging
from service.repository import ModelRepository

#: Checks a version beyond its module (the CLI builds the handler), given the folder holding
#: every file of the version.
VersionCheck = Callable[[Manifest, Path], None]


@dataclass(frozen=True)
class Packaged:
    manifest: Manifest
    """The version in the repository (an existing one keeps its creation time)."""
    repaired: tuple[str, ...]
    """Files of an existing version that were damaged or missing and have been replaced."""


class VersionSpec(TypedDict):
    """``Packager.package_version``'s arguments."""

    name: str
    artifact: Path
    format: ModelFormat
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    architecture: NotRequired[Architecture | None]
    handler: NotRequired[HandlerSpec | None]
    files: NotRequired[Sequence[Path]]
    metadata: NotRequired[Mapping[str, Any] | None]
    check_version: NotRequired[VersionCheck | None]


class Packager:
    """Writes new versions into the repository at ``root``."""

    def __init__(self, root: Path) -> None:
        self.repository = ModelRepository(root)
        self.root = root

    def package(self, **spec: Unpack[VersionSpec]) -> Manifest:
        """``package_version``'s manifest."""
        return self.package_version(**spec).manifest

    def package_version(
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
        check_version: VersionCheck | None = None,
    ) -> Packaged:
        """Copy ``artifact`` and ``files`` (a tokenizer, ``.py`` modules holding the
        architecture or the handler) into a new version folder and write its manifest.

        The version id covers all of it (``Manifest.content_digest``), hashed as copied. The
        model is built from the copies and run once on example inputs first (with torch, in
        this process), so a version that cannot be served as declared is never written;
        ``check_version(manifest, folder)`` may check more. Packaging the same things again
        checks the version there: each damaged or missing file is replaced from the given
        ones (they hash to the same id), and one that cannot be is refused, naming it.
        """
        check_name(name)
        sources = {"model" + ARTIFACT_SUFFIXES[format]: artifact}
        for path in files:
            if path.name in sources:
                raise ValueError(f"two packaged files are named {path.name!r}")
            sources[path.name] = path
        with Staging(self.repository, sources) as staging:
            manifest = Manifest.create(
                name=name,
                format=format,
                artifact="model" + ARTIFACT_SUFFIXES[format],
                files=staging.files,
                architecture=architecture,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                handler=handler,
                created_at=datetime.now(UTC),
                metadata=dict(metadata or {}),
            )
            if not self.repository.has(manifest):
                manifest = check_module(manifest, staging.folder, check_version)
            kept, repaired = staging.commit(manifest)
        return Packaged(kept, repaired)


def check_module(
    manifest: Manifest, folder: Path, check_version: VersionCheck | None = None
) -> Manifest:
    """Build the module from ``folder`` (every file of the version) as the engine will, and
    run a forward on example inputs, checking the outputs against the manifest; raises
    ``ModelLoadError`` naming a mismatch. Returns the manifest with the outputs that follow
    an input's length tied to it (``length_ties``: a new version id when any is)."""
    module = build_module(manifest, folder)
    manifest = tie_lengths(module, manifest)
    check_forward(module, manifest)
    check_max_length(module, manifest)
    if check_version is not None:
        check_version(manifest, folder)
    return manifest
