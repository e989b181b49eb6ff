"""What a causal LM's own files say about stopping: its end-of-sequence ids and its context
length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def eos_token_ids(
    generation_config: Mapping[str, Any] | None, config: Mapping[str, Any]
) -> tuple[int, ...]:
    """The ids that end a sequence: ``generation_config.json``'s ``eos_token_id`` (an id or a
    list of them), else ``config.json``'s, as ``transformers``' ``generate`` reads them."""
    for source in (generation_config or {}, config):
        value = source.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
            raise ValueError(f"eos_token_id must be an integer or a list of them, got {value!r}")
        return tuple(ids)
    return ()


def context_tokens(config: Any) -> int:
    """How many tokens (prompt and generated) a sequence may hold: the model's
    ``max_position_embeddings`` (GPT-2's ``n_positions``), and no more than its sliding
    window when a layer attends through one (the cache's mask does not slide)."""
    text_config = config.get_text_config(decoder=True)
    limit = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(
            f"{type(text_config).__name__} names no context length (max_position_embeddings "
            f"or n_positions), got {limit!r}"
        )
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    kinds = set(layer_types or ["sliding_attention" if window else "full_attention"])
    unsupported = kinds - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ValueError(
            f"layers of type {sorted(unsupported)} cannot be served by continuous batching; "
            "full and sliding-window attention can"
        )
    if "sliding_attention" in kinds and isinstance(window, int) and window > 0:
        return min(limit, window)
    return limit
