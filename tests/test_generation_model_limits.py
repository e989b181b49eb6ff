"""What a causal LM's files say about stopping: end-of-sequence ids, context length."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, T5Config

from service.engine.generation.model_limits import context_tokens, eos_token_ids


def test_eos_ids_come_from_the_generation_config_first() -> None:
    assert eos_token_ids({"eos_token_id": [7, 9]}, {"eos_token_id": 2}) == (7, 9)
    assert eos_token_ids({"eos_token_id": None}, {"eos_token_id": 2}) == (2,)
    assert eos_token_ids(None, {"eos_token_id": 2}) == (2,)
    assert eos_token_ids({}, {}) == ()
    with pytest.raises(ValueError, match=r"an integer or a list of them, got \['2'\]"):
        eos_token_ids({"eos_token_id": ["2"]}, {})
    with pytest.raises(ValueError, match="got True"):
        eos_token_ids({}, {"eos_token_id": True})


def test_the_context_is_the_models_positions_or_its_sliding_window() -> None:
    assert context_tokens(GPT2Config(n_positions=256)) == 256
    assert context_tokens(LlamaConfig(max_position_embeddings=2048)) == 2048
    assert context_tokens(Qwen2Config(max_position_embeddings=4096, sliding_window=128)) == 4096
    mistral = MistralConfig(max_position_embeddings=8192, sliding_window=1024)
    assert context_tokens(mistral) == 1024
    assert context_tokens(MistralConfig(max_position_embeddings=8192, sliding_window=None)) == 8192


def test_layers_that_cannot_be_served_are_named() -> None:
    config = LlamaConfig(max_position_embeddings=64)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] cannot be served"):
        context_tokens(config)
    with pytest.raises(ValueError, match="T5Config names no context length"):
        context_tokens(T5Config())
