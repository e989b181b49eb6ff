"""Encoder-decoder models in cohorts: each sequence's tokens are those ``generate`` gives its
prompt alone, whoever started with it or left it."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch

from service.engine.generation.cohorts import CohortBatch
from service.engine.generation.sampling import SamplingParams
from service.engine.generation.sequences import GenerationRequest
from service.errors import InvalidInputError, QueueFullError
from tests import generative_models
from tests.generative_models import VOCAB

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0)
MODELS: dict[str, Callable[[], Any]] = {"t5": generative_models.t5, "bart": generative_models.bart}


def new_batch(model: Any, **settings: Any) -> CohortBatch:
    defaults: dict[str, Any] = {
        "max_running_sequences": 8,
        "max_waiting_sequences": 16,
        "eos_token_ids": [model.generation_config.eos_token_id],
        "context_tokens": 128,
    }
    return CohortBatch(model, **(defaults | settings))


def generated_alone(model: Any, request: GenerationRequest) -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([request.prompt_ids]), do_sample=False, max_new_tokens=request.max_tokens
        )
    tokens: list[int] = output[0, 1:].tolist()  # after the decoder's start token
    return tokens


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_generate_alone_across_cohorts(name: str) -> None:
    model = MODELS[name]()
    chooser = random.Random(5)
    requests = [
        GenerationRequest(
            f"r{index}",
            tuple(chooser.randrange(3, VOCAB) for _ in range(chooser.choice((1, 4, 17, 60)))),
            max_tokens=chooser.choice((1, 6, 20)),
            sampling=GREEDY,
        )
        for index in range(12)
    ]
    leaving = GenerationRequest("leaving", (5, 6, 7, 8), max_tokens=20, sampling=GREEDY)
    arrivals = {0: [leaving, *requests[:5]], 2: requests[5:9], 3: requests[9:]}
    batch = new_batch(model, max_running_sequences=8, max_cohorts=2)
    tokens: dict[Hashable, list[int | None]] = {}
    reasons: dict[Hashable, str] = {}
    most_cohorts = 0
    for step in range(200):
        for request in arrivals.get(step, []):
            batch.submit(request)
        if step == 4:
            assert batch.cancel("leaving")
        for event in batch.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
            if event.finish_reason:
                reasons[event.request_id] = event.finish_reason
        most_cohorts = max(most_cohorts, batch.cohorts)
        if step > 3 and not (batch.running or batch.waiting):
            break

    assert most_cohorts == 2
    for request in requests:
        assert tokens[request.request_id] == generated_alone(model, request), request.request_id
        assert reasons[request.request_id] in ("stop", "length")
    assert len(tokens["leaving"]) == 4  # steps 0 to 3
    assert tokens["leaving"] == generated_alone(model, leaving)[:4]
    assert "leaving" not in reasons


def test_a_seeded_request_draws_the_same_tokens_in_any_cohort() -> None:
    model = generative_models.t5()
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    seeded = GenerationRequest("seeded", (9, 10, 11), max_tokens=12, sampling=sampling)

    def run(mates: int) -> list[int | None]:
        batch = new_batch(model)
        for index in range(mates):
            batch.submit(GenerationRequest(index, (3, 4) * (index + 1), max_tokens=12))
        batch.submit(seeded)
        drawn = []
        while batch.running or batch.waiting:
            drawn += [event.token_id for event in batch.step() if event.request_id == "seeded"]
        return drawn

    assert run(0) == run(5)


def test_cohorts_refuse_what_never_fits_and_what_overflows_the_line() -> None:
    batch = new_batch(generative_models.bart(), max_running_sequences=1, max_waiting_sequences=0)
    assert batch.context_tokens == 128  # BART's max_position_embeddings
    with pytest.raises(InvalidInputError, match="1 to 128 tokens, got 129"):
        batch.submit(GenerationRequest("long", tuple([5] * 129)))
    with pytest.raises(InvalidInputError, match="max_tokens 128 make 129, over"):
        batch.submit(GenerationRequest("many", (5,), max_tokens=128))
    batch.submit(GenerationRequest("first", (5,), max_tokens=3))
    with pytest.raises(QueueFullError):
        batch.submit(GenerationRequest("second", (5,), max_tokens=3))
    with pytest.raises(ValueError, match="pass context_tokens"):
        CohortBatch(generative_models.t5(), max_running_sequences=1, max_waiting_sequences=1)


def test_a_kv_budget_bounds_the_cohorts_sequences_and_refuses_beyond_with_429() -> None:
    model = generative_models.t5()
    # Per token: keys and values of 2 decoder layers' self- and cross-attention (4 heads of
    # 8 floats each) and the encoder's state of 32 floats.
    per_sequence = 128 * (2 * 2 * 2 * 4 * 8 * 4 + 32 * 4)
    batch = new_batch(model, max_waiting_sequences=0, kv_budget_bytes=3 * per_sequence - 1)
    assert batch.slots == 2
    for index in range(2):
        batch.submit(GenerationRequest(index, (5, 6), max_tokens=4, sampling=GREEDY))
    with pytest.raises(QueueFullError):
        batch.submit(GenerationRequest("third", (5, 6), max_tokens=4, sampling=GREEDY))
    batch.step()
    assert batch.running == 2
    with pytest.raises(ValueError, match=f"holds no sequence of 128 tokens \\({per_sequence} "):
        new_batch(model, kv_budget_bytes=per_sequence - 1)


def test_forced_first_and_last_tokens_equal_generate_with_barts_forcing() -> None:
    model = generative_models.bart()
    # What BART's checkpoints name: generate forces the first token and the last one within
    # max_new_tokens.
    model.generation_config.forced_bos_token_id = 0
    model.generation_config.forced_eos_token_id = 2
    batch = new_batch(model, forced_bos_token_id=0, forced_eos_token_ids=(2,))
    requests = [
        GenerationRequest(index, tuple(range(3, 3 + length)), max_tokens=most, sampling=GREEDY)
        for index, (length, most) in enumerate([(1, 1), (4, 2), (9, 7), (20, 12)])
    ]
    for request in requests:
        batch.submit(request)
    tokens: dict[Hashable, list[int | None]] = {}
    while batch.running or batch.waiting:
        for event in batch.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
    for request in requests:
        alone = generated_alone(model, request)
        assert tokens[request.request_id] == alone
        assert alone[-1] == 2
        assert len(alone) == 1 or alone[0] == 0


def test_prefill_starts_a_cohort_with_its_first_tokens_and_decode_steps_the_others() -> None:
    model = generative_models.t5()
    batch = new_batch(model)
    first = GenerationRequest("first", (5, 6, 7), max_tokens=6, sampling=GREEDY)
    second = GenerationRequest("second", (8, 9), max_tokens=6, sampling=GREEDY)
    tokens: dict[Hashable, list[int | None]] = {}

    def ids(events: list[Any]) -> list[Hashable]:
        for event in events:
            tokens.setdefault(event.request_id, []).append(event.token_id)
        return [event.request_id for event in events]

    assert not batch.prefill_due
    batch.submit(first)
    assert batch.prefill_due
    assert ids(batch.prefill()) == ["first"]
    assert ids(batch.decode()) == []  # its token of this iteration came from the prefill
    batch.submit(second)
    assert ids(batch.prefill()) == ["second"]
    assert ids(batch.decode()) == ["first"]
    assert not batch.prefill_due
    while batch.running:
        ids(batch.step())
    for request in (first, second):
        assert tokens[request.request_id] == generated_alone(model, request)
