"""The batchserve command line: package, models list, models verify."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.errors import ModelIntegrityError
from service.repository import sha256_of
from service.server.cli import ACCURACY_KEY, main
from service.server.single import create_app
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.torch_models import PaddingSensitiveEncoder

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")
DIGITS_WEIGHTS = BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact


def package_digits(repository: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    status, out, err = run_package_digits(repository, capsys, *extra)
    assert status == 0, err
    return out.strip()


def run_package_digits(
    repository: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str, str]:
    """``batchserve package`` of the digits weights: exit status, stdout and stderr."""
    status = main(
        [
            "package",
            "--repository", str(repository),
            "--name", "mydigits",
            "--artifact", str(DIGITS_WEIGHTS),
            "--format", "safetensors",
            "--architecture", "service.models.digits:DigitsCNN",
            "--input", "image:float32:-1,8,8:min_value=0:max_value=1",
            "--output", "logits:float32:-1,10:labels=0,1,2,3,4,5,6,7,8,9",
            *extra,
            "--metadata", '{"test_accuracy": 0.97}',
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_package_prints_the_content_hash_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = package_digits(tmp_path, capsys)
    manifest = ModelStore(tmp_path).resolve("mydigits", version)
    assert version == manifest.content_digest()[:12]
    assert manifest.files == {"model.safetensors": sha256_of(DIGITS_WEIGHTS)}
    assert manifest.input.shape == (-1, 8, 8)
    assert (manifest.input.min_value, manifest.input.max_value) == (0.0, 1.0)
    assert manifest.output.labels == tuple("0123456789")
    assert manifest.metadata == {"test_accuracy": 0.97}
    assert package_digits(tmp_path, capsys) == version  # the same things: the same version


def test_repackaging_with_any_change_gives_a_new_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = package_digits(tmp_path, capsys)
    different_metadata = main(
        ["package", "--repository", str(tmp_path), "--name", "mydigits",
         "--artifact", str(DIGITS_WEIGHTS), "--format", "safetensors",
         "--architecture", "service.models.digits:DigitsCNN",
         "--input", "image:float32:-1,8,8:min_value=0:max_value=1",
         "--output", "logits:float32:-1,10:labels=0,1,2,3,4,5,6,7,8,9",
         "--metadata", '{"test_accuracy": 0.98}']
    )  # fmt: skip
    assert different_metadata == 0
    second = capsys.readouterr().out.strip()
    unlabelled = main(
        ["package", "--repository", str(tmp_path), "--name", "mydigits",
         "--artifact", str(DIGITS_WEIGHTS), "--format", "safetensors",
         "--architecture", "service.models.digits:DigitsCNN",
         "--input", "image:float32:-1,8,8:min_value=0:max_value=1",
         "--output", "logits:float32:-1,10", "--metadata", '{"test_accuracy": 0.97}']
    )  # fmt: skip
    assert unlabelled == 0
    third = capsys.readouterr().out.strip()
    assert len({first, second, third}) == 3
    assert len(ModelStore(tmp_path).versions("mydigits")) == 3


def test_a_flag_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["package", "--name", "a", "--name", "b"])
    assert "--name is given twice" in capsys.readouterr().err


def test_a_spec_file_packages_what_flags_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    by_flags = package_digits(tmp_path / "one", capsys)
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "mydigits",
                "artifact": str(DIGITS_WEIGHTS),
                "format": "safetensors",
                "architecture": {"import_path": "service.models.digits:DigitsCNN"},
                "inputs": [
                    {"name": "image", "dtype": "float32", "shape": [-1, 8, 8],
                     "min_value": 0, "max_value": 1}
                ],
                "outputs": [
                    {"name": "logits", "dtype": "float32", "shape": [-1, 10],
                     "labels": list("0123456789")}
                ],
                "metadata": {"test_accuracy": 0.97},
            }
        )
    )  # fmt: skip
    status = main(["package", "--repository", str(tmp_path / "two"), "--spec", str(spec)])
    assert status == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == by_flags


def test_models_list_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = package_digits(tmp_path, capsys)
    assert main(["models", "list", "--repository", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert f"mydigits\t{version}\t" in listed
    assert listed.rstrip().endswith("safetensors\t0.97\tlatest")

    assert main(["models", "verify", "--repository", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"ok\tmydigits\t{version}\n"

    artifact = tmp_path / "mydigits" / version / "model.safetensors"
    artifact.write_bytes(artifact.read_bytes()[:-1] + b"\0")
    assert main(["models", "verify", "--repository", str(tmp_path), "mydigits"]) == 1
    assert "FAILED\tmydigits" in capsys.readouterr().out


def test_a_hand_edited_manifest_fails_verify_and_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = package_digits(tmp_path, capsys)
    path = tmp_path / "mydigits" / version / "manifest.json"
    document = json.loads(path.read_text())
    document["inputs"][0]["max_value"] = 16.0
    path.write_text(json.dumps(document))

    assert main(["models", "verify", "--repository", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED\tmydigits\t{version}\t" in out
    assert "the manifest does not match its version id" in out
    with pytest.raises(ModelIntegrityError, match="edited after packaging"):
        ModelStore(tmp_path).load("mydigits", version)


def test_a_declared_output_the_model_does_not_produce_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["package", "--repository", str(tmp_path), "--name", "mydigits",
         "--artifact", str(DIGITS_WEIGHTS), "--format", "safetensors",
         "--architecture", "service.models.digits:DigitsCNN",
         "--input", "image:float32:-1,8,8", "--output", "logits:int64:-1,5"]
    )  # fmt: skip
    assert status == 1
    error = capsys.readouterr().err
    assert (
        "output 'logits': the manifest declares shape (-1, 5), the model returned (2, 10)" in error
    )
    assert "the manifest declares dtype int64, the model returned float32" in error
    assert not (tmp_path / "mydigits").exists()


def test_an_architecture_bundled_as_a_file_needs_no_pythonpath(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "mynet.py"
    module.write_text(
        "from service.models.digits import DigitsCNN\n\n\nclass MyNet(DigitsCNN):\n    pass\n"
    )
    args = [
        "package", "--repository", str(tmp_path / "repo"), "--name", "mine",
        "--artifact", str(DIGITS_WEIGHTS), "--format", "safetensors",
        "--architecture", "mynet:MyNet", "--file", str(module),
        "--input", "image:float32:-1,8,8", "--output", "logits:float32:-1,10",
    ]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    first = capsys.readouterr().out.strip()
    store = ModelStore(tmp_path / "repo")
    assert set(store.resolve("mine", first).files) == {"model.safetensors", "mynet.py"}
    loaded = store.load("mine", first)
    assert type(loaded.module).__name__ == "MyNet"

    module.write_text(module.read_text() + "# changed\n")
    assert main(args) == 0
    assert capsys.readouterr().out.strip() != first  # the code is part of the version


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
            "--input", "image:float32:-1,8,8",
            "--output", "logits:float32:-1,10",
        ]
    )  # fmt: skip
    assert status == 1
    assert "cannot load safetensors artifact" in capsys.readouterr().err
    assert not (tmp_path / "broken").exists()


def test_unknown_model_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--repository", str(tmp_path), "nothing"]) == 1
    assert "no model named 'nothing'" in capsys.readouterr().err


async def test_a_masked_transformer_without_max_length_warms_up_on_real_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Warm-up used to feed rows of padding only (min_value or 0) up to 4096 tokens; it now
    feeds non-padding tokens up to the default max_length (512)."""
    weights = tmp_path / "encoder.safetensors"
    save_file(dict(PaddingSensitiveEncoder().state_dict()), str(weights))
    status = main(
        ["package", "--repository", str(tmp_path), "--name", "encoder",
         "--artifact", str(weights), "--format", "safetensors",
         "--architecture", "tests.torch_models:PaddingSensitiveEncoder",
         "--input", "input_ids:int64:-1,-1:max_value=99:pad_value=0",
         "--output", "pooled:float32:-1,16"]
    )  # fmt: skip
    assert status == 0, capsys.readouterr().err
    app = create_app(
        Settings(model_repository=tmp_path, model_name="encoder", device="cpu", max_batch_size=4)
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        served = engine_of(app).served
        assert served is not None
        assert served.length_edges[-1] == 512


def test_a_text_classifier_is_packaged_with_its_tokenizer_and_handler_from_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sentiment = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("sentiment")
    folder = BUNDLED_MODEL_REPOSITORY / "sentiment" / sentiment.version
    assert sentiment.architecture is not None
    arguments = [
        "package", "--repository", str(tmp_path), "--name", "reviews",
        "--artifact", str(folder / sentiment.artifact), "--format", "safetensors",
        "--architecture", sentiment.architecture.import_path,
        "--kwargs", json.dumps(sentiment.architecture.kwargs),
        "--file", str(folder / "tokenizer.json"),
        "--input", "input_ids:int64:-1,-1:max_length=64:min_value=1:max_value=381:pad_value=0",
        "--input", "attention_mask:int64:-1,-1:max_length=64:min_value=0:max_value=1:pad_value=0",
        "--output", "logits:float32:-1,2:labels=negative,positive",
        "--output", "embedding:float32:-1,32",
        "--handler", "service.frontend.handlers.text:TextHandler",
        "--handler-options", '{"top_k": 2}',
    ]  # fmt: skip
    assert main(arguments) == 0, capsys.readouterr().err
    manifest = ModelStore(tmp_path).resolve("reviews", capsys.readouterr().out.strip())
    assert [spec.name for spec in manifest.inputs] == ["input_ids", "attention_mask"]
    assert manifest.handler is not None
    assert manifest.handler.options == {"top_k": 2}
    assert manifest.files["tokenizer.json"] == sentiment.files["tokenizer.json"]

    # A handler that cannot be built (an option it does not take) leaves nothing behind.
    broken = [*arguments[:-1], '{"top_k": 2, "colour": "red"}']
    broken[broken.index("reviews")] = "broken"
    assert main(broken) == 1
    assert "the handler cannot be built" in capsys.readouterr().err
    assert not (tmp_path / "broken").exists()


def flip_a_byte(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(bytes(content))


@pytest.mark.parametrize(
    ("damage", "damaged"),
    [
        (lambda folder: flip_a_byte(folder / "model.safetensors"), "model.safetensors"),
        (lambda folder: (folder / "model.safetensors").unlink(), "model.safetensors"),
        (lambda folder: (folder / "manifest.json").write_text("{"), "manifest.json"),
    ],
    ids=["flipped-byte", "missing-weights", "unreadable-manifest"],
)
def test_packaging_again_over_a_damaged_version_repairs_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    damaged: str,
) -> None:
    version = package_digits(tmp_path, capsys)
    damage(tmp_path / "mydigits" / version)
    assert main(["models", "verify", "--repository", str(tmp_path)]) == 1
    capsys.readouterr()

    status, out, err = run_package_digits(tmp_path, capsys)

    assert (status, out.strip()) == (0, version), err
    assert f"mydigits@{version} was there with {damaged} damaged or missing; replaced" in err
    assert main(["models", "verify", "--repository", str(tmp_path)]) == 0
    assert f"ok\tmydigits\t{version}" in capsys.readouterr().out
    assert ModelStore(tmp_path).load("mydigits", version).manifest.version == version
    assert sorted(entry.name for entry in (tmp_path / "mydigits" / version).iterdir()) == [
        "manifest.json",
        "model.safetensors",
    ]
    assert [entry.name for entry in tmp_path.iterdir()] == ["mydigits"]  # no staging left


def test_packaging_again_over_a_version_that_cannot_be_repaired_fails_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = package_digits(tmp_path, capsys)
    weights = tmp_path / "mydigits" / version / "model.safetensors"
    weights.unlink()
    weights.mkdir()  # a folder in its place: a rename cannot replace it
    (weights / "kept").write_text("")

    status, out, err = run_package_digits(tmp_path, capsys)

    assert (status, out) == (1, "")
    assert f"mydigits@{version}: 'model.safetensors' is damaged or missing and cannot be" in err
    assert main(["models", "verify", "--repository", str(tmp_path)]) == 1


def test_a_missing_artifact_or_file_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [
        "package", "--repository", str(tmp_path / "repo"), "--name", "mydigits",
        "--format", "safetensors", "--architecture", "service.models.digits:DigitsCNN",
        "--input", "image:float32:-1,8,8", "--output", "logits:float32:-1,10",
    ]  # fmt: skip
    missing = main([*common, "--artifact", str(tmp_path / "nowhere.safetensors")])
    missing_err = capsys.readouterr().err
    folder = main([*common, "--artifact", str(DIGITS_WEIGHTS), "--file", str(tmp_path)])
    folder_err = capsys.readouterr().err

    assert (missing, folder) == (2, 2)
    assert missing_err == (
        f"batchserve: cannot package: {tmp_path / 'nowhere.safetensors'} does not exist\n"
    )
    assert folder_err == f"batchserve: cannot package: {tmp_path} is not a file\n"
    assert not (tmp_path / "repo" / "mydigits").exists()


def test_the_accuracy_column_reads_the_key_the_docs_show() -> None:
    """docs/models.md packages with the metadata key that ``models list`` shows."""
    page = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    assert f'--metadata \'{{"{ACCURACY_KEY}": ' in page


def test_a_max_length_beyond_the_position_embeddings_is_refused_at_packaging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Start-up used to fail at warm-up with "index out of range in self"; packaging now runs
    one row at max_length and names it."""
    weights = tmp_path / "encoder.safetensors"
    save_file(dict(PaddingSensitiveEncoder(positions=64).state_dict()), str(weights))
    arguments = [
        "package", "--repository", str(tmp_path), "--name", "encoder",
        "--artifact", str(weights), "--format", "safetensors",
        "--architecture", "tests.torch_models:PaddingSensitiveEncoder",
        "--kwargs", '{"positions": 64}',
        "--output", "pooled:float32:-1,16",
    ]  # fmt: skip
    too_long = [*arguments, "--input", "input_ids:int64:-1,-1:max_length=65:max_value=99"]
    assert main(too_long) == 1
    error = capsys.readouterr().err
    assert "max_length 65 of input 'input_ids' is more than the model can hold" in error
    assert "index out of range in self" in error
    assert not (tmp_path / "encoder").exists()
    undeclared = [*arguments, "--input", "input_ids:int64:-1,-1:max_value=99"]
    assert main(undeclared) == 1
    assert "the default max_length 512 (none is declared)" in capsys.readouterr().err
    fits = [*arguments, "--input", "input_ids:int64:-1,-1:max_length=64:max_value=99"]
    assert main(fits) == 0, capsys.readouterr().err
