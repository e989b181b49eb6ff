"""``batchserve package --hf``: a ``save_pretrained`` folder served with no code of the user's,
answering as ``transformers``' pipeline answers on the same folder (1e-4 on scores), through
``/predict``, V2 REST (the client tokenizes) and an ONNX export of the same version."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from asgi_lifespan import LifespanManager
from PIL import Image
from tokenizers import Tokenizer

from service.config import Settings
from service.engine.export import export_version
from service.engine.model_store import ModelStore
from service.server.cli import main
from service.server.single import create_app
from tests.apps import engine_of
from tests.hf_folders import MAX_POSITIONS, save_image_model, save_text_model

pytest.importorskip("transformers")

pytestmark = [
    # transformers 5 says, once, that it falls back from torchvision to Pillow; and Swig's
    # types warn at import on Python 3.11 (sentencepiece).
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SCORE_TOLERANCE = 1e-4
TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "a dull story about Berlin and London",
]
PAIRS = [{"text": "the quick brown fox", "text_pair": "jumps over the lazy dog"}]
NAMES = {
    "text-classification": "sentiment",
    "token-classification": "tagger",
    "feature-extraction": "embedder",
    "image-classification": "vit",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    made = {
        task: save_text_model(root / task, task)
        for task in ("text-classification", "token-classification", "feature-extraction")
    }
    made["image-classification"] = save_image_model(root / "image-classification")
    return made


@pytest.fixture(scope="module")
def repository(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for task, folder in folders.items():
        code = main(
            ["package", "--repository", str(root), "--name", NAMES[task], "--hf", str(folder)]
        )
        assert code == 0
    return root


@pytest.fixture(scope="module")
def pipelines(folders: dict[str, Path]) -> dict[str, Callable[..., Any]]:
    from transformers import pipeline

    return {task: pipeline(task, model=str(folder)) for task, folder in folders.items()}


def images() -> list[bytes]:
    rng = np.random.default_rng(7)
    encoded = []
    for height, width in ((40, 50), (32, 32), (97, 13)):
        pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


@asynccontextmanager
async def serving(repository: Path, *models: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        Settings(model_repository=repository, models=models, device="cpu", max_wait_ms=20.0)
    )
    async with LifespanManager(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


def assert_same_labels(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    """Equal labels in the same order and scores within the tolerance; the largest gap."""
    assert [entry["label"] for entry in got] == [entry["label"] for entry in want]
    gaps = [abs(a["score"] - b["score"]) for a, b in zip(got, want, strict=True)]
    assert max(gaps) <= SCORE_TOLERANCE, (got, want)
    return max(gaps)


async def predict(client: httpx.AsyncClient, name: str, **body: Any) -> list[Any]:
    response = await client.post(f"/models/{name}/predict", **body)
    assert response.status_code == 200, response.text
    predictions: list[Any] = response.json()["predictions"]
    return predictions


async def test_text_classification_answers_as_the_pipeline(
    repository: Path, pipelines: dict[str, Callable[..., Any]]
) -> None:
    pipe = pipelines["text-classification"]
    async with serving(repository, "sentiment") as client:
        texts = await predict(client, "sentiment", json={"instances": TEXTS})
        pairs = await predict(client, "sentiment", json={"instances": PAIRS})
        plain = await predict(
            client, "sentiment", content=TEXTS[0], headers={"content-type": "text/plain"}
        )
    for text, answer in zip(TEXTS, texts, strict=True):
        assert_same_labels(answer, pipe(text))
    assert_same_labels(pairs[0], [pipe(PAIRS[0])])
    assert_same_labels(plain[0], texts[0])


async def test_token_classification_answers_as_the_pipeline_with_simple_aggregation(
    repository: Path, folders: dict[str, Path]
) -> None:
    from transformers import pipeline

    pipe = pipeline(
        "token-classification",
        model=str(folders["token-classification"]),
        aggregation_strategy="simple",
    )
    async with serving(repository, "tagger") as client:
        answers = await predict(client, "tagger", json={"instances": TEXTS})
    for text, answer in zip(TEXTS, answers, strict=True):
        want = pipe(text)
        assert [
            (entity["entity_group"], entity["word"], entity["start"], entity["end"])
            for entity in answer
        ] == [
            (entity["entity_group"], entity["word"], entity["start"], entity["end"])
            for entity in want
        ]
        gaps = [abs(a["score"] - float(b["score"])) for a, b in zip(answer, want, strict=True)]
        assert max(gaps, default=0.0) <= SCORE_TOLERANCE
        assert want, "the random tagger finds some entity in each text"


async def test_feature_extraction_is_the_pipeline_features_mean_pooled(
    repository: Path, pipelines: dict[str, Callable[..., Any]]
) -> None:
    async with serving(repository, "embedder") as client:
        embeddings = await predict(client, "embedder", json={"instances": TEXTS})
    for text, embedding in zip(TEXTS, embeddings, strict=True):
        tokens = np.asarray(pipelines["feature-extraction"](text))[0]
        np.testing.assert_allclose(embedding, tokens.mean(axis=0), atol=SCORE_TOLERANCE)


async def test_image_classification_answers_as_the_pipeline(
    repository: Path, pipelines: dict[str, Callable[..., Any]]
) -> None:
    async with serving(repository, "vit") as client:
        answers = [
            await predict(client, "vit", content=image, headers={"content-type": "image/png"})
            for image in images()
        ]
    for image, answer in zip(images(), answers, strict=True):
        want = pipelines["image-classification"](Image.open(io.BytesIO(image)))
        assert_same_labels(answer[0], want)


async def test_v2_clients_tokenize_and_may_leave_out_the_mask_and_type_ids(
    repository: Path, folders: dict[str, Path], pipelines: dict[str, Callable[..., Any]]
) -> None:
    tokenizer = Tokenizer.from_file(str(folders["text-classification"] / "tokenizer.json"))
    ids = tokenizer.encode(TEXTS[0]).ids
    tensor = {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}
    async with serving(repository, "sentiment") as client:
        response = await client.post("/v2/models/sentiment/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.text
    logits = np.asarray(response.json()["outputs"][0]["data"], dtype=np.float64)
    scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    want = pipelines["text-classification"](TEXTS[0])[0]
    labels = ("negative", "positive")
    assert labels[int(scores.argmax())] == want["label"]
    assert abs(scores.max() - want["score"]) <= SCORE_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("task", ["text-classification", "image-classification"])
async def test_an_onnx_export_of_the_version_answers_as_the_pipeline(
    repository: Path, pipelines: dict[str, Callable[..., Any]], task: str
) -> None:
    store = ModelStore(repository)
    exported = export_version(store, NAMES[task], "latest", "onnx")
    assert (
        exported.handler
        == store.resolve(NAMES[task], exported.metadata["exported_from"].split("@")[1]).handler
    )
    async with serving(repository, f"{NAMES[task]}@{exported.version}") as client:
        if task == "text-classification":
            answers = await predict(client, NAMES[task], json={"instances": TEXTS})
            for text, answer in zip(TEXTS, answers, strict=True):
                assert_same_labels(answer, pipelines[task](text))
            return
        for image in images():
            answer = await predict(
                client, NAMES[task], content=image, headers={"content-type": "image/png"}
            )
            assert_same_labels(answer[0], pipelines[task](Image.open(io.BytesIO(image))))


def test_a_max_length_beyond_the_position_embeddings_is_refused_at_packaging(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = folders["text-classification"]
    too_long = str(MAX_POSITIONS + 1)
    args = ["package", "--repository", str(tmp_path), "--name", "x", "--hf", str(folder)]
    assert main([*args, "--max-length", too_long]) == 1
    error = capsys.readouterr().err
    assert f"max_length {too_long} is more than the model can hold" in error
    assert f"cover {MAX_POSITIONS} tokens" in error
    assert not (tmp_path / "x").exists()


def test_a_folder_without_a_served_architecture_is_refused_naming_it(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "lm"
    folder.mkdir()
    source = folders["text-classification"]
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(
        config.replace("BertForSequenceClassification", "BertForMaskedLM")
    )
    assert main(["package", "--repository", str(tmp_path), "--name", "x", "--hf", str(folder)]) == 1
    assert "architecture 'BertForMaskedLM' is not served by --hf" in capsys.readouterr().err


def test_every_file_of_the_folder_is_hashed_into_the_version(
    repository: Path, folders: dict[str, Path]
) -> None:
    manifest = ModelStore(repository).resolve("sentiment")
    assert set(manifest.files) == {path.name for path in folders["text-classification"].iterdir()}
    assert manifest.version_matches_content
