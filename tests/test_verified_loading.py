"""What is loaded is exactly what was verified: each file read once, hashed, loaded from those
bytes (or from a private copy written while hashing); links leading out of a version folder
are refused."""

from __future__ import annotations

import gc
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.errors import ModelIntegrityError
from service.manifest import Architecture, Manifest, ModelFormat, TensorSpec
from service.packaging.package import Packager
from service.server.single import create_app
from tests.apps import frontend_of
from tests.fixtures import lifespan
from tests.torch_models import AffineModel

#: Wide enough (1 MiB of weights) that reading and hashing take long enough for a flip to
#: land between them, as it did on a real model.
FEATURES = 512
ARCHITECTURE = Architecture(import_path="tests.torch_models:AffineModel", kwargs={"features": 512})
X = torch.ones(2, FEATURES)
VERIFIED, UNVERIFIED = 3.0, 5.0
JIT_DEPRECATED = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


def weights(format: ModelFormat, path: Path, scale: float) -> Path:
    """``AffineModel(scale, shift=-1)`` saved in ``format``: ``scale - 1`` on ones."""
    model = AffineModel(features=FEATURES, scale=scale, shift=-1.0).eval()
    if format == "safetensors":
        save_file({key: value.contiguous() for key, value in model.state_dict().items()}, path)
    else:
        torch.jit.script(model).save(str(path))
    return path


def package(root: Path, format: ModelFormat, artifact: Path) -> Manifest:
    spec = TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES))
    return Packager(root).package(
        name="affine",
        artifact=artifact,
        format=format,
        architecture=ARCHITECTURE if format == "safetensors" else None,
        inputs=(spec,),
        outputs=(spec.model_copy(update={"name": "y"}),),
    )


@dataclass
class Tally:
    served_verified: int = 0
    served_unverified: int = 0
    refused: int = 0
    flips: int = 0

    @property
    def loads(self) -> int:
        return self.served_verified + self.served_unverified + self.refused


def load_while_flipping(
    store: ModelStore, manifest: Manifest, *, loads: int, budget_s: float
) -> Tally:
    """Load the version ``loads`` times (at most ``budget_s``) while a thread flips its
    artifact, a symlink inside the folder, between the verified weights and others."""
    folder = store.version_folder(manifest.name, manifest.version)
    artifact = folder / manifest.artifact
    suffix = artifact.name.removeprefix("model")
    good, bad = f"good{suffix}", f"bad{suffix}"
    os.replace(artifact, folder / good)
    weights(manifest.format, folder / bad, UNVERIFIED)
    artifact.symlink_to(good)
    tally = Tally()
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set() and tally.flips < 1_000_000:
            staged = folder / ".flipping"
            staged.symlink_to(bad if tally.flips % 2 == 0 else good)
            os.replace(staged, artifact)
            tally.flips += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    deadline_s = time.monotonic() + budget_s
    try:
        while tally.loads < loads and time.monotonic() < deadline_s:
            try:
                module = store.load(manifest.name, manifest.version).module
            except ModelIntegrityError:
                tally.refused += 1
                continue
            with torch.inference_mode():
                scale = float(module(X)[0, 0]) + 1.0
            if scale == VERIFIED:
                tally.served_verified += 1
            else:
                tally.served_unverified += 1
    finally:
        stop.set()
        flipper.join()
    return tally


@pytest.mark.parametrize(
    "format", ["safetensors", pytest.param("torchscript", marks=JIT_DEPRECATED)]
)
def test_a_symlink_flipped_during_loads_never_serves_unverified_weights(
    tmp_path: Path, format: ModelFormat
) -> None:
    manifest = package(tmp_path / "repo", format, weights(format, tmp_path / "w", VERIFIED))

    tally = load_while_flipping(ModelStore(tmp_path / "repo"), manifest, loads=60, budget_s=30)

    assert tally.served_unverified == 0, tally
    assert tally.loads >= 10, tally  # bounded by time on a loaded machine, but some loads ran
    assert tally.flips > tally.loads, tally


@pytest.fixture
def packaged(tmp_path: Path) -> Manifest:
    return package(tmp_path / "repo", "safetensors", weights("safetensors", tmp_path / "w", 3.0))


def test_a_link_leaving_the_version_folder_is_refused(tmp_path: Path, packaged: Manifest) -> None:
    store = ModelStore(tmp_path / "repo")
    artifact = store.version_folder("affine", packaged.version) / packaged.artifact
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(artifact, outside)  # the very same bytes: the link alone is refused
    artifact.unlink()
    artifact.symlink_to(outside)

    with pytest.raises(ModelIntegrityError, match="outside the version folder"):
        store.load("affine", packaged.version)
    with pytest.raises(ModelIntegrityError, match="outside the version folder"):
        store.verify(packaged)


