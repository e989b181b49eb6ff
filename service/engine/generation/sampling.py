"""Choosing each sequence's next token from its logits, with its own sampling settings.

A row with penalties first has them applied to its logits (``penalised``): its
``repetition_penalty`` (as ``transformers``' and vLLM's: over the tokens it has seen, a
positive logit divided by it, a negative one multiplied), then its ``frequency_penalty`` and
``presence_penalty`` (as OpenAI's: the logit of a token generated ``c`` times so far, less
``frequency * c + presence * (c > 0)``). Rows without penalties are not copied or touched.
Greedy rows take the argmax. Sampled rows divide by their temperature, keep their ``top_k``
and ``top_p`` tokens, and draw with their own ``torch.Generator`` (vLLM's exponential race:
the argmax of ``probs / q`` with ``q ~ Exp(1)`` is a draw from ``probs``), so a seeded
sequence draws the same tokens whatever shares its batch. Every step works row by row, never
across rows. Log-probabilities are those of the model's own distribution (before penalties,
temperature and truncation), as vLLM reports by default.
"""

from __future__ import annotations

import math
import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from service.errors import InvalidInputError

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""
MAX_FREQUENCY_PENALTY = 2.0
"""OpenAI's bound on ``frequency_penalty`` and ``presence_penalty`` (either sign)."""


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
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit for each time the sequence generated it; -2 to 2."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the sequence generated; -2 to 2."""
    repetition_penalty: float = 1.0
    """Divides the positive logits (multiplies the negative) of every token seen: the
    prompt's and the generated; above 0, 1 for none."""

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
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_FREQUENCY_PENALTY <= value <= MAX_FREQUENCY_PENALTY:
                raise InvalidInputError(
                    f"{name} must be between {-MAX_FREQUENCY_PENALTY} and "
                    f"{MAX_FREQUENCY_PENALTY}, got {value}"
                )
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidInputError(
                f"repetition_penalty must be above 0 (1 for none), got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )


class TokenHistory(Protocol):
    """What a sequence has seen, which its penalties count."""

    @property
    def context_ids(self) -> Sequence[int]:
        """The tokens before the generated ones (``repetition_penalty`` counts them too)."""
        ...

    @property
    def generated(self) -> Sequence[int]: ...


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
    histories: Sequence[TokenHistory] = (),
) -> list[Choice]:
    """The next token of each row of ``logits`` (``[rows, vocab]``); ``histories``, one a
    row, are needed only when a row has penalties."""
    logits = logits.float()
    scores = penalised(logits, params, histories)
    tokens = scores.argmax(dim=-1)
    sampled = [row for row, settings in enumerate(params) if not settings.greedy]
    if sampled:
        chosen = _sample(scores[sampled], [params[row] for row in sampled])
        for index, row in enumerate(sampled):
            generator = generators[row]
            noise = torch.empty_like(chosen[index]).exponential_(generator=generator)
            tokens[row] = (chosen[index] / noise).argmax()
    token_ids: list[int] = tokens.tolist()
    if not any(settings.logprobs or settings.top_logprobs for settings in params):
        return [Choice(token) for token in token_ids]
    return _with_logprobs(logits, tokens, token_ids, params)


def penalised(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``, float) with each row's penalties applied, in vLLM's
    order (repetition, frequency, presence); ``logits`` itself when no row has any."""
    rows = [row for row, settings in enumerate(params) if settings.penalised]
    if not rows:
        return logits
    scores = logits.clone()
    device = logits.device
    for row in rows:
        settings, history = params[row], histories[row]
        if settings.repetition_penalty != 1.0:
            seen = _ids(array("q", history.context_ids) + array("q", history.generated), device)
            values = scores[row, seen]
            penalty = settings.repetition_penalty
            scores[row, seen] = torch.where(values < 0, values * penalty, values / penalty)
        if (settings.frequency_penalty or settings.presence_penalty) and history.generated:
            counts = _ids(array("q", history.generated), device).bincount()
            tokens = counts.nonzero().squeeze(1)
            penalties = settings.frequency_penalty * counts[tokens] + settings.presence_penalty
            scores[row, tokens] -= penalties
    return scores


def _ids(ids: array[int], device: torch.device) -> torch.Tensor:
    """Token ids as a tensor; through an ``array``, several times cheaper than a list of
    Python ints (a prompt is read again at every step)."""
    if not ids:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(ids, dtype=torch.int64).to(device)


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
