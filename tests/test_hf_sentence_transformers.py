"""``batchserve package --hf`` of a folder ``sentence-transformers`` saved: served when its
answers equal ``SentenceTransformer.encode`` (a Transformer and a mean Pooling), refused naming
each module it would not apply otherwise (served without them, every answer is wrong)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from service.engine.model_store import ModelStore
from service.server.cli import main
from tests.hf_folders import save_sentence_transformer, save_text_model
from tests.test_hf import predict, serving

pytest.importorskip("sentence_transformers")

pytestmark = [
    # transformers and sentence-transformers warn at import and of renamed arguments.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "the quick brown fox jumps over the lazy dog and Ada Lovelace wrote the first program",
]


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("bert") / "bert", "feature-extraction")


def package(folder: Path, repository: Path) -> int:
    return main(["package", "--repository", str(repository), "--name", "st", "--hf", str(folder)])


def legacy(folder: Path, max_seq_length: int) -> Path:
    """``folder`` with the configs sentence-transformers 2 to 5 wrote: pooling flags, and the
    transformer's length in ``sentence_bert_config.json``."""
    pooling = {"word_embedding_dimension": 16, "pooling_mode_cls_token": False}
    pooling |= {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
    (folder / "1_Pooling" / "config.json").write_bytes(orjson.dumps(pooling))
    settings = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_bytes(orjson.dumps(settings))
    return folder


def with_default_prompt(folder: Path) -> Path:
    path = folder / "config_sentence_transformers.json"
    config = orjson.loads(path.read_bytes())
    config |= {"prompts": {"query": "query: "}, "default_prompt_name": "query"}
    path.write_bytes(orjson.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("modules", "named"),
    [
        ({"then": ("normalize",)}, "2_Normalize (Normalize)"),
        ({"pooling": "cls"}, "pooling_mode ['cls']"),
        ({"pooling": "max"}, "pooling_mode ['max']"),
        ({"then": ("dense",)}, "2_Dense (Dense)"),
        ({"then": ("dense", "normalize")}, "2_Dense (Dense); 3_Normalize (Normalize)"),
        ({"default_prompt": True}, "default_prompt_name='query'"),
    ],
    ids=["normalize", "cls", "max", "dense", "dense-normalize", "default-prompt"],
)
def test_a_folder_with_a_module_that_is_not_served_is_refused_naming_it(
    transformer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    modules: dict[str, Any],
    named: str,
) -> None:
    options = dict(modules)
    default_prompt = options.pop("default_prompt", False)
    folder = save_sentence_transformer(tmp_path / "st", transformer, **options)
    if default_prompt:
        with_default_prompt(folder)
    capsys.readouterr()
    assert package(folder, tmp_path / "repository") == 1
    error = capsys.readouterr().err
    assert "is a sentence-transformers model" in error
    assert named in error
    assert "followed by a Pooling with pooling_mode 'mean'" in error  # what is served
    assert not (tmp_path / "repository" / "st").exists()


@pytest.mark.parametrize("configs", ["saved", "legacy"])
async def test_a_transformer_with_mean_pooling_answers_as_encode(
    transformer: Path, tmp_path: Path, configs: str
) -> None:
    """Its answers equal ``SentenceTransformer.encode``, a text past its ``max_seq_length``
    truncated as ``encode`` truncates it (an old folder's length in its
    ``sentence_bert_config.json`` wins over the tokenizer's, as in ``encode``)."""
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_transformer(tmp_path / "st", transformer, max_seq_length=12)
    length = 12
    if configs == "legacy":
        length = 10
        legacy(folder, max_seq_length=length)
    repository = tmp_path / "repository"
    assert package(folder, repository) == 0
    manifest = ModelStore(repository).resolve("st")
    assert manifest.inputs[0].max_length == length
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    async with serving(repository, "st") as client:
        answers = await predict(client, "st", json={"instances": TEXTS})
    np.testing.assert_allclose(np.asarray(answers), want, atol=1e-5)


def test_a_bare_model_folder_still_packages_as_feature_extraction(
    transformer: Path, tmp_path: Path
) -> None:
    assert package(transformer, tmp_path) == 0
    manifest = ModelStore(tmp_path).resolve("st")
    assert manifest.metadata["task"] == "feature-extraction"
    assert manifest.outputs[0].name == "embedding"
