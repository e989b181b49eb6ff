"""``batchserve package --hf``: a ``save_pretrained`` folder served with no code of the user's,
answering as ``transformers``' pipeline answers on the same folder (1e-4 on scores), through
``/predict``, V2 REST (the client tokenizes) and an ONNX export of the same version."""

from __future__ import annotations

import io
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from service.config import Settings
from service.engine.model_store import ModelStore
from service.packaging.export import export_version
from service.server.cli import main
from service.server.single import create_app
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.hf_folders import (
    IMAGE_LABELS,
    MAX_POSITIONS,
    TOKEN_LABELS,
    save_distilbert_classifier,
    save_gpt2_model,
    save_image_model,
    save_text_model,
)

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
        for task in ("token-classification", "feature-extraction")
    }
    # Scores that differ from one text to the next by far more than the tolerance.
    made["text-classification"] = save_text_model(
        root / "text-classification", "text-classification", initializer_range=0.3
    )
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
    """Each task's pipeline on its folder; token classification with ``"simple"`` entities."""
    from transformers import pipeline

    return {
        task: pipeline(
            task,
            model=str(folder),
            **({"aggregation_strategy": "simple"} if task == "token-classification" else {}),
        )
        for task, folder in folders.items()
    }


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
    # Four models load and warm up at start; the machine may be shared.
    async with lifespan(app):
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


async def assert_answers_as_the_pipeline(
    client: httpx.AsyncClient, name: str, task: str, pipe: Callable[..., Any]
) -> None:
    """``name``'s /predict answers to the task's inputs equal the pipeline's, to 1e-4."""
    if task == "image-classification":
        for image in images():
            headers = {"content-type": "image/png"}
            answer = await predict(client, name, content=image, headers=headers)
            assert_same_labels(answer[0], pipe(Image.open(io.BytesIO(image))))
        return
    answers = await predict(client, name, json={"instances": TEXTS})
    for text, answer in zip(TEXTS, answers, strict=True):
        want = pipe(text)
        if task == "text-classification":
            assert_same_labels(answer, want)
        elif task == "feature-extraction":
            features = np.asarray(want)[0].mean(axis=0)
            np.testing.assert_allclose(answer, features, atol=SCORE_TOLERANCE)
        else:
            assert want, "the random tagger finds some entity in each text"
            places = ("entity_group", "word", "start", "end")
            assert [[e[key] for key in places] for e in answer] == [
                [e[key] for key in places] for e in want
            ]
            gaps = [abs(a["score"] - float(b["score"])) for a, b in zip(answer, want, strict=True)]
            assert max(gaps) <= SCORE_TOLERANCE
    if task == "text-classification":
        pairs = await predict(client, name, json={"instances": PAIRS})
        assert_same_labels(pairs[0], [pipe(PAIRS[0])])
        headers = {"content-type": "text/plain"}
        plain = await predict(client, name, content=TEXTS[0], headers=headers)
        assert_same_labels(plain[0], answers[0])


@pytest.mark.parametrize("task", list(NAMES))
async def test_predict_answers_as_the_pipeline(
    repository: Path, pipelines: dict[str, Callable[..., Any]], task: str
) -> None:
    """Raw texts, text pairs and PNGs in; the pipeline's labels, entities or features out."""
    async with serving(repository, NAMES[task]) as client:
        await assert_answers_as_the_pipeline(client, NAMES[task], task, pipelines[task])


PHRASE = "Ada Lovelace wrote the first program in London, not Paris. "
#: Texts whose first 2,048 characters (32 per token of the 64 the models hold) hold fewer
#: than 64 tokens, and long texts cut where what follows could change the last words' tokens.
LONG_TEXTS = {
    "leading spaces": " " * 2100 + PHRASE * 3,
    "leading newlines": "\n" * 2100 + PHRASE * 3,
    "leading zero-width spaces": "\u200b" * 2100 + PHRASE * 3,
    "a long word, then ten phrases": "x" * 2040 + " " + PHRASE * 10,
    "a long word, then a hundred phrases": "x" * 2040 + " " + PHRASE * 100,
    "spaces between long words": ("y" * 90 + " " * 40) * 60 + PHRASE * 5,
    "a long text": PHRASE * 400,
}


@pytest.mark.parametrize("text", list(LONG_TEXTS.values()), ids=list(LONG_TEXTS))
@pytest.mark.parametrize("task", ["text-classification", "token-classification"])
async def test_a_long_text_is_truncated_by_tokens_as_the_pipeline_truncates(
    repository: Path, pipelines: dict[str, Callable[..., Any]], task: str, text: str
) -> None:
    """The model sees the text's first 64 tokens, wherever they are: a text is never cut by
    characters short of them."""
    async with serving(repository, NAMES[task]) as client:
        answer = (await predict(client, NAMES[task], json={"instances": [text]}))[0]
    if task == "text-classification":
        assert_same_labels(answer, pipelines[task](text, truncation=True))
        return
    want = pipelines[task](text)
    assert want, "the random tagger finds some entity in the text's first 64 tokens"
    places = ("entity_group", "word", "start", "end")
    assert [[e[key] for key in places] for e in answer] == [
        [e[key] for key in places] for e in want
    ]