def test_a_link_inside_the_version_folder_is_followed(tmp_path: Path, packaged: Manifest) -> None:
    store = ModelStore(tmp_path / "repo")
    folder = store.version_folder("affine", packaged.version)
    os.replace(folder / packaged.artifact, folder / "weights.safetensors")
    (folder / packaged.artifact).symlink_to("weights.safetensors")

    module = store.load("affine", packaged.version).module

    with torch.inference_mode():
        assert torch.equal(module(X), 3 * X - 1)


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(
    tmp_path: Path, packaged: Manifest
) -> None:
    store = ModelStore(tmp_path / "repo")
    artifact = store.version_folder("affine", packaged.version) / packaged.artifact
    artifact.unlink()
    os.mkfifo(artifact)

    with pytest.raises(ModelIntegrityError, match="not a regular file"):
        store.load("affine", packaged.version)


SENTIMENT = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("sentiment")


def copy_of_sentiment(root: Path) -> ModelStore:
    source = BUNDLED_MODEL_REPOSITORY / "sentiment" / SENTIMENT.version
    shutil.copytree(source, root / "sentiment" / SENTIMENT.version)
    return ModelStore(root)


def test_a_handler_reads_a_private_copy_of_the_verified_files(tmp_path: Path) -> None:
    store = copy_of_sentiment(tmp_path / "repo")
    folder = store.version_folder("sentiment", SENTIMENT.version)

    class Owner:
        """Stands for the handler the copy lives as long as."""

    owner = Owner()
    with store.verified_copy(SENTIMENT) as copy:
        copy.keep_while(owner)
    private = copy.folder

    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert not private.is_relative_to(tmp_path)
    assert sorted(entry.name for entry in private.iterdir()) == sorted(
        name for name in SENTIMENT.files if name != SENTIMENT.artifact
    )
    assert (private / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    del owner
    gc.collect()
    assert not private.exists()


def test_a_tokenizer_flipped_while_copied_is_never_handed_over_unverified(tmp_path: Path) -> None:
    store = copy_of_sentiment(tmp_path / "repo")
    folder = store.version_folder("sentiment", SENTIMENT.version)
    verified = (folder / "tokenizer.json").read_bytes()
    os.replace(folder / "tokenizer.json", folder / "good.json")
    (folder / "bad.json").write_bytes(verified.replace(b'"[UNK]"', b'"[UNKNOWN]"'))
    (folder / "tokenizer.json").symlink_to("good.json")
    stop = threading.Event()

    def flip() -> None:
        flips = 0
        while not stop.is_set() and flips < 1_000_000:
            (folder / ".flipping").symlink_to("bad.json" if flips % 2 == 0 else "good.json")
            os.replace(folder / ".flipping", folder / "tokenizer.json")
            flips += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    copies = refused = 0
    try:
        for _ in range(100):
            try:
                with store.verified_copy(SENTIMENT) as copy:
                    assert (copy.folder / "tokenizer.json").read_bytes() == verified
                    copies += 1
            except ModelIntegrityError:
                refused += 1
    finally:
        stop.set()
        flipper.join()
    assert copies + refused == 100


def test_a_damaged_file_leaves_no_private_copy_behind(tmp_path: Path) -> None:
    store = copy_of_sentiment(tmp_path / "repo")
    tokenizer = store.version_folder("sentiment", SENTIMENT.version) / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes() + b" ")
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("batchserve-verified-*"))

    with pytest.raises(ModelIntegrityError, match=r"'tokenizer\.json' has sha256"):
        store.verified_copy(SENTIMENT)

    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("batchserve-verified-*")) == before


async def test_a_served_handler_reads_its_private_verified_copy(tmp_path: Path) -> None:
    store = copy_of_sentiment(tmp_path / "repo")
    app = create_app(Settings(model_repository=store.root, model_name="sentiment", device="cpu"))
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post("/predict", json={"instances": ["fine"]})
            assert answer.status_code == 200, answer.text
            handler = frontend_of(app).handler_for(frontend_of(app).serving_model())
            folder = handler.context.folder

            assert not folder.is_relative_to(tmp_path)
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700
            assert sorted(entry.name for entry in folder.iterdir()) == ["tokenizer.json"]
