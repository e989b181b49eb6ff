"""What ``sentence-transformers`` runs after its transformer, in plain torch.

A sentence-transformers folder lists its modules in ``modules.json``: the transformer, then a
``Pooling`` (token embeddings to one vector), then any ``Dense`` layers and ``Normalize``.
Packaging (``service/server/hf_sentence_transformers.py``) reads their configs into a list of
plain settings kept in the version's manifest; ``SentenceHead`` rebuilds them here, so serving
needs neither ``sentence-transformers`` nor its configs, and exporting a version traces plain
tensor operations. Each step does what the library's module of the same name does (6.x),
on right-padded rows.

A pooling that leaves out the prompt (``include_prompt: false``) takes each row's prompt length
as an input: requests with different prompts share a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional

#: Pooling modes, in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
#: ``torch.nn`` activations a ``Dense`` layer may name (built with no arguments).
ACTIVATIONS = frozenset(
    {"Identity", "Tanh", "Sigmoid", "ReLU", "GELU", "SiLU", "ELU", "LeakyReLU", "Softplus", "Mish"}
)


class Pooling(torch.nn.Module):
    """Token embeddings to one vector per row: each of ``modes``, concatenated."""

    def __init__(self, modes: Sequence[str], include_prompt: bool = True) -> None:
        super().__init__()
        unknown = [mode for mode in modes if mode not in POOLING_MODES]
        if not modes or unknown:
            raise ValueError(f"pooling modes must be among {POOLING_MODES}, got {list(modes)}")
        self.modes = tuple(modes)
        self.include_prompt = include_prompt

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prompt_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones(tokens.shape[:-1], dtype=torch.int64, device=tokens.device)
        mask = attention_mask
        if not self.include_prompt and prompt_length is not None:
            # The prompt's tokens (from the first, rows padded on the right) are not pooled.
            positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
            mask = mask * (positions >= prompt_length.unsqueeze(1)).to(mask.dtype)
        return torch.cat([self._pooled(mode, tokens, mask) for mode in self.modes], dim=-1)

    @staticmethod
    def _pooled(mode: str, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).to(tokens.dtype)
        if mode == "cls":  # the first token pooled
            first = mask.to(torch.int32).argmax(dim=1)
            index = first.view(-1, 1, 1).expand(-1, 1, tokens.shape[-1])
            return torch.gather(tokens, 1, index).squeeze(1)
        if mode == "max":
            return tokens.masked_fill(weights == 0, float("-inf")).max(dim=1).values
        if mode in ("mean", "mean_sqrt_len_tokens"):
            total = (tokens * weights).sum(dim=1)
            count = weights.sum(dim=1).clamp(min=1e-9)
            return total / (count if mode == "mean" else torch.sqrt(count))
        if mode == "weightedmean":  # later tokens weigh more: position 1, 2, 3...
            positions = torch.arange(
                1, tokens.shape[1] + 1, dtype=tokens.dtype, device=tokens.device
            )
            weighted = weights * positions.view(1, -1, 1)
            return (tokens * weighted).sum(dim=1) / weighted.sum(dim=1).clamp(min=1e-9)
        # lasttoken: the last token pooled (the last of the mask's ones)
        length = mask.shape[1]
        values, from_end = mask.flip(1).max(dim=1)
        from_end = torch.where(values == 0, length - 1, from_end)
        index = (length - from_end - 1).view(-1, 1, 1).expand(-1, 1, tokens.shape[-1])
        return torch.gather(tokens * weights, 1, index).squeeze(1)


class Dense(torch.nn.Module):
    """``activation(linear(x))``, plus ``x`` (or its projection) with a residual."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "Tanh",
        residual: bool = False,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        self.activation: torch.nn.Module = getattr(torch.nn, activation)()
        self.use_residual = residual
        self.residual: torch.nn.Module | None = None
        if residual and in_features != out_features:
            self.residual = torch.nn.Linear(in_features, out_features, bias=False)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.activation(self.linear(embedding))
        if self.use_residual:
            out = out + (embedding if self.residual is None else self.residual(embedding))
        return out


class Normalize(torch.nn.Module):
    """Each row to unit length (L2)."""

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return functional.normalize(embedding, p=2, dim=-1)


class Truncate(torch.nn.Module):
    """The first ``dimensions`` of each row (the folder's ``truncate_dim``: Matryoshka)."""

    def __init__(self, dimensions: int) -> None:
        super().__init__()
        self.dimensions = dimensions

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding[:, : self.dimensions]


class SentenceHead(torch.nn.Module):
    """A pooling, then the vector modules, from their settings (``step``'s keys); the weights
    of each ``Dense`` are ``steps.{index}.linear.weight``... in the state dict."""

    def __init__(self, steps: Sequence[Mapping[str, Any]]) -> None:
        super().__init__()
        if not steps or steps[0].get("kind") != "pooling":
            raise ValueError(f"the first step must be a pooling, got {list(steps)[:1]}")
        first = steps[0]
        self.pooling = Pooling(first["modes"], bool(first.get("include_prompt", True)))
        self.steps = torch.nn.ModuleList(_vector_step(step) for step in steps[1:])

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prompt_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embedding: torch.Tensor = self.pooling(tokens, attention_mask, prompt_length)
        for step in self.steps:
            embedding = step(embedding)
        return embedding


def _vector_step(step: Mapping[str, Any]) -> torch.nn.Module:
    kind = step.get("kind")
    if kind == "dense":
        return Dense(
            int(step["in_features"]),
            int(step["out_features"]),
            bias=bool(step.get("bias", True)),
            activation=str(step.get("activation", "Tanh")),
            residual=bool(step.get("residual", False)),
        )
    if kind == "normalize":
        return Normalize()
    if kind == "truncate":
        return Truncate(int(step["dimensions"]))
    raise ValueError(f"a step after the pooling is dense, normalize or truncate, got {kind!r}")
