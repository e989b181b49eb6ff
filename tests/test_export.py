"""``batchserve export``: each demo model to each format, served within its recorded parity."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.engine.outputs import call_model, named_outputs
from service.errors import ModelIntegrityError, ModelNotFoundError
from service.manifest import Architecture, Manifest, ModelFormat, TensorSpec
from service.packaging.export import ATOL, RTOL, ExportError, export_version
from service.packaging.package import Packager
from service.server.cli import main
from service.server.single import create_app
from tests.fixtures import lifespan

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")
TEXTENC = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("textenc")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ModelStore:
    root = tmp_path_factory.mktemp("repository")
    for manifest in (DIGITS, TEXTENC):
        shutil.copytree(
            BUNDLED_MODEL_REPOSITORY / manifest.name / manifest.version,
            root / manifest.name / manifest.version,
        )
    return ModelStore(root)


def outputs_of(
    store: ModelStore, manifest: Manifest, inputs: dict[str, torch.Tensor]
) -> dict[str, np.ndarray]:
    module = store.load(manifest.name, manifest.version).module
    names = [spec.name for spec in manifest.inputs]
    with torch.inference_mode():
        raw = named_outputs(call_model(module, inputs, names), manifest.outputs)
    return {name: tensor.numpy() for name, tensor in raw.items()}


# Loading a TorchScript version warns that TorchScript is deprecated (it is; it is served).
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("to", ["torchscript", "exported_program", "onnx", "aoti"])
def test_digits_exports_to_each_format_within_its_recorded_parity(
    store: ModelStore, to: ModelFormat
) -> None:
    exported = export_version(store, "digits", DIGITS.version, to)
    assert exported.format == to
    assert exported.metadata["exported_from"] == DIGITS.label
    parity = exported.metadata["parity"]
    assert parity["max_abs_diff"] <= ATOL + RTOL * 100
    assert exported.metadata["export"]["dynamic_axes"]["batch"][0] == 1
    store.verify(exported)
    for rows in (1, 5, 64):
        images = {"image": torch.rand(rows, 8, 8, generator=torch.Generator().manual_seed(rows))}
        want = outputs_of(store, DIGITS, images)["logits"]
        got = outputs_of(store, exported, images)["logits"]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
# Tracing textenc warns that a loop over a tensor may not generalise to other lengths; the
# export's parity over lengths 3, 17 and 64, and the lengths below, show that it does.
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("to", ["torchscript", "exported_program", "onnx", "aoti"])
def test_textenc_exports_with_a_dynamic_length(store: ModelStore, to: ModelFormat) -> None:
    exported = export_version(store, "textenc", TEXTENC.version, to)
    assert exported.metadata["export"]["dynamic_axes"]["length"] == [1, 512]
    rng = np.random.default_rng(0)
    for rows, length in ((1, 3), (6, 40), (2, 129)):
        ids = {"token_ids": torch.from_numpy(rng.integers(1, 1000, size=(rows, length)))}
        want = outputs_of(store, TEXTENC, ids)["embedding"]
        got = outputs_of(store, exported, ids)["embedding"]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


async def test_an_onnx_version_is_served_like_any_other(store: ModelStore) -> None:
    exported = export_version(store, "digits", DIGITS.version, "onnx")
    settings = Settings(
        model_repository=store.root,
        model_name="digits",
        model_version=exported.version,
        device="cpu",
        max_wait_ms=20.0,
    )
    images = np.random.default_rng(1).random((3, 8, 8), dtype=np.float32)
    want = outputs_of(store, DIGITS, {"image": torch.from_numpy(images)})["logits"]
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/predict", json={"instances": images.tolist()})
    assert response.status_code == 200, response.text
    assert response.json()["version"] == exported.version
    np.testing.assert_allclose(response.json()["predictions"], want, atol=ATOL, rtol=RTOL)


def test_an_operation_the_format_cannot_express_is_named(tmp_path: Path) -> None:
    weights = tmp_path / "empty.safetensors"
    save_file({}, str(weights))
    store = ModelStore(tmp_path / "repository")
    manifest = Packager(store.root).package(
        name="eig",
        artifact=weights,
        format="safetensors",
        architecture=Architecture(import_path="tests.torch_models:Eigenvalues"),
        inputs=(TensorSpec(name="matrices", dtype="float32", shape=(-1, 2, 2)),),
        outputs=(TensorSpec(name="values", dtype="float32", shape=(-1, 2)),),
    )
    with pytest.raises(ExportError, match=r"cannot be exported to onnx: .*aten\.linalg_eig"):
        export_version(store, "eig", manifest.version, "onnx")
    assert len(store.versions("eig")) == 1  # nothing written


def test_a_tampered_export_is_refused_and_the_cli_lists_formats(
    store: ModelStore, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["export", "--repository", str(store.root), "--model", "digits",
         "--version", DIGITS.version, "--to", "exported_program"]
    )  # fmt: skip
    assert status == 0, capsys.readouterr().err
    version = capsys.readouterr().out.strip()
    assert main(["models", "list", "--repository", str(store.root), "digits"]) == 0
    listed = capsys.readouterr().out
    assert f"{version}\t" in listed
    assert f"exported_program\t0.9778\tfrom {DIGITS.label}, max abs diff" in listed
    artifact = store.version_folder("digits", version) / "model.pt2"
    artifact.write_bytes(artifact.read_bytes() + b"\0")
    with pytest.raises(ModelIntegrityError):
        store.load("digits", version)


def copy_of_digits(root: Path) -> ModelStore:
    shutil.copytree(
        BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version, root / "digits" / DIGITS.version
    )
    return ModelStore(root)


def test_an_export_is_never_latest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = copy_of_digits(tmp_path)

    status = main(["export", "--repository", str(tmp_path), "--model", "digits",
                   "--to", "exported_program"])  # fmt: skip

    captured = capsys.readouterr()
    assert status == 0, captured.err
    exported = captured.out.strip()
    assert store.resolve("digits").version == DIGITS.version
    assert store.load("digits").manifest.version == DIGITS.version
    assert f"not 'latest' (an export is served by its id: BATCHSERVE_MODEL_VERSION={exported})" in (
        captured.err
    )
    assert main(["models", "list", "--repository", str(tmp_path)]) == 0
    lines = {line.split("\t")[1]: line for line in capsys.readouterr().out.splitlines()}
    assert lines[DIGITS.version].endswith("\tlatest")
    assert not lines[exported].endswith("\tlatest")
    # Exporting from latest again exports the packaged version, not the export.
    again = export_version(store, "digits", "latest", "exported_program")
    assert (again.version, again.metadata["exported_from"]) == (exported, DIGITS.label)
    # With only exports left, latest names none of them, and says how to serve one.
    shutil.rmtree(store.version_folder("digits", DIGITS.version))
    with pytest.raises(ModelNotFoundError, match=f"only exported versions \\({exported}\\)"):
        store.resolve("digits")
    assert store.load("digits", exported).manifest.version == exported


def test_exporting_the_same_version_again_gives_the_same_id(tmp_path: Path) -> None:
    first = export_version(copy_of_digits(tmp_path / "a"), "digits", DIGITS.version, "onnx")
    second = export_version(copy_of_digits(tmp_path / "b"), "digits", DIGITS.version, "onnx")

    assert "seconds" not in first.metadata["export"]
    assert second.version == first.version
    assert second.files == first.files
