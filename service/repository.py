"""The model repository on disk: ``<root>/<name>/<version>/manifest.json`` plus its files.

A version id is the first 12 hex characters of the SHA-256 of everything that decides the
answers (``Manifest.content_digest``: every file's hash, the tensors, architecture, handler and
metadata), so packaging the same thing twice gives the same version and any change a new one.
This module lists, reads and verifies versions without torch; ``engine/model_store.py`` loads
them and ``service/packaging/`` writes them.

``latest`` is the newest version by creation time that ``batchserve package`` wrote: a
version ``batchserve export`` wrote (its metadata names ``exported_from``) is served only when
named by its id, so an export never becomes the served version by being newer.
"""

from __future__ import annotations

import hashlib
import logging
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
from service.verified_files import PrivateCopy, check_digest, hash_file

logger = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


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
        """The manifest of ``name`` at ``version``; ``latest``: the newest packaged version by
        creation time (exports are served only by id: ``is_export``)."""
        check_version(version)
        if version != "latest":
            if not (self.root / check_name(name) / version / MANIFEST_FILE).is_file():
                raise ModelNotFoundError(f"model {name!r} has no version {version!r}")
            return self.read_manifest(name, version)
        manifests = self.versions(name)
        packaged = [manifest for manifest in manifests if not is_export(manifest)]
        if packaged:
            return packaged[-1]
        if manifests:
            exports = ", ".join(manifest.version for manifest in manifests)
            raise ModelNotFoundError(
                f"model {name!r} has only exported versions ({exports}): 'latest' is the newest "
                "version written by `batchserve package`; name an export's version id to serve it"
            )
        reasons = []
        for version_id in self.version_ids(name)[:3]:
            try:
                self.read_manifest(name, version_id)
            except ModelIntegrityError as error:
                reasons.append(str(error))
        why = f": {'; '.join(reasons)}" if reasons else ""
        raise ModelNotFoundError(f"model {name!r} has no readable version{why}")

    def verify(self, manifest: Manifest, *, weights: bool = True) -> None:
        """Check the manifest against its version id and every file against its recorded
        SHA-256; raise ``ModelIntegrityError`` if anything differs, or if a file is a link
        leading out of the version folder.

        ``weights=False`` skips the artifact: the engine hashes the artifact as it reads it
        to load it (``service/verified_files.py``), once.
        """
        self.check_manifest(manifest)
        folder = self.version_folder(manifest.name, manifest.version)
        for file_name in manifest.files:
            if weights or file_name != manifest.artifact:
                check_digest(manifest, file_name, hash_file(manifest, folder, file_name))

    def check_manifest(self, manifest: Manifest) -> None:
        """Raise ``ModelIntegrityError`` unless the manifest hashes to its version id."""
        if not manifest.version_matches_content:
            raise ModelIntegrityError(
                f"{manifest.label}: the manifest does not match its version id (its content "
                f"hashes to {manifest.content_digest()[:VERSION_LENGTH]}): it was edited after "
                "packaging; package the model again instead; refusing to load"
            )

    def verified_copy(self, manifest: Manifest) -> PrivateCopy:
        """A private copy of the version's files but the artifact (a tokenizer, handler code),
        each written from the bytes whose hash was checked: what a handler reads by path.
        The manifest is checked against its id first."""
        self.check_manifest(manifest)
        folder = self.version_folder(manifest.name, manifest.version)
        copy = PrivateCopy()
        try:
            for file_name in manifest.files:
                if file_name != manifest.artifact:
                    copy.add(manifest, folder, file_name)
        except BaseException:
            copy.remove()
            raise
        return copy

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


def is_export(manifest: Manifest) -> bool:
    """Whether ``batchserve export`` wrote the version (``latest`` never names one)."""
    return "exported_from" in manifest.metadata


def one_line(error: BaseException, limit: int = 400) -> str:
    """The error's text on one line (state-dict errors list the mismatched keys), capped."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
