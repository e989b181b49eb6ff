"""Reading a version's files once, so the bytes whose hash was checked are the bytes used.

Hashing a file and then opening it again by path to load it lets the file, or a symlink to
it, change in between: the hash vouches for bytes that are never loaded. Here each file is
read once and hashed, then handed over as those bytes (``read_verified``), or written while
it is hashed into a private copy (``PrivateCopy``: a 0700 temporary folder) for a reader that
needs a path (an AOTInductor package, a handler opening its tokenizer). A file that is a link
leading out of the version folder, or that is not a regular file, is refused.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from service.errors import ModelIntegrityError
from service.manifest import Manifest

_BLOCK_BYTES = 1 << 20


def open_inside(manifest: Manifest, folder: Path, file_name: str) -> io.BufferedReader:
    """``folder / file_name`` opened for reading, if it is a regular file whose real path is
    inside the real ``folder``; ``ModelIntegrityError`` otherwise (missing, a link leading
    out of the folder, a FIFO or device)."""
    path = folder / file_name
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling link, or a loop of links
        raise ModelIntegrityError(f"{manifest.label}: file {file_name!r} is missing") from None
    if not real.is_relative_to(folder.resolve()):
        raise ModelIntegrityError(
            f"{manifest.label}: {file_name!r} is a link to {real}, outside the version folder; "
            "a version's files must be in its folder (copy the file in); refusing to load"
        )
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a file.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ModelIntegrityError(
            f"{manifest.label}: {file_name!r} is not a regular file; refusing to load"
        )
    return os.fdopen(descriptor, "rb")


def check_digest(manifest: Manifest, file_name: str, actual: str) -> None:
    """Raise ``ModelIntegrityError`` unless ``actual`` is the SHA-256 the manifest records."""
    expected = manifest.files[file_name]
    if actual != expected:
        raise ModelIntegrityError(
            f"{manifest.label}: {file_name!r} has sha256 {actual[:16]}…, the manifest records "
            f"{expected[:16]}…; refusing to load"
        )


def hash_file(manifest: Manifest, folder: Path, file_name: str) -> str:
    """The SHA-256 of the file as read now, streamed (nothing is kept)."""
    with open_inside(manifest, folder, file_name) as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def copy_hashing(file: BinaryIO, target: Path) -> str:
    """Copy ``file`` into a new file ``target``; the SHA-256 of what was written."""
    digest = hashlib.sha256()
    with target.open("xb") as copy:
        for block in iter(lambda: file.read(_BLOCK_BYTES), b""):
            digest.update(block)
            copy.write(block)
    return digest.hexdigest()


def read_verified(manifest: Manifest, folder: Path, file_name: str) -> bytes:
    """The file's bytes, read once, after checking that they hash to the manifest's record."""
    with open_inside(manifest, folder, file_name) as file:
        data = file.read()
    check_digest(manifest, file_name, hashlib.sha256(data).hexdigest())
    return data


class PrivateCopy:
    """A temporary folder only this user can read (0700) holding copies of a version's files,
    each written from the bytes whose hash was checked as they were read.

    Used as a context manager, the folder is removed on exit, unless ``keep_while(owner)``
    ties it to an object that reads from it later (it goes when that object is collected,
    or at exit).
    """

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="batchserve-verified-"))
        self._kept = False

    def add(self, manifest: Manifest, source: Path, file_name: str) -> Path:
        """Copy ``source / file_name`` in, hashing what is written; a mismatch removes the
        copy and raises ``ModelIntegrityError``."""
        target = self.folder / file_name
        with open_inside(manifest, source, file_name) as file:
            digest = copy_hashing(file, target)
        try:
            check_digest(manifest, file_name, digest)
        except ModelIntegrityError:
            target.unlink()
            raise
        return target

    def keep_while(self, owner: object) -> None:
        """Keep the folder while ``owner`` lives (instead of removing it on exit)."""
        try:
            weakref.finalize(owner, shutil.rmtree, str(self.folder), True)
        except TypeError:  # an owner without weak references (__slots__): kept until exit
            atexit.register(shutil.rmtree, str(self.folder), True)
        self._kept = True

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PrivateCopy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._kept or error is not None:
            self.remove()
