"""The admission policy of continuous batching: who joins a step and how much each prefills."""

from __future__ import annotations

import pytest

from service.engine.generation.admission import (
    PrefillPlan,
    StepLimits,
    new_tokens_allowed,
    plan_prefill,
    waiting_position,
)
from service.errors import InvalidInputError

LIMITS = StepLimits(max_running_sequences=4, prefill_chunk_tokens=100)


def test_short_prompts_join_together_within_the_chunk() -> None:
    plan = plan_prefill([], [10, 20, 30], running=0, free_slots=4, limits=LIMITS)
    assert plan == PrefillPlan(prefilling=(), joining=(10, 20, 30))


def test_a_long_prompt_is_cut_into_chunks_and_the_next_waits_for_budget() -> None:
    assert plan_prefill([], [250, 5], 0, 4, LIMITS) == PrefillPlan((), (100,))
    assert plan_prefill([150], [5], 1, 3, LIMITS) == PrefillPlan((100,), ())
    assert plan_prefill([50], [5, 70], 1, 3, LIMITS) == PrefillPlan((50,), (5, 45))


def test_sequences_already_prefilling_come_first_in_the_order_they_joined() -> None:
    plan = plan_prefill([80, 60], [5], running=2, free_slots=2, limits=LIMITS)
    assert plan == PrefillPlan(prefilling=(80, 20), joining=())


def test_no_one_joins_beyond_max_running_sequences_or_the_free_slots() -> None:
    assert plan_prefill([], [1] * 6, running=3, free_slots=5, limits=LIMITS).joining == (1,)
    assert plan_prefill([], [1] * 6, running=0, free_slots=2, limits=LIMITS).joining == (1, 1)
    assert plan_prefill([], [1] * 6, running=4, free_slots=0, limits=LIMITS).joining == ()


def test_decoding_alone_costs_no_prefill_budget() -> None:
    assert plan_prefill([], [], running=4, free_slots=0, limits=LIMITS) == PrefillPlan((), ())


def test_a_waiting_request_goes_behind_its_priority_and_higher_ones() -> None:
    assert waiting_position([], "normal") == 0
    assert waiting_position([], "high") == 0
    assert waiting_position(["normal", "normal"], "normal") == 2
    assert waiting_position(["normal", "normal"], "high") == 0
    assert waiting_position(["high", "normal", "normal"], "high") == 1
    assert waiting_position(["high", "high", "normal"], "normal") == 3
    assert waiting_position(["high", "high"], "normal") == 2


@pytest.mark.parametrize("field", ["max_running_sequences", "prefill_chunk_tokens"])
def test_limits_below_one_are_refused(field: str) -> None:
    settings = {"max_running_sequences": 4, "prefill_chunk_tokens": 64, field: 0}
    with pytest.raises(ValueError, match=f"{field} must be at least 1, got 0"):
        StepLimits(**settings)


def test_new_tokens_default_to_the_room_the_prompt_leaves() -> None:
    assert new_tokens_allowed(100, None, context_tokens=1024, slot_tokens=512) == 412
    assert new_tokens_allowed(100, 50, context_tokens=1024, slot_tokens=512) == 50
    assert new_tokens_allowed(100, 412, context_tokens=1024, slot_tokens=512) == 412


def test_requests_that_can_never_fit_are_refused_with_their_numbers() -> None:
    with pytest.raises(InvalidInputError) as refused:
        new_tokens_allowed(400, 200, context_tokens=512, slot_tokens=1024)
    assert refused.value.status_code == 422
    assert refused.value.message == (
        "the prompt's 400 tokens and max_tokens 200 make 600, over the 512 tokens a sequence "
        "may hold (the model's context is 512 tokens, a KV cache slot 1024); shorten the "
        "prompt or lower max_tokens"
    )
    with pytest.raises(InvalidInputError, match="512 tokens leave no room to generate"):
        new_tokens_allowed(512, None, context_tokens=1024, slot_tokens=512)
    with pytest.raises(InvalidInputError, match="max_tokens must be at least 1, got 0"):
        new_tokens_allowed(10, 0, context_tokens=1024, slot_tokens=512)
    with pytest.raises(InvalidInputError, match="at least one token, got none"):
        new_tokens_allowed(0, 5, context_tokens=1024, slot_tokens=512)
