"""``batchserve package --hf`` of folders ``sentence-transformers`` saved: an embedding model
answers as ``SentenceTransformer.encode`` and a reranker as ``CrossEncoder.predict`` on the same
folder (1e-5), over ``/predict``; what would answer otherwise is refused, naming it."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from service.config import Settings
from service.engine.model_store import ModelStore
from service.engine.sentence_modules import POOLING_MODES, SentenceHead
from service.packaging.export import export_version
from service.server.cli import main
from service.server.single import create_app
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.hf_folders import (
    save_cross_encoder,
    save_sentence_transformer,
    save_text_model,
)

pytest.importorskip("sentence_transformers")

pytestmark = [
    # transformers and sentence-transformers warn at import and of renamed arguments.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

PARITY = 1e-5
MAX_SEQ_LENGTH = 12
TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "the quick brown fox jumps over the lazy dog and Ada Lovelace wrote the first program",
    "a",
]
PROMPTS = {"query": "query: ", "passage": "a dull story: "}
#: Each embedding model packaged (all with ``max_seq_length`` 12, past which the longest
#: text is cut): its modules and settings. Every pooling mode is in one of them (several
#: modes concatenated, as sentence-transformers concatenates them).
EMBEDDERS: dict[str, dict[str, Any]] = {
    "cls": {"pooling": "cls"},
    "max-lasttoken": {"pooling": ("max", "lasttoken")},
    "weightedmean-sqrt": {"pooling": ("weightedmean", "mean_sqrt_len_tokens")},
    "dense-normalize": {"pooling": "cls", "then": ("dense", "normalize")},
    "residual-gelu": {"pooling": "mean", "then": ("normalize", "dense-gelu")},
    "matryoshka": {"pooling": "mean", "then": ("normalize",), "truncate_dim": 5},
    "prompts": {"prompts": PROMPTS, "default_prompt_name": "passage"},
    "no-prompt-pooled": {
        "pooling": "weightedmean",
        "then": ("dense", "normalize"),
        "include_prompt": False,
        "prompts": PROMPTS,
        "default_prompt_name": "query",
    },
    "legacy": {"pooling": "max"},  # rewritten by ``legacy``
}
LEGACY_MAX_SEQ_LENGTH = 10


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("bert") / "bert", "feature-extraction")


@pytest.fixture(scope="module")
def embedders(transformer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    folders = {
        name: save_sentence_transformer(
            root / name, transformer, max_seq_length=MAX_SEQ_LENGTH, **modules
        )
        for name, modules in EMBEDDERS.items()
    }
    legacy(folders["legacy"])
    return folders


def legacy(folder: Path) -> Path:
    """``folder`` with the configs sentence-transformers 2 to 5 wrote: pooling flags (two
    modes: CLS and mean, concatenated in that order), and the transformer's length in
    ``sentence_bert_config.json`` (which wins over the tokenizer's)."""
    pooling = {"word_embedding_dimension": 16, "pooling_mode_mean_tokens": True}
    pooling |= {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": False}
    (folder / "1_Pooling" / "config.json").write_bytes(orjson.dumps(pooling))
    settings = {"max_seq_length": LEGACY_MAX_SEQ_LENGTH, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_bytes(orjson.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def repository(embedders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, folder in embedders.items():
        assert package(folder, root, name) == 0
    return root


def package(folder: Path, repository: Path, name: str = "st") -> int:
    return main(["package", "--repository", str(repository), "--name", name, "--hf", str(folder)])


@asynccontextmanager
async def serving(
    repository: Path, *models: str, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The models served in one process, each warmed up at one batch size (the machine may
    be shared)."""
    app = create_app(
        Settings(
            model_repository=repository,
            models=models,
            device="cpu",
            max_wait_ms=20.0,
            warmup_batch_sizes=(1,),
            **settings,
        )
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def predict(client: httpx.AsyncClient, name: str, query: str = "", **body: Any) -> Any:
    response = await client.post(f"/models/{name}/predict{query}", **body)
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


def edited(folder: Path, file: str, **changes: Any) -> Path:
    """``folder`` with ``changes`` written into its JSON ``file`` (``None`` removes a key)."""
    path = folder / file
    document = orjson.loads(path.read_bytes())
    document |= changes
    document = {key: value for key, value in document.items() if value is not None}
    path.write_bytes(orjson.dumps(document))
    return folder


def test_the_head_pools_each_row_as_sentence_transformers_pools_it_alone() -> None:
    """``SentenceHead`` on a batch of right-padded rows, each with its own prompt length,
    equals sentence-transformers' modules on each row alone (its length, its prompt)."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    torch.manual_seed(3)
    lengths, prompts = [7, 3, 5, 1], [2, 0, 4, 0]
    tokens = torch.randn(len(lengths), max(lengths), 6)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    modes = [(mode,) for mode in POOLING_MODES] + [("cls", "max", "mean")]
    for pooling in modes:
        for include_prompt in (True, False):
            dense = Dense(6 * len(pooling), 4, activation_function=torch.nn.Sigmoid())
            steps = [
                {"kind": "pooling", "modes": list(pooling), "include_prompt": include_prompt},
                {"kind": "dense", "in_features": 6 * len(pooling), "out_features": 4},
                {"kind": "normalize"},
            ]
            steps[1]["activation"] = "Sigmoid"
            head = SentenceHead(steps)
            head.steps[0].load_state_dict(dense.state_dict())
            with torch.inference_mode():
                got = head(tokens, mask, torch.tensor(prompts))
            reference = [
                Pooling(6, pooling_mode=pooling, include_prompt=include_prompt),
                dense,
                Normalize(),
            ]
            for row, (length, prompt) in enumerate(zip(lengths, prompts, strict=True)):
                features: dict[str, Any] = {
                    "token_embeddings": tokens[row : row + 1, :length],
                    "attention_mask": torch.ones(1, length, dtype=torch.int64),
                    "prompt_length": prompt,
                }
                with torch.inference_mode():
                    for module in reference:
                        features = module(features)
                want = features["sentence_embedding"][0]
                torch.testing.assert_close(got[row], want, atol=PARITY, rtol=0, msg=str(pooling))


async def test_each_embedding_model_answers_as_encode(
    repository: Path, embedders: dict[str, Path]
) -> None:
    """Every pooling, Dense (its activation, bias, residual), Normalize, ``truncate_dim``, the
    default prompt and named ones, a pooling that leaves the prompt out, and a text past
    ``max_seq_length``: ``/predict`` equals ``encode`` on the folder to 1e-5."""
    from sentence_transformers import SentenceTransformer

    async with serving(repository, *embedders) as client:
        for name, folder in embedders.items():
            model = SentenceTransformer(str(folder), device="cpu")
            named = [None, *PROMPTS] if EMBEDDERS[name].get("prompts") else [None]
            for prompt_name in named:
                query = f"?prompt_name={prompt_name}" if prompt_name else ""
                answers = await predict(client, name, query, json={"instances": TEXTS})
                want = model.encode(TEXTS, prompt_name=prompt_name)
                assert np.asarray(answers).shape == want.shape, name
                np.testing.assert_allclose(answers, want, atol=PARITY, err_msg=f"{name} {query}")
        # Texts alone and in one request answer alike (a batch pads them together).
        alone = [await predict(client, "cls", json={"instances": [text]}) for text in TEXTS]
        together = await predict(client, "cls", json={"instances": TEXTS})
        np.testing.assert_allclose(np.concatenate(alone), together, atol=PARITY)
        unknown = await client.post(
            "/models/prompts/predict?prompt_name=passages", json={"instances": TEXTS}
        )
        assert unknown.status_code == 422
        assert "prompt_name 'passages' is not one of this version's prompts" in unknown.text


def test_the_version_records_its_modules_prompts_and_similarity(repository: Path) -> None:
    store = ModelStore(repository)
    assert store.resolve("legacy").inputs[0].max_length == LEGACY_MAX_SEQ_LENGTH
    legacy_steps = store.resolve("legacy").architecture.kwargs["steps"]  # type: ignore[union-attr]
    assert legacy_steps[0]["modes"] == ["cls", "mean"]
    manifest = store.resolve("no-prompt-pooled")
    assert manifest.inputs[0].max_length == MAX_SEQ_LENGTH
    assert [spec.name for spec in manifest.inputs][-1] == "prompt_length"
    assert manifest.metadata["similarity_fn_name"] == "cosine"
    assert manifest.handler is not None
    assert manifest.handler.options["prompts"] == {"document": "", **PROMPTS}
    assert manifest.handler.options["default_prompt_name"] == "query"
    steps = manifest.architecture.kwargs["steps"] if manifest.architecture else []
    assert steps == [
        {"kind": "pooling", "modes": ["weightedmean"], "include_prompt": False},
        {
            "kind": "dense",
            "in_features": 16,
            "out_features": 8,
            "bias": True,
            "activation": "Tanh",
            "residual": False,
        },
        {"kind": "normalize"},
    ]
    dense = store.resolve("dense-normalize")
    assert dense.outputs[0].shape == (-1, 8)
    assert dense.outputs[0].shape == manifest.outputs[0].shape
    # The Dense layer's weights are packaged in the version's artifact, with the transformer's.
    assert set(dense.files) == {
        "model.safetensors",
        "config.json",
        "config_sentence_transformers.json",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert store.resolve("matryoshka").outputs[0].shape == (-1, 5)


@pytest.mark.slow
def test_an_embedding_model_exports_and_answers_alike(repository: Path) -> None:
    """Its steps (a pooling leaving the prompt out, Dense, Normalize) export as plain tensor
    operations: the export's answers are measured against the source's when it is written."""
    store = ModelStore(repository)
    source = store.resolve("no-prompt-pooled")
    exported = export_version(store, "no-prompt-pooled", source.version, "onnx")
    assert exported.metadata["parity"]["max_abs_diff"] <= 1e-4
    assert exported.handler == source.handler


@pytest.fixture(scope="module")
def wide_transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformer whose answers differ from one text to the next far beyond 1e-5."""
    root = tmp_path_factory.mktemp("wide")
    return save_text_model(root / "bert", "feature-extraction", initializer_range=0.3)


QUERY = "where is Paris"
PAIRS = [(QUERY, text) for text in TEXTS] + [(TEXTS[2], TEXTS[2])]


def legacy_cross_encoder(folder: Path) -> Path:
    """``folder`` (a CrossEncoder saved by sentence-transformers 6) as sentence-transformers 4
    and 5 saved one: no modules.json, the activation in config.json."""
    settings = orjson.loads((folder / "config_sentence_transformers.json").read_bytes())
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (folder / name).unlink()
    activation = {"activation_fn": settings["activation_fn"]}
    return edited(folder, "config.json", sentence_transformers=activation)


@pytest.mark.parametrize(
    "saved",
    ["sigmoid", "identity", "legacy identity", "prompts", "save_pretrained"],
)
async def test_a_reranker_answers_as_cross_encoder_predict(
    wide_transformer: Path, tmp_path: Path, saved: str
) -> None:
    """Each pair's score with the folder's activation, and ``?raw_scores=true`` its logit,
    equal ``CrossEncoder.predict`` (with its activation, and with ``Identity``) to 1e-5, a
    pair past the model's length truncated as ``predict`` truncates it."""
    from sentence_transformers import CrossEncoder

    settings: dict[str, Any] = {"max_length": MAX_SEQ_LENGTH}
    if "identity" in saved:
        settings["activation_fn"] = torch.nn.Identity()
    if saved == "prompts":
        settings |= {"prompts": PROMPTS, "default_prompt_name": "query"}
    folder = save_cross_encoder(tmp_path / "reranker", wide_transformer, **settings)
    if saved.startswith("legacy"):
        legacy_cross_encoder(folder)
    if saved == "save_pretrained":  # a one-label classifier as transformers saved it
        plain = tmp_path / "plain"
        CrossEncoder(str(folder), device="cpu").model.save_pretrained(plain)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(folder / name, plain / name)
        folder = plain
    repository = tmp_path / "repository"
    assert package(folder, repository, "reranker") == 0
    manifest = ModelStore(repository).resolve("reranker")
    assert manifest.metadata["task"] == "text-ranking"
    reranker = CrossEncoder(str(folder), device="cpu")
    body = {"instances": [{"text": query, "text_pair": text} for query, text in PAIRS]}
    async with serving(repository, "reranker") as client:
        scores = await predict(client, "reranker", json=body)
        raw = await predict(client, "reranker", "?raw_scores=true", json=body)
        if saved == "prompts":
            named = await predict(client, "reranker", "?prompt_name=passage", json=body)
            want = reranker.predict(PAIRS, prompt_name="passage")
            np.testing.assert_allclose(named, want, atol=PARITY)
        refused = await client.post("/models/reranker/predict", json={"instances": [QUERY]})
        assert refused.status_code == 422
        assert "a reranker scores pairs" in refused.text
        wrong = await client.post("/models/reranker/predict?raw_scores=yes", json=body)
        assert wrong.status_code == 422
    want = reranker.predict(PAIRS)
    assert np.ptp(want) > 100 * PARITY, "the scores differ from pair to pair"
    np.testing.assert_allclose(scores, want, atol=PARITY)
    logits = reranker.predict(PAIRS, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(raw, logits, atol=PARITY)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("pickled dense", "2_Dense (Dense): no model.safetensors (found ['config.json', "),
        ("a layer norm", "2_LayerNorm (LayerNorm)"),
        ("untrusted activation", "activation='my_code.Swish'"),
        ("lower case", "do_lower_case=True"),
        ("sparse encoder", "model_type='SparseEncoder'"),
        ("default prompt not a prompt", "default_prompt_name='query', not one of the prompts"),
        ("dense on tokens", "{'module_input_name': 'token_embeddings'}"),
    ],
)
def test_a_folder_that_would_answer_otherwise_is_refused_naming_why(
    transformer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: str,
    named: str,
) -> None:
    from sentence_transformers.sentence_transformer.modules import LayerNorm

    folder = save_sentence_transformer(tmp_path / "st", transformer, then=("dense",))
    if change == "pickled dense":
        weights = folder / "2_Dense" / "model.safetensors"
        weights.rename(weights.with_name("pytorch_model.bin"))
    elif change == "a layer norm":
        (folder / "2_LayerNorm").mkdir()
        LayerNorm(8).save(str(folder / "2_LayerNorm"))
        modules = orjson.loads((folder / "modules.json").read_bytes())
        kind = "sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm"
        modules[2] = {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": kind}
        (folder / "modules.json").write_bytes(orjson.dumps(modules))
    elif change == "untrusted activation":
        edited(folder / "2_Dense", "config.json", activation_function="my_code.Swish")
    elif change == "lower case":
        edited(folder, "sentence_bert_config.json", do_lower_case=True)
    elif change == "sparse encoder":
        edited(folder, "config_sentence_transformers.json", model_type="SparseEncoder")
    elif change == "default prompt not a prompt":
        edited(folder, "config_sentence_transformers.json", default_prompt_name="query", prompts={})
    else:
        edited(folder / "2_Dense", "config.json", module_input_name="token_embeddings")
    capsys.readouterr()
    assert package(folder, tmp_path / "repository") == 1
    error = capsys.readouterr().err
    assert "is a sentence-transformers model with modules or settings --hf" in error
    assert named in error
    if change == "pickled dense":
        assert "never unpickles pytorch_model.bin" in error
        assert "SentenceTransformer(folder).save(new)" in error
    assert not (tmp_path / "repository" / "st").exists()


def test_a_cross_encoder_over_a_bare_model_is_refused(
    transformer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = save_sentence_transformer(tmp_path / "st", transformer)
    edited(folder, "config_sentence_transformers.json", model_type="CrossEncoder")
    capsys.readouterr()
    assert package(folder, tmp_path / "repository") == 1
    assert "a CrossEncoder is served as its Transformer alone" in capsys.readouterr().err


async def test_a_request_over_max_client_batch_size_texts_is_refused_413(
    repository: Path,
) -> None:
    """Before any text is tokenized, saying how to send them."""
    async with serving(repository, "cls", max_client_batch_size=4) as client:
        four = await client.post("/models/cls/predict", json={"instances": TEXTS})
        five = await client.post("/models/cls/predict", json={"instances": [*TEXTS, "b"]})
    assert four.status_code == 200, four.text
    assert five.status_code == 413, five.text
    assert "5 texts in one request; at most 4 are accepted (max_client_batch_size)" in five.text