@pytest.mark.parametrize(
    "pair",
    [
        {"text": "the quick brown fox", "text_pair": " " * 2100 + PHRASE * 3},
        {"text": "\u200b" * 2100 + PHRASE * 40, "text_pair": PHRASE * 45},
        {"text": PHRASE * 45, "text_pair": PHRASE * 40},
    ],
    ids=["leading spaces", "both long", "both long, the first longer"],
)
async def test_a_long_pair_is_truncated_as_the_pipeline_truncates_it(
    repository: Path, pipelines: dict[str, Callable[..., Any]], pair: dict[str, str]
) -> None:
    async with serving(repository, "sentiment") as client:
        answer = (await predict(client, "sentiment", json={"instances": [pair]}))[0]
    assert_same_labels(answer, [pipelines["text-classification"](pair, truncation=True)])


async def test_a_pair_with_a_text_above_max_chars_is_refused(repository: Path) -> None:
    """A pair is tokenized whole (which text truncation shortens depends on both lengths),
    so each of its texts is bounded by characters."""
    pair = {"text": "the quick brown fox", "text_pair": "jumps " * 20_000}
    async with serving(repository, "sentiment") as client:
        response = await client.post("/models/sentiment/predict", json={"instances": [pair]})
    assert response.status_code == 413, response.text
    assert "instance 0's text_pair (a pair is not cut) is 120,000 characters long" in (
        response.text
    )


