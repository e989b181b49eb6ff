"""More versions of the bundled ``digits`` model, for the version-switching tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore
from service.manifest import Architecture, TensorSpec
from service.packaging.package import Packager

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")


def copy_bundled_digits(repository: Path) -> None:
    """``repository``/digits: the bundled version, in a repository the test may change."""
    shutil.copytree(BUNDLED_MODEL_REPOSITORY / "digits", repository / "digits")


def add_digits_version(
    repository: Path, bias_shift: float, architecture: str = "service.models.digits:DigitsCNN"
) -> str:
    """Package the bundled digits weights with the output bias shifted: a new version id."""
    weights = load_file(str(BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact))
    weights["classifier.3.bias"] = weights["classifier.3.bias"] + bias_shift
    artifact = repository / f"shifted-{bias_shift}.safetensors"
    save_file(weights, str(artifact))
    manifest = Packager(repository).package(
        name="digits",
        artifact=artifact,
        format="safetensors",
        architecture=Architecture(import_path=architecture),
        inputs=DIGITS.inputs,
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, 10)),),
    )
    artifact.unlink()
    return manifest.version


def add_digits_variant(
    repository: Path,
    class_bias: dict[int, float] | None = None,
    architecture: str = "service.models.digits:DigitsCNN",
) -> str:
    """Package the bundled digits weights (with ``class_bias`` added to those classes' output
    biases) under ``architecture``, with the bundled version's outputs and labels: a version
    whose requests and answers mean what the bundled version's do (a shadow candidate)."""
    weights = load_file(str(BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact))
    for label, shift in (class_bias or {}).items():
        weights["classifier.3.bias"][label] += shift
    with tempfile.TemporaryDirectory() as scratch:
        artifact = Path(scratch) / "variant.safetensors"
        save_file(weights, str(artifact))
        manifest = Packager(repository).package(
            name="digits",
            artifact=artifact,
            format="safetensors",
            architecture=Architecture(import_path=architecture),
            inputs=DIGITS.inputs,
            outputs=DIGITS.outputs,
        )
    return manifest.version
