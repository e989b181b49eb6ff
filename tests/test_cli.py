"""The batchserve command line: package, models list, models verify."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore
from service.repository import sha256_of
from service.server.cli import main

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")
DIGITS_WEIGHTS = BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact


def package_digits(repository: Path, capsys: pytest.CaptureFixture[str]) -> str:
    status = main(
        [
            "package",
            "--repository", str(repository),
            "--name", "mydigits",
            "--artifact", str(DIGITS_WEIGHTS),
            "--format", "safetensors",
            "--architecture", "service.models.digits:DigitsCNN",
            "--input-name", "image",
            "--input-shape=-1,8,8",
            "--output-shape=-1,10",
            "--metadata", '{"test_accuracy": 0.97}',
        ]
    )  # fmt: skip
    assert status == 0
    return capsys.readouterr().out.strip()


def test_package_prints_the_content_hash_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = package_digits(tmp_path, capsys)
    assert version == sha256_of(DIGITS_WEIGHTS)[:12]
    manifest = ModelStore(tmp_path).resolve("mydigits", version)
    assert manifest.input.shape == (-1, 8, 8)
    assert manifest.metadata == {"test_accuracy": 0.97}


def test_models_list_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = package_digits(tmp_path, capsys)
    assert main(["models", "list", "--repository", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert f"mydigits\t{version}\t" in listed
    assert listed.rstrip().endswith("safetensors\t0.97")

    assert main(["models", "verify", "--repository", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"ok\tmydigits\t{version}\n"

    artifact = tmp_path / "mydigits" / version / "model.safetensors"
    artifact.write_bytes(artifact.read_bytes()[:-1] + b"\0")
    assert main(["models", "verify", "--repository", str(tmp_path), "mydigits"]) == 1
    assert "FAILED\tmydigits" in capsys.readouterr().out


def test_package_refuses_an_artifact_that_does_not_fit_its_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "package",
            "--repository", str(tmp_path),
            "--name", "broken",
            "--artifact", str(DIGITS_WEIGHTS),
            "--format", "safetensors",
            "--architecture", "service.models.digits:DigitsCNN",
            "--kwargs", '{"channels": 8}',
            "--input-shape=-1,8,8",
            "--output-shape=-1,10",
        ]
    )  # fmt: skip
    assert status == 1
    assert "cannot load safetensors artifact" in capsys.readouterr().err
    assert not (tmp_path / "broken").exists()


def test_unknown_model_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--repository", str(tmp_path), "nothing"]) == 1
    assert "no model named 'nothing'" in capsys.readouterr().err
