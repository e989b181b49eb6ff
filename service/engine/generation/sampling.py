"""Choosing each sequence's next token from its logits, with its own sampling settings.

Greedy rows take the argmax. Sampled rows divide by their temperature, keep their ``top_k``
and ``top_p`` tokens, and draw with their own ``torch.Generator`` (vLLM's exponential race:
the argmax of ``probs / q`` with ``q ~ Exp(1)`` is a draw from ``probs``), so a seeded
sequence draws the same tokens whatever shares its batch. Every step works row by row, never
across rows. Log-probabilities are those of the model's own distribution (before temperature
and truncation), as vLLM reports by default.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.errors import InvalidInputError

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (OpenAI's fields and their defaults)."""

    temperature: float = 1.0
    """0 picks the most likely token (greedy); up to 2."""
    top_p: float = 1.0
    """Sample from the fewest most likely tokens whose probability reaches this; in (0, 1]."""
    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens; 0 for all."""
    seed: int | None = None
    """Draw the same tokens for the same prompt and settings, whatever the batch."""
    logprobs: bool = False
    """Report the log-probability of each chosen token."""
    top_logprobs: int = 0
    """And of this many most likely tokens (0 to 20)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise InvalidInputError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidInputError(f"seed must be between 0 and 2**63 - 1, got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInputError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The sequence's own generator: seeded by its ``seed``, else at random; none if greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


@dataclass(frozen=True)
class Choice:
    """One row's next token, and its log-probabilities when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def choose(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Choice]:
    """The next token of each row of ``logits`` (``[rows, vocab]``)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled = [row for row, settings in enumerate(params) if not settings.greedy]
    if sampled:
        chosen = _sample(logits[sampled], [params[row] for row in sampled])
        for index, row in enumerate(sampled):
            generator = generators[row]
            noise = torch.empty_like(chosen[index]).exponential_(generator=generator)
            tokens[row] = (chosen[index] / noise).argmax()
    token_ids: list[int] = tokens.tolist()
    if not any(settings.logprobs or settings.top_logprobs for settings in params):
        return [Choice(token) for token in token_ids]
    return _with_logprobs(logits, tokens, token_ids, params)


def _sample(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The probabilities to draw from, per row: tempered, cut to top-k and top-p."""
    temperature = torch.tensor([settings.temperature for settings in params])
    logits = logits / temperature.to(logits.device).unsqueeze(1)
    if any(settings.top_k or settings.top_p < 1.0 for settings in params):
        logits = _truncated(logits, params)
    return torch.softmax(logits, dim=-1)


def _truncated(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([settings.top_k or vocab for settings in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    ordered = ordered.masked_fill(drop, -math.inf)
    top_p = torch.tensor([settings.top_p for settings in params], device=logits.device)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    # The most likely token always stays (its mass before it is 0).
    ordered = ordered.masked_fill(before >= top_p.unsqueeze(1), -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, ordered)


def _with_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    token_ids: list[int],
    params: Sequence[SamplingParams],
) -> list[Choice]:
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen: list[float] = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    most = max(settings.top_logprobs for settings in params)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if most:
        values, ids = logprobs.topk(most, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    choices = []
    for row, settings in enumerate(params):
        if not (settings.logprobs or settings.top_logprobs):
            choices.append(Choice(token_ids[row]))
            continue
        top = None
        if settings.top_logprobs:
            count = settings.top_logprobs
            top = tuple(zip(top_ids[row][:count], top_values[row][:count], strict=True))
        choices.append(Choice(token_ids[row], chosen[row], top))
    return choices