def scores_of(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


async def infer(client: httpx.AsyncClient, name: str, tensor: dict[str, Any]) -> np.ndarray:
    response = await client.post(f"/v2/models/{name}/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    return np.asarray(output["data"], dtype=np.float64).reshape(output["shape"])


async def test_v2_clients_preprocess_and_may_leave_out_the_mask_and_type_ids(
    repository: Path, folders: dict[str, Path], pipelines: dict[str, Callable[..., Any]]
) -> None:
    """Each task over V2 REST, the client tokenizing (ids alone: the mask and type ids are
    optional) or running the image processor itself; the pipeline's answers to 1e-4."""
    from transformers import ViTImageProcessor, pipeline

    tokenizers = {
        name: Tokenizer.from_file(str(folders[task] / "tokenizer.json"))
        for task, name in NAMES.items()
        if task != "image-classification"
    }

    def ids_of(name: str, text: str) -> dict[str, Any]:
        ids = tokenizers[name].encode(text).ids
        return {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}

    processor = ViTImageProcessor.from_pretrained(str(folders["image-classification"]))
    tagger = pipeline("token-classification", model=str(folders["token-classification"]))
    async with serving(repository, *NAMES.values()) as client:
        for text in TEXTS:
            scores = scores_of(await infer(client, "sentiment", ids_of("sentiment", text)))[0]
            want = pipelines["text-classification"](text)[0]
            assert ("negative", "positive")[int(scores.argmax())] == want["label"]
            assert abs(scores.max() - want["score"]) <= SCORE_TOLERANCE

            embedding = (await infer(client, "embedder", ids_of("embedder", text)))[0]
            features = np.asarray(pipelines["feature-extraction"](text))[0].mean(axis=0)
            np.testing.assert_allclose(embedding, features, atol=SCORE_TOLERANCE)

            per_token = scores_of(await infer(client, "tagger", ids_of("tagger", text)))[0]
            for entity in tagger(text):
                row = per_token[entity["index"]]
                assert TOKEN_LABELS[int(row.argmax())] == entity["entity"]
                assert abs(row.max() - float(entity["score"])) <= SCORE_TOLERANCE
        for image in images():
            picture = Image.open(io.BytesIO(image))
            pixels = processor(picture, return_tensors="np")["pixel_values"]
            tensor = {
                "name": "pixel_values",
                "shape": list(pixels.shape),
                "datatype": "FP32",
                "data": pixels.ravel().tolist(),
            }
            scores = scores_of(await infer(client, "vit", tensor))[0]
            want = pipelines["image-classification"](picture)[0]
            assert IMAGE_LABELS[int(scores.argmax())] == want["label"]
            assert abs(scores.max() - want["score"]) <= SCORE_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("task", list(NAMES))
async def test_an_onnx_export_of_the_version_answers_as_the_pipeline(
    repository: Path, pipelines: dict[str, Callable[..., Any]], task: str
) -> None:
    store = ModelStore(repository)
    source = store.resolve(NAMES[task])
    exported = export_version(store, NAMES[task], source.version, "onnx")
    assert exported.handler == source.handler
    async with serving(repository, f"{NAMES[task]}@{exported.version}") as client:
        await assert_answers_as_the_pipeline(client, NAMES[task], task, pipelines[task])


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


@pytest.mark.parametrize(
    ("save", "task"),
    [(save_distilbert_classifier, "text-classification"), (save_gpt2_model, "feature-extraction")],
    ids=["distilbert without label names", "bare gpt2"],
)
async def test_folders_transformers_reads_are_served_as_the_pipeline_answers(
    tmp_path: Path, save: Callable[[Path], Path], task: str
) -> None:
    """A DistilBERT whose config.json names no labels (``AutoConfig`` gives ``LABEL_0``...),
    and a bare GPT-2, whose config names its length ``n_positions``."""
    from transformers import pipeline

    folder = save(tmp_path / "folder")
    repository = tmp_path / "repository"
    assert (
        main(["package", "--repository", str(repository), "--name", "m", "--hf", str(folder)]) == 0
    )
    manifest = ModelStore(repository).resolve("m")
    assert manifest.metadata["task"] == task
    assert manifest.inputs[0].max_length == MAX_POSITIONS
    async with serving(repository, "m") as client:
        await assert_answers_as_the_pipeline(client, "m", task, pipeline(task, model=str(folder)))


def test_an_unserved_encoder_decoder_is_refused_naming_it_and_what_is_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import MBartConfig, MBartForConditionalGeneration

    from tests.generative_models import save_folder

    config = MBartConfig(
        vocab_size=300,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )
    folder = save_folder(tmp_path / "mbart", MBartForConditionalGeneration(config))
    capsys.readouterr()
    assert main(["package", "--repository", str(tmp_path), "--name", "x", "--hf", str(folder)]) == 1
    error = capsys.readouterr().err
    assert "architecture 'MBartForConditionalGeneration' is not served by --hf" in error
    assert "*ForSequenceClassification" in error
    assert "the bare model (MBartModel) as feature extraction" in error
    assert "causal language models (*ForCausalLM, *LMHeadModel) as text generation" in error
    assert "*ForConditionalGeneration of model_type bart or t5 (T5, BART)" in error


def test_a_folder_without_model_safetensors_is_refused_saying_how_to_save_it(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As older transformers saved it: ``pytorch_model.bin``, which is never unpickled."""
    folder = tmp_path / "old"
    shutil.copytree(folders["text-classification"], folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["package", "--repository", str(tmp_path), "--name", "x", "--hf", str(folder)]) == 1
    error = capsys.readouterr().err
    assert "has no single model.safetensors (found ['pytorch_model.bin'])" in error
    assert "model.save_pretrained(new)" in error
    assert "tokenizer.save_pretrained(new)" in error


def test_every_file_of_a_saved_folder_is_hashed_into_the_version(
    repository: Path, folders: dict[str, Path]
) -> None:
    versions = ModelStore(repository).versions("sentiment")
    manifest = next(version for version in versions if "exported_from" not in version.metadata)
    assert set(manifest.files) == {path.name for path in folders["text-classification"].iterdir()}
    assert manifest.version_matches_content


#: What a training run leaves beside a saved model, and why each is left out.
TRAINING_LEFTOVERS = {
    "pytorch_model.bin": "weights or training state; the version loads model.safetensors alone",
    "training_args.bin": "weights or training state; the version loads model.safetensors alone",
    "optimizer.pt": "weights or training state; the version loads model.safetensors alone",
    "scheduler.pt": "weights or training state; the version loads model.safetensors alone",
    "rng_state.pth": "weights or training state; the version loads model.safetensors alone",
    "labels.pkl": "a pickle, never loaded",
    "modeling_custom.py": "code, never run",
    "trainer_state.json": "not read when serving",
    "README.md": "not read when serving",
    "checkpoint-500": "a folder",
}


def test_files_serving_never_reads_are_left_out_of_the_version_and_named(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The version, and so its id, holds what serving reads: the same as without them."""
    clean = folders["text-classification"]
    trained = tmp_path / "trained"
    shutil.copytree(clean, trained)
    for name in TRAINING_LEFTOVERS:
        if name == "checkpoint-500":
            (trained / name).mkdir()
        else:
            (trained / name).write_bytes(b"left by training")
    args = ["package", "--repository", str(tmp_path / "repository"), "--name", "sentiment"]
    capsys.readouterr()

    assert main([*args, "--hf", str(clean)]) == 0
    clean_version = capsys.readouterr().out.strip()
    assert main([*args, "--hf", str(trained)]) == 0
    printed = capsys.readouterr()

    assert printed.out.strip() == clean_version
    manifest = ModelStore(tmp_path / "repository").resolve("sentiment")
    assert set(manifest.files) == {path.name for path in clean.iterdir()}
    assert "left out of sentiment@" in printed.err
    for name, why in TRAINING_LEFTOVERS.items():
        assert f"{name} ({why})" in printed.err
