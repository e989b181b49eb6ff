"""Which sequences join the running batch at a step, and how much of its prompt each
prefills: pure arithmetic over counts, tested without a model or a clock.

Each step decodes every running sequence that has its prompt cached; beside them it prefills
at most ``prefill_chunk_tokens`` prompt tokens, so a long prompt is cut into chunks over
several steps and the running streams keep their pace. The budget goes first to sequences
already prefilling, in the order they joined, then to waiting ones in their waiting order; a
waiting sequence joins only with a free slot, under ``max_running_sequences``, and with at
least one token of the budget (TGI's ``next_batch`` and vLLM's scheduler work the same way:
running first, then waiting while the budgets last). The waiting order is by priority, high
before normal, and by arrival within a priority (``waiting_position``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.errors import InvalidInputError
from service.types import PRIORITIES, Priority


@dataclass(frozen=True)
class StepLimits:
    max_running_sequences: int
    """Sequences in the running batch at once (decoding and prefilling)."""
    prefill_chunk_tokens: int
    """Prompt tokens prefilled per step, over all sequences."""

    def __post_init__(self) -> None:
        for name in ("max_running_sequences", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class PrefillPlan:
    """The prompt tokens each sequence prefills this step."""

    prefilling: tuple[int, ...]
    """For each sequence already prefilling, in the order given (0: none this step)."""
    joining: tuple[int, ...]
    """For the first ``len(joining)`` waiting sequences, which join the batch now."""


def plan_prefill(
    prefilling_left: Sequence[int],
    waiting_prompts: Sequence[int],
    running: int,
    free_slots: int,
    limits: StepLimits,
) -> PrefillPlan:
    """Share the step's prefill budget.

    ``prefilling_left``: prompt tokens not yet cached, of each sequence already prefilling;
    ``waiting_prompts``: prompt tokens of each waiting sequence, in arrival order;
    ``running``: sequences in the batch now (prefilling ones included); ``free_slots``: KV
    cache slots free.
    """
    budget = limits.prefill_chunk_tokens
    prefilling = []
    for left in prefilling_left:
        tokens = min(left, budget)
        prefilling.append(tokens)
        budget -= tokens
    room = min(limits.max_running_sequences - running, free_slots)
    joining: list[int] = []
    for prompt in waiting_prompts:
        if budget <= 0 or len(joining) >= room:
            break
        tokens = min(prompt, budget)
        joining.append(tokens)
        budget -= tokens
    return PrefillPlan(tuple(prefilling), tuple(joining))


def waiting_position(waiting: Sequence[Priority], priority: Priority) -> int:
    """Where a new request at ``priority`` goes in the waiting line ``waiting`` (each waiting
    request's priority, first to join first): after every request of its priority or a
    higher one, before every lower one."""
    rank = PRIORITIES.index(priority)
    position = len(waiting)
    while position > 0 and PRIORITIES.index(waiting[position - 1]) > rank:
        position -= 1
    return position


def new_tokens_allowed(
    prompt_tokens: int, max_tokens: int | None, context_tokens: int, slot_tokens: int
) -> int:
    """How many tokens a request may generate: its ``max_tokens``, or all the room its
    prompt leaves. A request that can never fit, whatever else runs, is refused at once
    (422) with the numbers."""
    limit = min(context_tokens, slot_tokens)
    if prompt_tokens < 1:
        raise InvalidInputError("the prompt must hold at least one token, got none")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be at least 1, got {max_tokens}")
    limits = (
        f"the {limit} tokens a sequence may hold (the model's context is {context_tokens} "
        f"tokens, a KV cache slot {slot_tokens})"
    )
    if max_tokens is None:
        if prompt_tokens >= limit:
            raise InvalidInputError(
                f"the prompt's {prompt_tokens} tokens leave no room to generate within "
                f"{limits}; shorten the prompt"
            )
        return limit - prompt_tokens
    if prompt_tokens + max_tokens > limit:
        raise InvalidInputError(
            f"the prompt's {prompt_tokens} tokens and max_tokens {max_tokens} make "
            f"{prompt_tokens + max_tokens}, over {limits}; shorten the prompt or lower "
            "max_tokens"
        )
    return max_tokens
