"""Writing a version into the repository, or repairing one that is there already.

The files are copied into a staging folder beside the model folders while they are hashed
(``Staging``), so the manifest records the hashes of the bytes written, not of a source that
may change between hashing and copying. A new version is then renamed into place at once: a
half-written version never appears. Over an existing version (the same id: the same files),
every file is checked, and each damaged or missing one is replaced atomically from the staged
copy; what cannot be replaced is refused naming it, so packaging never reports success while
the version stays broken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from service.errors import ModelIntegrityError
from service.manifest import FILE_NAME_PATTERN, MANIFEST_FILE, Manifest
from service.repository import ModelRepository, one_line
from service.verified_files import copy_hashing, hash_file

logger = logging.getLogger(__name__)


class Staging:
    """A private folder under the repository's root holding copies of the files to package,
    with the SHA-256 of each as written; removed on exit unless committed."""

    def __init__(self, repository: ModelRepository, sources: Mapping[str, Path]) -> None:
        self.repository = repository
        created = not repository.root.exists()
        repository.root.mkdir(parents=True, exist_ok=True)
        self._root_created = created
        # A dot-folder: never listed as a model (names start with a letter or digit).
        self.folder = Path(tempfile.mkdtemp(prefix=".staging-", dir=repository.root))
        self.files: dict[str, str] = {}
        try:
            for file_name, source in sources.items():
                if not FILE_NAME_PATTERN.fullmatch(file_name) or file_name == MANIFEST_FILE:
                    raise ValueError(f"a packaged file needs a plain name, got {file_name!r}")
                with source.open("rb") as file:
                    self.files[file_name] = copy_hashing(file, self.folder / file_name)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._root_created:
            with contextlib.suppress(OSError):  # only if packaging left nothing else there
                self.repository.root.rmdir()

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.folder.exists():
            self.remove()

    def commit(self, manifest: Manifest) -> tuple[Manifest, tuple[str, ...]]:
        """Put the staged version in place; over an existing one, repair it. Returns the
        manifest in the repository and the names of the files replaced (none for a new
        version or an intact one). ``ModelIntegrityError`` names a file that stays damaged."""
        if set(self.files) != set(manifest.files):
            raise ValueError(f"files {sorted(self.files)} differ from the manifest's")
        target = self.repository.version_folder(manifest.name, manifest.version)
        if not target.exists():
            (self.folder / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
            self.folder.chmod(0o755)  # mkdtemp makes it private; servers run as other users
            target.parent.mkdir(exist_ok=True)
            try:
                os.rename(self.folder, target)
            except OSError:
                if not target.exists():
                    raise
                # Written meanwhile by another packaging of the same things: check it instead.
                self.folder.chmod(0o700)
                return self._repair(manifest, target)
            self._root_created = False
            logger.info(
                "model_packaged", extra={"model": manifest.name, "version": manifest.version}
            )
            return manifest, ()
        return self._repair(manifest, target)

    def _repair(self, manifest: Manifest, target: Path) -> tuple[Manifest, tuple[str, ...]]:
        replaced: list[str] = []
        for file_name in manifest.files:
            try:
                intact = hash_file(manifest, target, file_name) == manifest.files[file_name]
            except ModelIntegrityError:  # missing, a link leading out, not a regular file
                intact = False
            if not intact:
                _replace(manifest, target, file_name, self.folder / file_name)
                replaced.append(file_name)
        kept = _readable_manifest(self.repository, manifest)
        if kept is None:
            staged = self.folder / MANIFEST_FILE
            staged.write_text(manifest.model_dump_json(indent=2) + "\n")
            _replace(manifest, target, MANIFEST_FILE, staged)
            replaced.append(MANIFEST_FILE)
            kept = manifest
        self.repository.verify(kept)  # raises naming any file still damaged
        if replaced:
            logger.info("model_repaired", extra={"model": manifest.label, "files": replaced})
        return kept, tuple(replaced)


def _readable_manifest(repository: ModelRepository, manifest: Manifest) -> Manifest | None:
    """The manifest on disk when it describes the same content (its creation time kept)."""
    try:
        existing = repository.read_manifest(manifest.name, manifest.version)
    except ModelIntegrityError:
        return None
    return existing if existing.content_digest() == manifest.content_digest() else None


def _replace(manifest: Manifest, target: Path, file_name: str, source: Path) -> None:
    """Replace ``target / file_name`` by a copy of ``source`` in one rename."""
    partial = target / f".{file_name}.repair"
    try:
        shutil.copyfile(source, partial)
        os.chmod(partial, 0o644)
        os.replace(partial, target / file_name)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"{manifest.label}: {file_name!r} is damaged or missing and cannot be replaced "
            f"({one_line(error)}); remove the folder {target} and package again"
        ) from error
