from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine import model_store
from service.engine.model_store import ModelStore
from service.errors import ModelIntegrityError, ModelLoadError, ModelNotFoundError
from service.manifest import (
    MANIFEST_FILE,
    Architecture,
    Manifest,
    ModelFormat,
    TensorSpec,
    check_name,
    check_version,
)
from service.packaging.package import Packager
from tests.torch_models import FEATURES, AffineModel

INPUTS = (TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),)
OUTPUTS = (TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES)),)
AFFINE = Architecture(import_path="tests.torch_models:AffineModel")
JIT_DEPRECATED = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)
# Quarters in [-3, 3): 3x - 1 and 2x + 1 are exact in fp32, so outputs compare with ==.
X = torch.arange(-12, 12, dtype=torch.float32).reshape(6, FEATURES) / 4


def affine_artifact(
    format: ModelFormat, folder: Path, scale: float = 3.0, shift: float = -1.0
) -> Path:
    """Save ``AffineModel(scale, shift)`` in ``format``.

    The architecture's defaults compute 2x + 1, so the default 3x - 1 shows the weights
    really come from the artifact.
    """
    model = AffineModel(scale=scale, shift=shift).eval()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"affine-{format}-{scale}-{shift}"
    if format == "safetensors":
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    elif format == "state_dict":
        torch.save(model.state_dict(), path)
    elif format == "torchscript":
        torch.jit.script(model).save(str(path))
    else:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(model, (X,), dynamic_shapes=({0: batch},))
        torch.export.save(program, path)
    return path


def package(
    store: ModelStore,
    artifact: Path,
    format: ModelFormat = "safetensors",
    *,
    name: str = "affine",
    architecture: Architecture | None = AFFINE,
) -> Manifest:
    return Packager(store.root).package(
        name=name,
        artifact=artifact,
        format=format,
        inputs=INPUTS,
        outputs=OUTPUTS,
        architecture=architecture,
    )


def forward(module: torch.nn.Module, x: torch.Tensor = X) -> torch.Tensor:
    with torch.inference_mode():
        output: torch.Tensor = module(x)
    return output


def sha256_hex(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(
    store: ModelStore, manifest: Manifest, edit: Callable[[dict[str, Any]], None]
) -> None:
    path = store.root / manifest.name / manifest.version / MANIFEST_FILE
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def set_created_at(store: ModelStore, manifest: Manifest, created_at: datetime) -> None:
    edit_manifest(
        store, manifest, lambda document: document.update(created_at=created_at.isoformat())
    )


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "repo")


@pytest.fixture
def packaged(store: ModelStore, tmp_path: Path) -> Manifest:
    return package(store, affine_artifact("safetensors", tmp_path / "build"))


FORMATS = [
    "safetensors",
    "state_dict",
    pytest.param("torchscript", marks=JIT_DEPRECATED),
    "exported_program",
]


@pytest.mark.parametrize("format", FORMATS)
def test_package_then_load_gives_exact_outputs(
    store: ModelStore, tmp_path: Path, format: ModelFormat
) -> None:
    artifact = affine_artifact(format, tmp_path / "build")
    architecture = AFFINE if format in ("safetensors", "state_dict") else None

    manifest = package(store, artifact, format, architecture=architecture)
    loaded = store.load("affine", manifest.version)

    # The version id is the content digest: the artifact's hash and the whole spec.
    assert manifest.version == manifest.content_digest()[:12]
    assert manifest.version_matches_content
    assert manifest.schema_version == 2
    assert manifest.files == {manifest.artifact: sha256_hex(artifact)}
    assert (store.root / "affine" / manifest.version / manifest.artifact).read_bytes() == (
        artifact.read_bytes()
    )
    assert loaded.manifest == manifest
    assert store.load("affine").manifest == manifest
    assert torch.equal(forward(loaded.module), 3 * X - 1)
    assert torch.equal(forward(loaded.module, X[:1]), 3 * X[:1] - 1)


