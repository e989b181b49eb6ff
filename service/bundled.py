"""Importing the code a version names: a module bundled in its folder, or an installed one.

An architecture (``net:Classifier``) or a handler (``handler:Tokenize``) may live in a ``.py``
file packaged with the version, hashed like its weights, so the server needs no
``PYTHONPATH`` and a version always runs the code it was packaged with. Each bundled module
is imported under a name of its own version (two versions may both ship ``net.py``); an
import path whose module is not bundled is imported as usual (``service.models.digits``).
Callers verify the files' hashes first.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from service.errors import ModelLoadError
from service.manifest import Manifest

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
    except ModelLoadError:
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
    spec = importlib.util.spec_from_file_location(qualified, folder / f"{module_name}.py")
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{manifest.label}: {module_name}.py cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]
        raise
    return module
