"""Importing the code a version names: a module bundled in its folder, or an installed one.

An architecture (``net:Classifier``) or a handler (``handler:Tokenize``) may live in a ``.py``
file packaged with the version, hashed like its weights, so the server needs no
``PYTHONPATH`` and a version always runs the code it was packaged with. Each bundled module
is imported under a name of its own version (two versions may both ship ``net.py``), from the
bytes whose hash was checked as they were read (never by opening the file again); an import
path whose module is not bundled is imported as usual (``service.models.digits``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from service.errors import ModelIntegrityError, ModelLoadError
from service.manifest import Manifest
from service.verified_files import read_verified

BUNDLE_PACKAGE = "_batchserve_bundled"


def import_attribute(import_path: str, manifest: Manifest, folder: Path) -> object:
    """The object ``module:Name`` names, its module taken from ``folder`` when bundled."""
    module_name, _, attribute = import_path.partition(":")
    try:
        if module_name in manifest.bundled_modules:
            module = _import_bundled(module_name, manifest, folder)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except (ModelLoadError, ModelIntegrityError):
        raise
    except Exception as error:
        bundled = ", ".join(f"{name}.py" for name in manifest.bundled_modules) or "none"
        raise ModelLoadError(
            f"{manifest.label}: cannot import {import_path!r}: {type(error).__name__}: {error} "
            f"(modules bundled with the version: {bundled})"
        ) from error


def _import_bundled(module_name: str, manifest: Manifest, folder: Path) -> ModuleType:
    qualified = f"{BUNDLE_PACKAGE}.{manifest.name}_{manifest.version}_{module_name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    file_name = f"{module_name}.py"
    loader = _VerifiedSource(read_verified(manifest, folder, file_name), str(folder / file_name))
    spec = importlib.util.spec_from_loader(qualified, loader, origin=loader.origin)
    if spec is None:
        raise ModelLoadError(f"{manifest.label}: {file_name} cannot be imported")
    spec.has_location = True  # __file__ names the file, for tracebacks
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]
        raise
    return module


class _VerifiedSource(importlib.abc.InspectLoader):
    """Runs a module from source bytes already verified, rather than re-reading its file."""

    def __init__(self, source: bytes, origin: str) -> None:
        self.source = source
        self.origin = origin

    def get_source(self, fullname: str) -> str:
        return importlib.util.decode_source(self.source)

    def exec_module(self, module: ModuleType) -> None:
        exec(compile(self.source, self.origin, "exec", dont_inherit=True), module.__dict__)
