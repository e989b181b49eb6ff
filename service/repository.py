"""The model repository on disk: ``<root>/<name>/<version>/manifest.json`` plus its files.

A version id is the first 12 hex characters of the SHA-256 of everything that decides the
answers (``Manifest.content_digest``: every file's hash, the tensors, architecture, handler and
metadata), so packaging the same thing twice gives the same version and any change a new one.
This module lists, reads and verifies versions, and writes new ones atomically; it never
deserializes an artifact (``engine/model_store.py`` does, after ``verify``), so the front ends
and the CLI can use it without torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from service.errors import ModelIntegrityError, ModelNotFoundError
from service.manifest import (
    MANIFEST_FILE,
    NAME_PATTERN,
    VERSION_LENGTH,
    VERSION_PATTERN,
    Manifest,
    check_name,
    check_version,
)

logger = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ModelRepository:
    """Lists, reads and verifies model versions under one root folder, and adds new ones."""

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
                manifests.append(self.read_manifest(name, entry.name))
            except ModelIntegrityError as error:
                logger.warning(
                    "manifest_unreadable",
                    extra={"model": name, "version": entry.name, "error": str(error)},
                )
        return sorted(manifests, key=lambda manifest: (manifest.created_at, manifest.version))

    def version_ids(self, name: str) -> list[str]:
        """Every version folder of ``name``, readable or not (``models verify`` reports each)."""
        folder = self.root / check_name(name)
        if not folder.is_dir():
            raise ModelNotFoundError(f"no model named {name!r} in the repository")
        return sorted(
            entry.name
            for entry in folder.iterdir()
            if entry.is_dir() and VERSION_PATTERN.fullmatch(entry.name)
        )

    def resolve(self, name: str, version: str = "latest") -> Manifest:
        """The manifest of ``name`` at ``version`` (``latest``: newest by creation time)."""
        check_version(version)
        if version != "latest":
            if not (self.root / check_name(name) / version / MANIFEST_FILE).is_file():
                raise ModelNotFoundError(f"model {name!r} has no version {version!r}")
            return self.read_manifest(name, version)
        manifests = self.versions(name)
        if not manifests:
            reasons = []
            for version_id in self.version_ids(name)[:3]:
                try:
                    self.read_manifest(name, version_id)
                except ModelIntegrityError as error:
                    reasons.append(str(error))
            why = f": {'; '.join(reasons)}" if reasons else ""
            raise ModelNotFoundError(f"model {name!r} has no readable version{why}")
        return manifests[-1]

    def verify(self, manifest: Manifest, *, weights: bool = True) -> None:
        """Check the manifest against its version id and every file against its recorded
        SHA-256; raise ``ModelIntegrityError`` if anything differs.

        ``weights=False`` skips the artifact: a front end checks the files it reads itself
        (tokenizer, handler code) without hashing gigabytes of weights it never opens.
        """
        if not manifest.version_matches_content:
            raise ModelIntegrityError(
                f"{manifest.label}: the manifest does not match its version id (its content "
                f"hashes to {manifest.content_digest()[:VERSION_LENGTH]}): it was edited after "
                "packaging; package the model again instead; refusing to load"
            )
        folder = self.version_folder(manifest.name, manifest.version)
        for file_name, expected in manifest.files.items():
            if not weights and file_name == manifest.artifact:
                continue
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

    def has(self, manifest: Manifest) -> bool:
        """Whether the version ``manifest`` names is in the repository already."""
        folder = self.version_folder(manifest.name, manifest.version)
        return (folder / MANIFEST_FILE).is_file()

    def version_folder(self, name: str, version: str) -> Path:
        if not VERSION_PATTERN.fullmatch(version):
            raise ModelNotFoundError(f"invalid version {version!r}")
        return self.root / check_name(name) / version

    def read_manifest(self, name: str, version: str) -> Manifest:
        path = self.version_folder(name, version) / MANIFEST_FILE
        try:
            manifest = Manifest.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as error:
            raise ModelIntegrityError(
                f"{name}@{version}: manifest unreadable or invalid: {one_line(error)}"
            ) from error
        if manifest.name != name or manifest.version != version:
            raise ModelIntegrityError(
                f"{name}@{version}: the manifest describes {manifest.name}@{manifest.version}"
            )
        return manifest

    def add(self, manifest: Manifest, sources: Mapping[str, Path]) -> Manifest:
        """Copy each file in (``sources``: file name in the version -> where it is now) as
        ``manifest`` describes; an existing version is kept as is.

        The files are written into a temporary sibling folder that is then renamed, so a
        half-written version never appears.
        """
        if set(sources) != set(manifest.files):
            raise ValueError(f"files {sorted(sources)} differ from the manifest's")
        if self.has(manifest):
            return self.read_manifest(manifest.name, manifest.version)
        target = self.version_folder(manifest.name, manifest.version)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{manifest.version}-", dir=target.parent))
        try:
            for file_name, source in sources.items():
                shutil.copyfile(source, staging / file_name)
            (staging / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
            staging.chmod(0o755)  # mkdtemp makes it private; servers run as other users
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("model_packaged", extra={"model": manifest.name, "version": manifest.version})
        return manifest


def one_line(error: BaseException, limit: int = 400) -> str:
    """The error's text on one line (state-dict errors list the mismatched keys), capped."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
