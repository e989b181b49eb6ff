"""Generation penalties, token by token: ``repetition_penalty`` equals ``transformers``'
``generate(do_sample=False, repetition_penalty=r)`` on the prompt alone, ``frequency_penalty``
and ``presence_penalty`` equal a greedy loop written here that applies OpenAI's formula to the
model's logits, for causal LMs (GPT-2) and encoder-decoders (T5), with penalised and plain
rows in one batch; rows without penalties pay nothing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch

from service.bridge.interface import GenerateRequest
from service.engine.generation.admission import StepLimits
from service.engine.generation.cohorts import CohortBatch
from service.engine.generation.continuous_batch import ContinuousBatch
from service.engine.generation.sampling import SamplingParams
from service.engine.generation.sequences import GenerationRequest, TokenEvent
from service.errors import InvalidInputError, InvalidParameterError
from service.frontend.generation.sampling import SamplingSettings
from tests import generative_models
from tests.generation_streams import collect, over_the_bridge, package, started
from tests.generative_models import EOS, VOCAB, save_folder

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

T5_EOS = 1  # generative_models.t5's end-of-sequence id; its decoder starts from 0
#: Each request's penalties, cycled over the prompts: penalised and plain rows side by side.
PENALTIES: list[dict[str, float]] = [
    {"repetition_penalty": 1.8},
    {},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 0.6},
    {},
    {"frequency_penalty": -1.0, "presence_penalty": 0.7},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.8},
]
PROMPT_LENGTHS = (3, 1, 17, 40, 9, 64, 5, 100, 2, 30)
MAX_TOKENS = (24, 12, 30, 20, 16, 8, 28, 18, 22, 10)


def prompts(seed: int, count: int = 10) -> list[tuple[tuple[int, ...], int]]:
    """Prompts that repeat a few tokens, so that penalties change what greedy picks."""
    chooser = random.Random(seed)
    return [
        (
            tuple(chooser.randrange(3, 40) for _ in range(PROMPT_LENGTHS[index % 10])),
            MAX_TOKENS[index % 10],
        )
        for index in range(count)
    ]


def reference(
    model: Any, prompt: tuple[int, ...], max_tokens: int, penalties: dict[str, float]
) -> list[int]:
    """One sequence alone, greedy: ``generate`` when only ``repetition_penalty`` is set (or
    none), else a loop over the model's logits applying each penalty's formula."""
    encoder_decoder = model.config.is_encoder_decoder
    eos = T5_EOS if encoder_decoder else EOS
    if set(penalties) <= {"repetition_penalty"}:
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=max_tokens,
                repetition_penalty=penalties.get("repetition_penalty", 1.0),
                eos_token_id=eos,
                pad_token_id=0,
            )
        start = 1 if encoder_decoder else len(prompt)
        tokens: list[int] = output[0, start:].tolist()
        return tokens
    repetition = penalties.get("repetition_penalty", 1.0)
    frequency = penalties.get("frequency_penalty", 0.0)
    presence = penalties.get("presence_penalty", 0.0)
    decoder_start = model.config.decoder_start_token_id if encoder_decoder else None
    generated: list[int] = []
    while len(generated) < max_tokens:
        with torch.inference_mode():
            if encoder_decoder:
                seen = [decoder_start, *generated]
                logits = model(
                    input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([seen])
                ).logits[0, -1]
            else:
                seen = [*prompt, *generated]
                logits = model(torch.tensor([seen])).logits[0, -1]
        logits = logits.float().clone()
        for token in set(seen):  # transformers' repetition penalty
            value = logits[token]
            logits[token] = value * repetition if value < 0 else value / repetition
        for token in set(generated):  # OpenAI's formula
            logits[token] -= frequency * generated.count(token) + presence
        generated.append(int(logits.argmax()))
        if generated[-1] == eos:
            break
    return generated


def plain_alone(model: Any, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(model, prompt, max_tokens, {})


def drive(batch: ContinuousBatch | CohortBatch, requests: list[GenerationRequest]) -> Any:
    """Half the requests join at once, the rest one a step; each one's tokens once idle."""
    tokens: dict[Hashable, list[int | None]] = {request.request_id: [] for request in requests}
    waiting = list(requests)
    for request in waiting[: len(waiting) // 2]:
        batch.submit(request)
    waiting = waiting[len(waiting) // 2 :]
    for _ in range(1000):
        if waiting:
            batch.submit(waiting.pop(0))
        events: list[TokenEvent] = batch.step()
        for event in events:
            tokens[event.request_id].append(event.token_id)
        if not (waiting or batch.running or batch.waiting):
            return tokens
    raise AssertionError("the batch was not idle after 1000 steps")


def penalised_requests(seed: int) -> list[tuple[GenerationRequest, dict[str, float]]]:
    return [
        (
            GenerationRequest(
                f"r{index}",
                prompt,
                max_tokens=most,
                sampling=SamplingParams(temperature=0.0, **PENALTIES[index % len(PENALTIES)]),
            ),
            PENALTIES[index % len(PENALTIES)],
        )
        for index, (prompt, most) in enumerate(prompts(seed, count=12))
    ]


def assert_each_equals_its_reference(
    model: Any, got: dict[Hashable, list[int | None]], requests: Any
) -> None:
    changed = 0
    for request, penalties in requests:
        prompt, most = request.prompt_ids, request.max_tokens
        expected = reference(model, prompt, most, penalties)
        assert got[request.request_id] == expected, (request.request_id, penalties)
        changed += bool(penalties) and expected != plain_alone(model, prompt, most)
    assert changed >= 4  # the penalties changed what greedy generation gives


def test_penalised_and_plain_rows_of_one_continuous_batch_equal_their_references() -> None:
    model = generative_models.gpt2()
    batch = ContinuousBatch(
        model,
        kv_budget_bytes=1 << 26,
        limits=StepLimits(max_running_sequences=12, prefill_chunk_tokens=64),
        max_waiting_sequences=12,
        eos_token_ids=(EOS,),
    )
    requests = penalised_requests(seed=1)
    got = drive(batch, [request for request, _ in requests])
    assert_each_equals_its_reference(model, got, requests)


def test_penalised_and_plain_rows_of_encoder_decoder_cohorts_equal_their_references() -> None:
    model = generative_models.t5()
    batch = CohortBatch(
        model,
        max_running_sequences=12,
        max_waiting_sequences=12,
        eos_token_ids=(T5_EOS,),
        context_tokens=generative_models.CONTEXT,
    )
    requests = penalised_requests(seed=2)
    got = drive(batch, [request for request, _ in requests])
    assert_each_equals_its_reference(model, got, requests)


def test_a_batch_without_penalties_is_not_copied_or_touched() -> None:
    from service.engine.generation.sampling import penalised

    logits = torch.randn(3, VOCAB)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)] * 2
    assert penalised(logits, plain[:3], []) is logits
    penalties = [*plain[:2], SamplingParams(temperature=0.0, presence_penalty=1.0)]

    class History:
        context_ids = (1, 2)
        generated = (7, 7, 9)

    scores = penalised(logits, penalties, [History()] * 3)
    assert torch.equal(scores[:2], logits[:2])
    assert torch.equal(scores[2, [7, 9]], logits[2, [7, 9]] - 1.0)
    assert torch.equal(scores[2, :7], logits[2, :7])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be between -2.0 and 2.0, got 2.5"),
        ({"presence_penalty": -2.01}, "presence_penalty must be between -2.0 and 2.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be above 0 (1 for none), got 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be above 0"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be between"),
    ],
)
def test_penalties_out_of_range_are_refused_naming_the_field(
    settings: dict[str, float], message: str
) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        SamplingSettings(**settings).check()
    assert refused.value.param == next(iter(settings))
    assert message in str(refused.value)
    with pytest.raises(InvalidInputError, match=next(iter(settings))):
        SamplingParams(**settings)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 (``lm``) and T5 (``t5``) of ``generative_models``, packaged."""
    root = tmp_path_factory.mktemp("penalties")
    package(save_folder(root / "lm", generative_models.gpt2()), root / "repo", "lm")
    package(save_folder(root / "t5", generative_models.t5()), root / "repo", "t5")
    return root / "repo"


async def test_concurrent_streams_mixing_penalised_and_plain_rows_in_process_and_bridged(
    repository: Path,
) -> None:
    references = {"lm": generative_models.gpt2(), "t5": generative_models.t5()}
    settings: dict[str, Any] = {"models": ("lm", "t5"), "max_running_sequences": 8}
    async with started(repository, **settings) as engine, over_the_bridge(engine) as bridged:
        jobs = []
        for seed, name in enumerate(references):
            model = engine.status().find(name)
            assert model is not None
            for index, (prompt, most) in enumerate(prompts(seed + 5, count=10)):
                penalties = PENALTIES[index % len(PENALTIES)]
                request = GenerateRequest(
                    model=name,
                    version=model.manifest.version,
                    prompt_ids=prompt,
                    max_tokens=most,
                    temperature=0.0,
                    **penalties,  # type: ignore[arg-type]
                )
                client = bridged if index % 2 else engine  # TOKENS frames, or in process
                jobs.append((name, prompt, most, penalties, collect(client, request)))
        streams = await asyncio.gather(*(job for *_, job in jobs))
    for (name, prompt, most, penalties, _), items in zip(jobs, streams, strict=True):
        tokens = [token for item in items for token in item.token_ids]
        assert tokens == reference(references[name], prompt, most, penalties), (name, penalties)
