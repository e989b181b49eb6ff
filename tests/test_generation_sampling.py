"""Choosing the next token: greedy, tempered, top-k, top-p, seeded, with log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from service.engine.generation.sampling import (
    SamplingParams,
    choose,
    new_generator,
)
from service.errors import InvalidInputError

CPU = torch.device("cpu")
LOGITS = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0], [5.0, 0.0, 0.0, 0.0, 4.9]])


def draws(params: SamplingParams, logits: torch.Tensor, count: int) -> list[int]:
    generator = new_generator(params, CPU)
    return [choose(logits, [params], [generator])[0].token_id for _ in range(count)]


def test_greedy_rows_take_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    choices = choose(LOGITS, [greedy, greedy], [None, None])
    assert [choice.token_id for choice in choices] == [1, 0]
    assert choices[0].logprob is None
    assert new_generator(greedy, CPU) is None
    assert SamplingParams(top_k=1).greedy


def test_top_k_and_top_p_keep_only_the_most_likely_tokens() -> None:
    row = LOGITS[:1]
    assert set(draws(SamplingParams(temperature=2.0, top_k=2, seed=1), row, 200)) == {1, 2}
    # Probabilities of tokens 1, 2, 3 at temperature 1: 0.64, 0.23, 0.09: top_p 0.8 keeps
    # the first two, whose mass reaches it.
    assert set(draws(SamplingParams(top_p=0.8, seed=2), row, 200)) == {1, 2}
    assert set(draws(SamplingParams(top_p=0.5, seed=3), row, 50)) == {1}
    assert len(set(draws(SamplingParams(temperature=2.0, seed=4), row, 400))) == 5


def test_draws_follow_the_tempered_distribution() -> None:
    row = torch.tensor([[0.0, math.log(3.0)]])
    tokens = draws(SamplingParams(temperature=1.0, seed=5), row, 4000)
    assert tokens.count(1) / len(tokens) == pytest.approx(0.75, abs=0.03)
    cooled = draws(SamplingParams(temperature=0.5, seed=6), row, 4000)
    assert cooled.count(1) / len(cooled) == pytest.approx(0.9, abs=0.02)


def test_a_seed_repeats_its_draws_whatever_the_other_rows() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = draws(seeded, LOGITS[:1], 30)

    generator = new_generator(seeded, CPU)
    with_mates = []
    for index in range(30):
        others = SamplingParams(temperature=1.5, top_k=3, seed=index)
        mates = [others, seeded, SamplingParams(temperature=0.0)]
        rows = torch.cat([LOGITS[1:], LOGITS[:1], LOGITS[1:]])
        gens = [new_generator(others, CPU), generator, None]
        with_mates.append(choose(rows, mates, gens)[1].token_id)
    assert with_mates == alone


def test_logprobs_are_the_models_own_before_temperature() -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    plain = SamplingParams(temperature=0.0)
    with_logprobs, without = choose(LOGITS, [params, plain], [None, None])
    expected = torch.log_softmax(LOGITS[0], dim=-1)
    assert with_logprobs.logprob == pytest.approx(float(expected[1]))
    assert with_logprobs.top_logprobs == (
        (1, pytest.approx(float(expected[1]))),
        (2, pytest.approx(float(expected[2]))),
    )
    assert (without.logprob, without.top_logprobs) == (None, None)

    hot = SamplingParams(temperature=2.0, seed=7, logprobs=True)
    choice = choose(LOGITS[:1], [hot], [new_generator(hot, CPU)])[0]
    assert choice.logprob == pytest.approx(float(expected[choice.token_id]))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -0.1}, "temperature must be between 0 and 2, got -0.1"),
        ({"temperature": math.nan}, "temperature must be between 0 and 2, got nan"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, "top_k must be 0 \\(off\\) or positive, got -1"),
        ({"seed": -1}, r"seed must be between 0 and 2\*\*63 - 1, got -1"),
        ({"top_logprobs": 21}, "top_logprobs must be between 0 and 20, got 21"),
    ],
)
def test_bad_settings_are_refused_with_the_value(settings: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as refused:
        SamplingParams(**settings)  # type: ignore[arg-type]
    assert refused.value.status_code == 422
