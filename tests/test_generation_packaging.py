"""``batchserve package --hf`` on causal language models: GPT-2 and Llama-shaped folders
become ``text-generation`` versions whose tokenizer and generation settings are hashed in,
and load into a model whose next-token logits are the model's own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.model_store import ModelStore
from service.server.cli import main
from tests import generative_models
from tests.generative_models import CONTEXT, EOS, VOCAB, save_folder

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def package(folder: Path, repository: Path, name: str = "lm") -> int:
    return main(["package", "--repository", str(repository), "--name", name, "--hf", str(folder)])


@pytest.mark.parametrize("build", [generative_models.gpt2, generative_models.llama])
def test_a_causal_lm_folder_packages_and_loads_with_its_own_logits(
    tmp_path: Path, build: Callable[[], Any]
) -> None:
    model = build()
    folder = save_folder(tmp_path / "folder", model)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [EOS, 7], "temperature": 0.7, "max_new_tokens": 20})
    )
    assert package(folder, tmp_path / "repository") == 0
    store = ModelStore(tmp_path / "repository")
    manifest = store.resolve("lm")
    assert manifest.metadata["task"] == "text-generation"
    assert manifest.metadata["eos_token_ids"] == [EOS, 7]
    assert manifest.metadata["context_tokens"] == CONTEXT
    assert manifest.metadata["generation_defaults"] == {"temperature": 0.7, "max_new_tokens": 20}
    assert manifest.handler is None
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
        manifest.files
    )
    assert manifest.version_matches_content
    assert manifest.outputs[0].shape == (-1, VOCAB)

    module = store.load("lm", manifest.version).module
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, EOS, EOS]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.inference_mode():
        ours = module(prompts, mask)
        alone = [
            model(input_ids=torch.tensor([ids])).logits[0, -1] for ids in ([5, 6, 7, 8], [9, 10])
        ]
    torch.testing.assert_close(ours, torch.stack(alone), rtol=1e-4, atol=1e-4)


def test_the_tokenizer_and_generation_config_are_in_the_version_id(tmp_path: Path) -> None:
    folder = save_folder(tmp_path / "folder", generative_models.gpt2())
    repository = tmp_path / "repository"
    assert package(folder, repository, "a") == 0
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert package(folder, repository, "b") == 0
    store = ModelStore(repository)
    first, second = store.resolve("a"), store.resolve("b")
    assert first.version != second.version
    assert second.metadata["eos_token_ids"] == [3]


def test_an_architecture_that_cannot_be_served_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = save_folder(tmp_path / "folder", generative_models.gpt2())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert package(folder, tmp_path / "repository") == 1
    error = capsys.readouterr().err
    assert "architecture 'MadeUpForCausalLM' cannot be served for generation" in error
    assert "must be a transformers model class" in error
    assert "served are the causal LMs of transformers (*ForCausalLM, *LMHeadModel)" in error


def test_a_causal_lm_without_a_fast_tokenizer_is_refused_saying_how_to_save_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = save_folder(tmp_path / "folder", generative_models.gpt2())
    (folder / "tokenizer.json").unlink()
    capsys.readouterr()
    assert package(folder, tmp_path / "repository") == 1
    assert "has no tokenizer.json, which the front ends tokenize prompts with" in (
        capsys.readouterr().err
    )
