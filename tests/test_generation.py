"""Continuous batching of tiny causal LMs: each sequence's tokens are those it gets alone,
whoever joins, leaves or is cancelled around it."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from service.config import Precision
from service.engine.generation.admission import StepLimits
from service.engine.generation.continuous_batch import ContinuousBatch
from service.engine.generation.kv_cache import probe_kv_layout
from service.engine.generation.sampling import SamplingParams
from service.engine.generation.sequences import GenerationRequest
from service.errors import InvalidInputError, QueueFullError
from tests import generative_models
from tests.generative_models import CONTEXT, EOS, VOCAB

pytestmark = pytest.mark.usefixtures("one_torch_thread")


GREEDY = SamplingParams(temperature=0.0)
PROMPT_LENGTHS = (1, 2, 7, 16, 33, 64, 130, 300)
MAX_TOKENS = (1, 3, 8, 17, 32, 48)


@dataclass
class Run:
    """What a driven batch gave: each request's tokens and finish reason, and the most
    sequences that ran at once."""

    tokens: dict[Hashable, list[int | None]] = field(default_factory=lambda: defaultdict(list))
    reasons: dict[Hashable, str] = field(default_factory=dict)
    most_running: int = 0
    most_waiting: int = 0


def drive(
    batch: ContinuousBatch,
    arrivals: Mapping[int, Sequence[GenerationRequest]],
    cancels: Mapping[int, Sequence[Hashable]] | None = None,
    *,
    max_steps: int = 2000,
) -> Run:
    """Step ``batch`` until it is idle, submitting ``arrivals[step]`` and cancelling
    ``cancels[step]`` before each step."""
    run = Run()
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        if step > last_arrival and not (batch.running or batch.waiting):
            return run
        for request in arrivals.get(step, ()):
            batch.submit(request)
        for request_id in (cancels or {}).get(step, ()):
            assert batch.cancel(request_id)
        for event in batch.step():
            run.tokens[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                run.reasons[event.request_id] = event.finish_reason
        run.most_running = max(run.most_running, batch.running)
        run.most_waiting = max(run.most_waiting, batch.waiting)
    raise AssertionError(f"the batch was not idle after {max_steps} steps")


def new_batch(
    model: Any,
    *,
    max_running: int = 16,
    chunk: int = 64,
    max_waiting: int = 64,
    eos: Sequence[int] = (EOS,),
    precision: Precision = "fp32",
    tokens_per_slot: int | None = None,
) -> ContinuousBatch:
    return ContinuousBatch(
        model,
        kv_budget_bytes=1 << 28,
        limits=StepLimits(max_running_sequences=max_running, prefill_chunk_tokens=chunk),
        max_waiting_sequences=max_waiting,
        eos_token_ids=eos,
        precision=precision,
        tokens_per_slot=tokens_per_slot,
    )


def generated_alone(model: Any, request: GenerationRequest) -> list[int]:
    """``transformers``' own greedy generation of the request's prompt alone."""
    prompt = torch.tensor([request.prompt_ids])
    with torch.inference_mode():
        output = model.generate(
            prompt,
            do_sample=False,
            max_new_tokens=request.max_tokens,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    tokens: list[int] = output[0, prompt.shape[1] :].tolist()
    return tokens


def mixed_requests(
    count: int, seed: int, sampling: SamplingParams = GREEDY, *, long_first: int = 0
) -> list[GenerationRequest]:
    """Prompts of 1 to 300 tokens; the first ``long_first`` generate 48 tokens (unless they
    meet the end-of-sequence id), the others 1 to 48."""
    chooser = random.Random(seed)
    return [
        GenerationRequest(
            request_id=f"r{index}",
            prompt_ids=tuple(
                chooser.randrange(1, VOCAB)
                for _ in range(PROMPT_LENGTHS[index % len(PROMPT_LENGTHS)])
            ),
            max_tokens=48 if index < long_first else chooser.choice(MAX_TOKENS),
            sampling=sampling,
        )
        for index in range(count)
    ]


def staggered(requests: Sequence[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
    """Eight join at once, the rest two by two at the following steps."""
    arrivals: dict[int, list[GenerationRequest]] = {0: list(requests[:8])}
    for index, request in enumerate(requests[8:]):
        arrivals.setdefault(1 + index // 2, []).append(request)
    return arrivals


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2": generative_models.gpt2,
    "llama": generative_models.llama,
    "qwen2": generative_models.qwen2,
}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_generate_alone_whatever_joins_and_leaves(name: str) -> None:
    model = MODELS[name]()
    requests = mixed_requests(26, seed=1, long_first=16)
    decoding = GenerationRequest("decoding", tuple(range(1, 41)), max_tokens=40, sampling=GREEDY)
    prefilling = GenerationRequest("prefilling", tuple([9] * 300), max_tokens=5, sampling=GREEDY)
    waiting = GenerationRequest("waiting", (5, 6, 7), max_tokens=4, sampling=GREEDY)
    arrivals = staggered(requests)
    arrivals[0] = [decoding, *arrivals[0], waiting]
    arrivals[2].append(prefilling)
    cancels: dict[int, list[Hashable]] = {0: ["waiting"], 4: ["prefilling"], 6: ["decoding"]}

    run = drive(new_batch(model, max_running=16, chunk=128), arrivals, cancels)

    assert run.most_running == 16
    assert run.most_waiting > 0
    for request in requests:
        assert run.tokens[request.request_id] == generated_alone(model, request)
        assert run.reasons[request.request_id] in ("stop", "length")
    partial = run.tokens["decoding"]
    assert 0 < len(partial) < 40
    assert partial == generated_alone(model, decoding)[: len(partial)]
    assert "prefilling" not in run.tokens
    assert "waiting" not in run.tokens
    assert not {"decoding", "prefilling", "waiting"} & run.reasons.keys()


def test_bf16_holds_the_weights_and_cache_in_bf16_and_mostly_equals_its_alone_run() -> None:
    """In bf16 the weights are cast once and the cache holds bf16 keys and values. A
    sequence's attention over its slot read to the batch's longest length (the tail masked)
    rounds otherwise than over its own length alone, so a near tie can go the other way in a
    batch. Asserted: runs repeat exactly, at least three quarters agree with the alone-run."""
    for build in (generative_models.gpt2, generative_models.llama):
        model = build()
        requests = mixed_requests(16, seed=2)
        batch = new_batch(model, precision="bf16")
        assert batch.kv_cache_bytes > 0
        assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
        assert probe_kv_layout(model).dtype == torch.bfloat16
        together = drive(batch, staggered(requests))
        assert drive(new_batch(model, precision="bf16"), staggered(requests)) == together
        alone = {
            request.request_id: drive(new_batch(model, precision="bf16"), {0: [request]})
            for request in requests
        }
        same = sum(
            alone[request.request_id].tokens[request.request_id]
            == together.tokens[request.request_id]
            for request in requests
        )
        assert same >= 12, f"{same} of 16 equal their alone-run"


def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch_mates() -> None:
    model = generative_models.gpt2()
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    seeded = GenerationRequest("seeded", tuple(range(5, 40)), max_tokens=24, sampling=sampling)
    alone = drive(new_batch(model), {0: [seeded]}).tokens["seeded"]

    mates = mixed_requests(12, seed=3, sampling=SamplingParams(temperature=1.0))
    arrivals = staggered(mates)
    arrivals.setdefault(6, []).append(seeded)
    crowded = drive(new_batch(model, max_running=8, chunk=32), arrivals)

    assert crowded.tokens["seeded"] == alone
    reseeded = GenerationRequest(
        "other seed",
        seeded.prompt_ids,
        max_tokens=24,
        sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=4321),
    )
    assert drive(new_batch(model), {0: [reseeded]}).tokens["other seed"] != alone


def test_sequences_stop_at_eos_stop_ids_max_tokens_and_the_context() -> None:
    model = generative_models.gpt2()
    prompt = tuple(range(10, 30))
    free = generated_alone(model, GenerationRequest("free", prompt, max_tokens=12, sampling=GREEDY))
    assert EOS not in free
    third = free[2]
    first_third = free.index(third)

    def one(request: GenerationRequest, eos: Sequence[int] = (EOS,)) -> tuple[list[Any], str]:
        run = drive(new_batch(model, eos=eos), {0: [request]})
        return run.tokens[request.request_id], run.reasons[request.request_id]

    def greedy(**settings: Any) -> GenerationRequest:
        return GenerationRequest("r", prompt, sampling=GREEDY, **settings)

    assert one(greedy(max_tokens=12), eos=[third]) == (free[: first_third + 1], "stop")
    assert one(greedy(max_tokens=12, stop_token_ids=(third,))) == (
        free[: first_third + 1],
        "stop",
    )
    assert one(greedy(max_tokens=12, ignore_eos=True), eos=[third]) == (free, "length")
    assert one(greedy(max_tokens=5)) == (free[:5], "length")

    near_the_end = GenerationRequest("end", tuple([7] * (CONTEXT - 3)), sampling=GREEDY)
    tokens, reason = one(near_the_end)
    assert (len(tokens), reason) == (3, "length")


def test_a_slot_shorter_than_the_context_bounds_a_sequence() -> None:
    batch = new_batch(generative_models.gpt2(), tokens_per_slot=40)
    assert batch.tokens_per_slot == 40
    run = drive(batch, {0: [GenerationRequest("r", tuple(range(1, 31)), sampling=GREEDY)]})
    assert (len(run.tokens["r"]), run.reasons["r"]) == (10, "length")


def test_requests_that_can_never_fit_are_refused_with_the_numbers() -> None:
    batch = new_batch(generative_models.gpt2())
    with pytest.raises(InvalidInputError, match=r"500 tokens and max_tokens 20 make 520, over"):
        batch.submit(GenerationRequest("long", tuple([3] * 500), max_tokens=20))
    with pytest.raises(InvalidInputError, match=rf"{CONTEXT} tokens leave no room"):
        batch.submit(GenerationRequest("full", tuple([3] * CONTEXT)))
    with pytest.raises(InvalidInputError, match="at least one token"):
        batch.submit(GenerationRequest("empty", ()))
    with pytest.raises(InvalidInputError, match=rf"in \[0, {VOCAB}\), got \[{VOCAB}\]"):
        batch.submit(GenerationRequest("unknown", (1, VOCAB, 2)))
    assert (batch.waiting, batch.running) == (0, 0)


def test_a_full_cache_and_waiting_line_refuse_with_429_and_retry_after() -> None:
    batch = new_batch(generative_models.gpt2(), max_running=2, max_waiting=1)
    for index in range(3):  # two slots free, one more may wait
        batch.submit(GenerationRequest(index, (1, 2, 3), max_tokens=5))
    with pytest.raises(QueueFullError) as refused:
        batch.submit(GenerationRequest(3, (1, 2, 3), max_tokens=5))
    assert refused.value.status_code == 429
    assert refused.value.headers["Retry-After"] == "1"
    assert refused.value.message == (
        "the KV cache's 2 slots are taken (0 sequences generate) and 3 wait, the most "
        "allowed (max_waiting_sequences=1); retry later"
    )
    batch.step()
    assert (batch.running, batch.waiting) == (2, 1)
    with pytest.raises(QueueFullError):
        batch.submit(GenerationRequest(3, (1, 2, 3), max_tokens=5))
    assert batch.cancel(2)
    batch.submit(GenerationRequest(3, (1, 2, 3), max_tokens=5))

    no_waiting = new_batch(generative_models.gpt2(), max_running=1, max_waiting=0)
    no_waiting.submit(GenerationRequest(0, (1, 2, 3), max_tokens=5))
    with pytest.raises(QueueFullError):
        no_waiting.submit(GenerationRequest(1, (1, 2, 3), max_tokens=5))


def test_waiting_requests_join_high_priority_first_and_in_arrival_order_within() -> None:
    """One slot: the requests waiting behind the running one join as each one before them
    finishes, high before normal, first come first within a priority."""
    batch = new_batch(generative_models.gpt2(), max_running=1)
    batch.submit(GenerationRequest("running", (4, 5), max_tokens=4, ignore_eos=True))
    batch.step()
    for request_id, priority in [("n1", "normal"), ("h1", "high"), ("n2", "normal")]:
        batch.submit(
            GenerationRequest(request_id, (4, 5), max_tokens=2, priority=priority, ignore_eos=True)
        )
    batch.submit(GenerationRequest("h2", (4, 5), max_tokens=2, priority="high", ignore_eos=True))
    first_tokens: list[Hashable] = []
    for _ in range(16):
        for event in batch.step():
            if event.request_id not in first_tokens:
                first_tokens.append(event.request_id)
    assert first_tokens == ["running", "h1", "h2", "n1", "n2"]


def test_a_new_requests_first_token_comes_from_its_prompt_alone_before_the_others_decode() -> None:
    """The time to first token beside running streams: the prefill half runs the new prompt
    alone and hands out its first token; the decode half then steps everyone, the new
    sequence with them."""
    model = generative_models.gpt2()
    shapes: list[tuple[int, ...]] = []

    def record(module: Any, args: Any, kwargs: Any) -> None:
        shapes.append(tuple(kwargs["input_ids"].shape))

    model.register_forward_pre_hook(record, with_kwargs=True)
    batch = new_batch(model)
    for index in range(4):
        batch.submit(GenerationRequest(index, (4, 5, 6), max_tokens=20, sampling=GREEDY))
    batch.step()
    shapes.clear()
    new = GenerationRequest("new", (7, 8, 9, 10, 11), max_tokens=3, sampling=GREEDY)
    batch.submit(new)

    first = batch.prefill()
    assert [event.request_id for event in first] == ["new"]
    assert shapes == [(1, 5)]
    second = batch.decode()
    assert [event.request_id for event in second] == [0, 1, 2, 3, "new"]
    assert shapes == [(1, 5), (5, 1)]
    tokens = [event.token_id for event in [*first, *second] if event.request_id == "new"]
    tokens += drive(batch, {}).tokens["new"]
    assert tokens == generated_alone(model, new)


def test_a_cancelled_sequence_frees_its_slot_for_the_next_step() -> None:
    model = generative_models.gpt2()
    batch = new_batch(model, max_running=2)
    requests = [
        GenerationRequest(index, (4, 5, 6), max_tokens=30, ignore_eos=True) for index in range(3)
    ]
    for request in requests:
        batch.submit(request)
    batch.step()
    assert (batch.running, batch.waiting, batch.free_slots) == (2, 1, 0)

    assert batch.cancel(0)
    assert (batch.running, batch.free_slots) == (1, 1)
    assert not batch.cancel(0)
    assert not batch.cancel("never submitted")
    events = batch.step()
    assert {event.request_id for event in events} == {1, 2}
    assert batch.running == 2


def test_a_sequence_with_non_finite_logits_fails_alone_and_its_slot_is_clean_after() -> None:
    model = generative_models.gpt2()
    poison = 299
    model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: output.masked_fill(
            (inputs[0] == poison).unsqueeze(-1), float("nan")
        )
    )
    healthy = mixed_requests(3, seed=4)
    poisoned = GenerationRequest("poisoned", (5, poison, 6, 7), max_tokens=10, sampling=GREEDY)
    after = GenerationRequest("after", (8, 9), max_tokens=10, sampling=GREEDY)
    batch = new_batch(model, max_running=4)

    run = drive(batch, {0: [*healthy, poisoned], 6: [after]})

    assert run.tokens["poisoned"] == [None]
    assert run.reasons["poisoned"] == "error"
    for request in [*healthy, after]:
        assert run.tokens[request.request_id] == generated_alone(model, request)


def test_a_step_whose_forward_fails_leaves_every_sequence_to_step_again() -> None:
    model = generative_models.gpt2()
    calls = 0

    def fail_step_2_prefill(module: Any, args: Any, kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        # The probe, step 0 (prefill, decode), step 1 (decode), step 2 (this prefill).
        if calls == 5:
            raise RuntimeError("the device failed")

    model.register_forward_pre_hook(fail_step_2_prefill, with_kwargs=True)
    first, second, late = (
        GenerationRequest(name, prompt, max_tokens=8, sampling=GREEDY)
        for name, prompt in [("first", (3, 4, 5)), ("second", (6, 7)), ("late", (8, 9, 10))]
    )
    batch = new_batch(model)
    batch.submit(first)
    batch.submit(second)
    tokens: dict[Hashable, list[int | None]] = defaultdict(list)
    for _ in range(2):
        for event in batch.step():
            tokens[event.request_id].append(event.token_id)
    batch.submit(late)
    with pytest.raises(RuntimeError, match="the device failed"):
        batch.step()

    rest = drive(batch, {})
    for request in (first, second, late):
        got = tokens[request.request_id] + rest.tokens[request.request_id]
        assert got == generated_alone(model, request)


def test_logprobs_are_the_model_distribution_of_the_chosen_tokens() -> None:
    model = generative_models.gpt2()
    prompt = (11, 12, 13, 14)
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    batch = new_batch(model)
    batch.submit(GenerationRequest("r", prompt, max_tokens=1, sampling=sampling))
    (event,) = batch.step()

    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = expected.topk(3)
    assert event.token_id == int(top.indices[0])
    assert event.logprob == pytest.approx(float(top.values[0]), abs=1e-5)
    assert event.top_logprobs is not None
    assert [token for token, _ in event.top_logprobs] == top.indices.tolist()
    assert [value for _, value in event.top_logprobs] == pytest.approx(
        top.values.tolist(), abs=1e-5
    )


def test_a_budget_that_holds_no_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match=r"holds no sequence of 512 tokens \(\d+ bytes each\)"):
        ContinuousBatch(
            generative_models.gpt2(),
            kv_budget_bytes=1024,
            limits=StepLimits(4, 64),
            max_waiting_sequences=4,
        )
