"""A generation request, the state of its sequence as it runs, and the events it yields."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch

from service.engine.generation.sampling import Choice, SamplingParams, choose
from service.types import Priority

FinishReason = Literal["stop", "length", "error"]
"""``stop``: an end-of-sequence or stop token; ``length``: ``max_tokens`` or the room the
context leaves; ``error``: the model gave non-finite logits for this sequence."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: Hashable
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None
    """New tokens at most; ``None``: as many as the context leaves."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end the sequence beside the model's end-of-sequence ids (included in the
    output, as the end-of-sequence id is)."""
    ignore_eos: bool = False
    """Generate past the model's end-of-sequence ids (benchmarks)."""
    priority: Priority = "normal"
    """Waiting requests join the batch high before normal, in arrival order within each."""


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one sequence; the last of its sequence has a ``finish_reason``."""

    request_id: Hashable
    token_id: int | None
    """``None`` only when the sequence failed (``finish_reason`` ``error``)."""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: FinishReason | None = None


class RunningSequence:
    """A request's progress: how much of its prompt is cached, what it generated, its slot.

    ``context_ids``: the tokens before the generated ones that its ``repetition_penalty``
    counts: its prompt (a causal LM's), or the decoder's start token (an encoder-decoder's,
    whose prompt is the encoder's input: ``generate`` counts the decoder's tokens only)."""

    def __init__(
        self,
        request: GenerationRequest,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        generator: torch.Generator | None,
        context_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.request = request
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.generator = generator
        self.context_ids = request.prompt_ids if context_ids is None else context_ids
        self.slot = -1
        self.prefilled = 0
        self.generated: list[int] = []

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.prefilled

    @property
    def cached_tokens(self) -> int:
        """Positions of its slot that hold its keys and values: the prompt prefilled so far,
        and every generated token but the last, which the next decode step feeds."""
        return self.prefilled + max(0, len(self.generated) - 1)

    def accept(self, choice: Choice) -> TokenEvent:
        """Take the chosen token; the event says whether the sequence is done."""
        token = choice.token_id
        self.generated.append(token)
        reason: FinishReason | None = None
        if token in self.stop_ids:
            reason = "stop"
        elif len(self.generated) >= self.max_new_tokens:
            reason = "length"
        return TokenEvent(
            self.request.request_id, token, choice.logprob, choice.top_logprobs, reason
        )

    def failed(self) -> TokenEvent:
        return TokenEvent(self.request.request_id, None, finish_reason="error")


def accept_next(sequences: list[RunningSequence], logits: torch.Tensor) -> list[TokenEvent]:
    """Each sequence's next token from its row of ``logits`` (``[rows, vocab]``); a sequence
    whose logits are not finite fails alone, its batch-mates unharmed."""
    if not sequences:
        return []
    logits = logits.float()
    # A NaN or an infinity anywhere in a row makes its sum one (a cheaper test than isfinite
    # on every logit).
    finite: list[bool] = torch.isfinite(logits.sum(dim=-1)).tolist()
    good = [row for row, ok in enumerate(finite) if ok]
    everyone = len(good) == len(finite)
    chosen = (
        choose(
            logits if everyone else logits[good],  # no copy when all are good
            [sequences[row].request.sampling for row in good],
            [sequences[row].generator for row in good],
            sequences if everyone else [sequences[row] for row in good],
        )
        if good
        else []
    )
    choices = iter(chosen)
    return [
        sequence.accept(next(choices)) if ok else sequence.failed()
        for sequence, ok in zip(sequences, finite, strict=True)
    ]