@pytest.mark.parametrize("format", FORMATS)
def test_packaging_the_same_artifact_twice_returns_the_same_version(
    store: ModelStore, tmp_path: Path, format: ModelFormat
) -> None:
    artifact = affine_artifact(format, tmp_path / "build")
    architecture = AFFINE if format in ("safetensors", "state_dict") else None

    first = package(store, artifact, format, architecture=architecture)
    second = package(store, artifact, format, architecture=architecture)

    assert second == first
    assert [entry.name for entry in (store.root / "affine").iterdir()] == [first.version]


def test_different_weights_get_different_versions(store: ModelStore, tmp_path: Path) -> None:
    first = package(store, affine_artifact("safetensors", tmp_path, scale=2.0))
    second = package(store, affine_artifact("safetensors", tmp_path, scale=5.0))

    assert first.version != second.version
    assert {manifest.version for manifest in store.versions("affine")} == {
        first.version,
        second.version,
    }


def test_a_flipped_byte_is_refused_before_the_model_is_built(
    store: ModelStore, packaged: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact = store.root / "affine" / packaged.version / packaged.artifact
    content = bytearray(artifact.read_bytes())
    content[len(content) // 2] ^= 0x01
    artifact.write_bytes(bytes(content))

    def never_deserialized(*args: object) -> torch.nn.Module:
        raise AssertionError("a model whose hash does not match must never be deserialized")

    monkeypatch.setattr(model_store, "load_safetensors", never_deserialized)
    monkeypatch.setattr(model_store, "instantiate", never_deserialized)
    with pytest.raises(ModelIntegrityError, match="refusing to load"):
        store.load("affine", packaged.version)
    with pytest.raises(ModelIntegrityError, match="refusing to load"):
        store.load("affine")


def test_a_missing_artifact_is_refused(store: ModelStore, packaged: Manifest) -> None:
    (store.root / "affine" / packaged.version / packaged.artifact).unlink()

    with pytest.raises(ModelIntegrityError, match="missing"):
        store.load("affine", packaged.version)


def test_unknown_model_and_version_are_not_found(store: ModelStore, packaged: Manifest) -> None:
    other_version = "0123456789ab"
    assert packaged.version != other_version

    with pytest.raises(ModelNotFoundError) as unknown_model:
        store.load("nope")
    with pytest.raises(ModelNotFoundError) as unknown_version:
        store.load("affine", other_version)

    assert unknown_model.value.status_code == 404
    assert unknown_version.value.status_code == 404


def test_an_empty_or_missing_repository_has_no_models(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "does-not-exist")

    assert store.model_names() == []
    with pytest.raises(ModelNotFoundError):
        store.load("affine")


@pytest.mark.parametrize("newest", [0, 1])
def test_latest_is_the_newest_by_created_at(store: ModelStore, tmp_path: Path, newest: int) -> None:
    manifests = [
        package(store, affine_artifact("safetensors", tmp_path, scale=2.0)),
        package(store, affine_artifact("safetensors", tmp_path, scale=5.0)),
    ]
    # Editing the manifest leaves the artifact, and so its hash, unchanged.
    years = [2031, 2030] if newest == 0 else [2030, 2031]
    for manifest, year in zip(manifests, years, strict=True):
        set_created_at(store, manifest, datetime(year, 1, 1, tzinfo=UTC))

    latest = store.load("affine")

    assert latest.manifest.version == manifests[newest].version
    assert [m.version for m in store.versions("affine")] == [
        manifests[1 - newest].version,
        manifests[newest].version,
    ]
    scale = [2.0, 5.0][newest]
    assert torch.equal(forward(latest.module), scale * X - 1)


def test_latest_skips_a_version_with_an_invalid_manifest(store: ModelStore, tmp_path: Path) -> None:
    good = package(store, affine_artifact("safetensors", tmp_path, scale=2.0))
    broken = package(store, affine_artifact("safetensors", tmp_path, scale=5.0))
    edit_manifest(store, broken, lambda document: document.pop("architecture"))

    assert store.resolve("affine").version == good.version
    with pytest.raises(ModelIntegrityError, match="manifest unreadable or invalid"):
        store.load("affine", broken.version)


BAD_NAMES = ["../x", "a/b", "..", ".", "", "/etc", "x/../x", "x\n", "-x", "a" * 65]
BAD_VERSIONS = [
    "../../etc",
    "LATEST1234567",
    "Latest",
    "0123456789AB",
    "0123456789abc",
    "0123456789ab\n",
    "../x/0123456789ab",
    "",
]


@pytest.fixture
def decoy(tmp_path: Path) -> Manifest:
    """A loadable model at ``<root>/../x``: what ``../x`` would reach if names were not checked."""
    return package(ModelStore(tmp_path), affine_artifact("safetensors", tmp_path / "b"), name="x")


@pytest.fixture
def paths_touched(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path the code under test checks, lists or reads through ``pathlib``."""
    touched: list[Path] = []
    for method in ("is_dir", "is_file", "exists", "iterdir", "read_bytes", "read_text", "open"):
        original = getattr(Path, method)

        def spy(self: Path, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            touched.append(self)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Path, method, spy)
    return touched


def assert_all_inside(paths: list[Path], root: Path) -> None:
    outside = [path for path in paths if not path.resolve().is_relative_to(root.resolve())]
    assert outside == []


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_that_are_not_plain_identifiers_are_refused(
    store: ModelStore, packaged: Manifest, decoy: Manifest, name: str, paths_touched: list[Path]
) -> None:
    with pytest.raises(ModelNotFoundError):
        check_name(name)
    with pytest.raises(ModelNotFoundError):
        store.load(name)
    with pytest.raises(ModelNotFoundError):
        store.load(name, decoy.version)
    with pytest.raises(ModelNotFoundError):
        store.versions(name)
    assert_all_inside(paths_touched, store.root)


@pytest.mark.parametrize("version", BAD_VERSIONS)
def test_versions_that_are_not_hex_ids_are_refused(
    store: ModelStore, packaged: Manifest, decoy: Manifest, version: str, paths_touched: list[Path]
) -> None:
    with pytest.raises(ModelNotFoundError):
        check_version(version)
    with pytest.raises(ModelNotFoundError):
        store.load("affine", version)
    assert_all_inside(paths_touched, store.root)


def test_packaging_under_a_bad_name_writes_nothing(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "repo")
    artifact = affine_artifact("safetensors", tmp_path / "build")

    with pytest.raises(ModelNotFoundError):
        package(store, artifact, name="../escaped")

    assert not (tmp_path / "escaped").exists()
    assert not store.root.exists()


def write_marker(path: str) -> None:
    Path(path).write_text("code ran while unpickling")


class CodeCarrier:
    """Pickles as a call to ``write_marker``: what a malicious ``.pt`` file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return write_marker, (str(self.marker),)


def test_the_code_carrying_pickle_really_runs_code_when_fully_unpickled(tmp_path: Path) -> None:
    # Guards the next test: its payload must be live for its refusal to mean anything.
    marker = tmp_path / "marker"
    payload = pickle.dumps({"linear.weight": CodeCarrier(marker)})

    pickle.loads(payload)

    assert marker.exists()


def test_a_state_dict_carrying_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    artifact = tmp_path / "evil.pt"
    torch.save({"linear.weight": CodeCarrier(marker)}, artifact)
    store = ModelStore(tmp_path / "repo")

    with pytest.raises(ModelLoadError, match="cannot load state_dict artifact"):
        package(store, artifact, "state_dict")
    assert not marker.exists()
    assert not (store.root / "affine").exists()

    # The same artifact written into the repository by hand (with a manifest whose version
    # matches its content, so only the artifact stands in the way) is refused at load time too.
    digest = sha256_hex(artifact)
    manifest = Manifest.create(
        name="affine",
        format="state_dict",
        artifact="model.pt",
        files={"model.pt": digest},
        architecture=AFFINE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        created_at=datetime.now(UTC),
    )
    folder = store.root / "affine" / manifest.version
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(artifact.read_bytes())
    (folder / MANIFEST_FILE).write_text(manifest.model_dump_json())
    assert store.resolve("affine").version == manifest.version
    store.verify(manifest)  # the hashes match: the refusal is the loader's

    with pytest.raises(ModelLoadError, match="cannot load state_dict artifact"):
        store.load("affine")
    assert not marker.exists()


def test_a_state_dict_that_does_not_fit_the_architecture_is_refused(
    store: ModelStore, tmp_path: Path
) -> None:
    artifact = tmp_path / "wrong.pt"
    torch.save({"linear.weight": torch.eye(FEATURES)}, artifact)

    with pytest.raises(ModelLoadError, match=r"Error\(s\) in loading state_dict"):
        package(store, artifact, "state_dict")


@pytest.mark.parametrize("format", ["safetensors", "state_dict"])
def test_weights_formats_need_an_architecture(
    store: ModelStore, tmp_path: Path, format: ModelFormat
) -> None:
    artifact = affine_artifact(format, tmp_path / "build")

    with pytest.raises(ValidationError, match="needs an architecture"):
        package(store, artifact, format, architecture=None)
    assert not store.root.exists()


def test_a_manifest_without_architecture_on_disk_is_refused(
    store: ModelStore, packaged: Manifest
) -> None:
    edit_manifest(store, packaged, lambda document: document.pop("architecture"))

    with pytest.raises(ModelIntegrityError, match="manifest unreadable or invalid"):
        store.load("affine", packaged.version)


@pytest.mark.parametrize(
    ("import_path", "message"),
    [
        ("collections:OrderedDict", "is not a torch.nn.Module subclass"),
        ("os:system", "is not a torch.nn.Module subclass"),
        ("tests.torch_models:FEATURES", "is not a torch.nn.Module subclass"),
        (
            "tests.torch_models:Missing",
            r"cannot import 'tests\.torch_models:Missing': AttributeError",
        ),
        (
            "tests.no_such_module:AffineModel",
            r"cannot import 'tests\.no_such_module:AffineModel': ModuleNotFoundError",
        ),
    ],
)
def test_an_architecture_that_is_not_an_nn_module_is_refused(
    store: ModelStore, tmp_path: Path, import_path: str, message: str
) -> None:
    artifact = affine_artifact("safetensors", tmp_path / "build")

    with pytest.raises(ModelLoadError, match=message):
        package(store, artifact, architecture=Architecture(import_path=import_path))
    assert not store.root.exists()


@pytest.mark.parametrize("import_path", ["os.system", "tests/torch_models:AffineModel", "x:y:z"])
def test_an_architecture_import_path_must_be_module_colon_name(import_path: str) -> None:
    with pytest.raises(ValidationError):
        Architecture(import_path=import_path)


def test_the_bundled_digits_model_verifies_and_classifies_the_held_out_set() -> None:
    from scripts.train_digits import load_split

    store = ModelStore(BUNDLED_MODEL_REPOSITORY)
    loaded = store.load("digits", "latest")
    store.verify(loaded.manifest)
    _, test_x, _, test_y = load_split(seed=0)

    predicted = forward(loaded.module, torch.from_numpy(test_x)).argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == test_y))

    assert loaded.manifest.metadata["test_accuracy"] >= 0.95
    assert loaded.manifest.metadata["test_size"] == len(test_y)
    assert accuracy >= 0.95
    # The training script measured the same split; allow one prediction to differ by platform.
    assert accuracy == pytest.approx(
        loaded.manifest.metadata["test_accuracy"], abs=1.5 / len(test_y)
    )
