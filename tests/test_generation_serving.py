"""Generation served by an engine (``EngineClient.generate``), in process and over the bridge:
every greedy stream equals ``generate(do_sample=False)`` on its prompt alone, whatever runs
beside it; a tensor model on the same engine answers right meanwhile; a switch never mixes
versions in a stream; seeds, log-probabilities, metrics, spans and the bridge's frames.
(Refusals and freed slots: ``test_generation_limits.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service import tracing
from service.bridge import contract, wire
from service.bridge.interface import (
    EngineClient,
    GeneratedTokens,
    GenerateRequest,
    InferenceRequest,
)
from service.engine.model_store import ModelStore
from service.errors import ServiceError
from service.tensors import NamedArrays
from tests import generative_models
from tests.fixtures import wait_until
from tests.generation_streams import (
    PROMPTLY_S,
    assert_greedy_parity,
    collect,
    generated_alone,
    mixed_prompts,
    over_the_bridge,
    package,
    request_for,
    started,
)
from tests.generative_models import save_folder
from tests.hf_folders import save_text_model

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 (``lm``) and a tiny BERT classifier (``bert``), packaged with --hf."""
    root = tmp_path_factory.mktemp("generation")
    package(save_folder(root / "lm", generative_models.gpt2()), root / "repo", "lm")
    package(save_text_model(root / "bert", "text-classification"), root / "repo", "bert")
    return root / "repo"


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same GPT-2 as ``lm``, in this process: what each stream must equal."""
    return generative_models.gpt2()


async def test_greedy_streams_equal_generate_alone_in_process(
    repository: Path, reference: Any
) -> None:
    async with started(repository) as engine:
        await assert_greedy_parity(engine, reference)


async def test_greedy_streams_equal_generate_alone_over_the_bridge(
    repository: Path, reference: Any
) -> None:
    async with started(repository) as engine, over_the_bridge(engine) as client:
        await assert_greedy_parity(client, reference)


async def test_a_tensor_model_answers_right_while_the_engine_generates(
    repository: Path, reference: Any
) -> None:
    async with started(repository, models=("lm", "bert")) as engine:
        bert = engine.status().find("bert")
        assert bert is not None
        ids = np.array([[2, 7, 9, 3]], dtype=np.int64)
        infer = InferenceRequest(
            model="bert",
            version=bert.manifest.version,
            instances=NamedArrays({"input_ids": ids, "attention_mask": np.ones_like(ids)}),
            priority="normal",
            deadline_s=time.monotonic() + PROMPTLY_S,
            request_id="bert",
        )
        alone = (await engine.infer(infer)).outputs["logits"]
        prompts = mixed_prompts(4, seed=5)
        streams = asyncio.gather(
            *(collect(engine, request_for(engine, p, max_tokens=m)) for p, m in prompts)
        )
        answers = [await engine.infer(infer) for _ in range(5)]
        for answer in answers:
            np.testing.assert_allclose(answer.outputs["logits"], alone, rtol=1e-5, atol=1e-6)
        for (prompt, most), items in zip(prompts, await streams, strict=True):
            tokens = [token for item in items for token in item.token_ids]
            assert tokens == generated_alone(reference, prompt, most)


async def test_a_tensor_model_refuses_generation_and_a_generative_one_serves_next_token_logits(
    repository: Path, reference: Any
) -> None:
    async with started(repository, models=("lm", "bert")) as engine:
        bert = engine.status().find("bert")
        assert bert is not None
        with pytest.raises(ServiceError, match="does not generate text"):
            await collect(
                engine,
                GenerateRequest(model="bert", version=bert.manifest.version, prompt_ids=(1,)),
            )
        lm = engine.status().find("lm")
        assert lm is not None
        ids = np.array([[5, 6, 7]], dtype=np.int64)
        answer = await engine.infer(
            InferenceRequest(
                model="lm",
                version=lm.manifest.version,
                instances=NamedArrays({"input_ids": ids, "attention_mask": np.ones_like(ids)}),
                priority="normal",
                deadline_s=time.monotonic() + PROMPTLY_S,
                request_id="lm",
            )
        )
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor(ids)).logits[0, -1].numpy()
        np.testing.assert_allclose(
            answer.outputs["next_token_logits"][0], want, rtol=1e-4, atol=1e-4
        )


async def test_a_stream_started_before_a_switch_ends_on_its_version(
    repository: Path, reference: Any, tmp_path: Path
) -> None:
    """A stream keeps the version it started on to its last token; the requests after the
    switch get the new version, each equal to its own model's generation."""
    switched = tmp_path / "repo"
    shutil.copytree(repository, switched)
    other = generative_models.gpt2(seed=1)
    folder = save_folder(tmp_path / "lm2", other)
    package(folder, switched)
    old_version = ModelStore(repository).resolve("lm").version
    new_version = ModelStore(switched).resolve("lm").version  # the latest
    async with started(switched, models=(f"lm@{old_version}",)) as engine:
        first = request_for(engine, (5, 6, 7), max_tokens=300, ignore_eos=True)
        assert first.version == old_version
        stream = engine.generate(first)
        items = [await anext(stream)]
        await engine.switch("lm", new_version)
        async with asyncio.timeout(PROMPTLY_S):
            items += [item async for item in stream]
        tokens = [token for item in items for token in item.token_ids]
        want = greedy_past_eos(reference, (5, 6, 7), 300)
        assert tokens == want
        assert {item.version for item in items} == {old_version}
        assert items[-1].finish_reason == "length"
        after = await collect(engine, request_for(engine, (5, 6, 7), max_tokens=20))
        assert {item.version for item in after} == {new_version}
        registry = engine.state.metrics.registry

        def slots(version: str) -> float | None:
            labels = {"model": "lm", "version": version, "kind": "total"}
            return registry.get_sample_value("batchserve_kv_cache_slots", labels)

        await wait_until(lambda: slots(old_version) is None, PROMPTLY_S)  # retired
        assert slots(new_version) == engine.generation_of("lm", new_version).batch.slots
        assert [t for item in after for t in item.token_ids] == generated_alone(
            other, (5, 6, 7), 20
        )


def greedy_past_eos(model: Any, prompt: tuple[int, ...], count: int) -> list[int]:
    """The model's ``count`` most likely next tokens, one at a time, going on past its
    end-of-sequence id (``ignore_eos``; ``generate``'s ``min_new_tokens`` would forbid it)."""
    tokens: list[int] = []
    with torch.inference_mode():
        output = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(count):
            token = output.logits[0, -1].argmax().view(1, 1)
            tokens.append(int(token))
            output = model(input_ids=token, cache=output.past_key_values, use_cache=True)
    return tokens


@pytest.mark.parametrize("bridged", [False, True], ids=["in process", "over the bridge"])
async def test_a_seeded_sampled_stream_is_the_same_alone_and_among_others_with_logprobs(
    repository: Path, bridged: bool
) -> None:
    async with started(repository) as engine, contextlib.AsyncExitStack() as stack:
        client: EngineClient = (
            await stack.enter_async_context(over_the_bridge(engine)) if bridged else engine
        )
        seeded = request_for(client, (5, 6, 7), max_tokens=12, ignore_eos=True)
        seeded = dataclasses.replace(seeded, temperature=0.9, top_p=0.9, seed=7, logprobs=2)
        alone = await collect(client, seeded)
        others = [
            collect(client, dataclasses.replace(seeded, seed=None, prompt_ids=prompt))
            for prompt, _ in mixed_prompts(6, seed=9)
        ]
        together, *_ = await asyncio.gather(collect(client, seeded), *others)
        joined = GeneratedTokens.joined(alone)
        assert GeneratedTokens.joined(together).token_ids == joined.token_ids
        assert len(joined.token_ids) == 12
        assert joined.logprobs is not None
        assert len(joined.logprobs) == 12
        assert joined.top_logprobs is not None
        assert [len(top) for top in joined.top_logprobs] == [2] * 12
        assert all(value <= 0.0 for value in joined.logprobs)


async def test_the_engine_counts_tokens_streams_and_slots(repository: Path) -> None:
    async with started(repository, max_running_sequences=4) as engine:
        prompts = mixed_prompts(6, seed=11)
        streams = await asyncio.gather(
            *(collect(engine, request_for(engine, p, max_tokens=m)) for p, m in prompts)
        )
        registry = engine.state.metrics.registry
        tokens = sum(len(item.token_ids) for items in streams for item in items)

        version = request_for(engine, (1,)).version

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"model": "lm", **labels})

        def gauge(name: str, **labels: str) -> float | None:
            return sample(name, version=version, **labels)

        assert sample("batchserve_generated_tokens_total") == tokens
        assert sample("batchserve_time_to_first_token_seconds_count") == len(prompts)
        assert sample("batchserve_inter_token_latency_seconds_count") == tokens - len(prompts)
        assert gauge("batchserve_kv_cache_slots", kind="total") == 4
        assert gauge("batchserve_kv_cache_slots", kind="used") == 0
        assert gauge("batchserve_running_sequences") == 0
        assert gauge("batchserve_waiting_sequences") == 0


async def test_a_traced_stream_has_a_generate_span_with_its_token_counts(
    repository: Path,
) -> None:
    exporter = InMemorySpanExporter()
    tracing.start([SimpleSpanProcessor(exporter)], role="engine")
    try:
        async with started(repository) as engine:
            parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
            request = request_for(engine, (5, 6, 7), max_tokens=4, ignore_eos=True)
            await collect(engine, dataclasses.replace(request, traceparent=parent))
            unsampled = parent[:-2] + "00"
            await collect(engine, dataclasses.replace(request, traceparent=unsampled))
    finally:
        tracing.stop()
    [span] = [span for span in exporter.get_finished_spans() if span.name == "generate"]
    assert span.parent is not None
    assert span.parent.span_id == int("cd" * 8, 16)
    assert span.context.trace_id == int("ab" * 16, 16)
    assert span.attributes is not None
    assert span.attributes["batchserve.generation.prompt_tokens"] == 3
    assert span.attributes["batchserve.generation.completion_tokens"] == 4
    assert span.attributes["batchserve.generation.finish_reason"] == "length"
    assert [event.name for event in span.events] == ["first_token"]


async def test_one_tokens_frame_carries_a_steps_tokens_for_every_stream_of_a_front_end(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight streams of ten tokens join at one step and decode together: their 80 tokens
    cross the bridge in about ten TOKENS frames (one per step), not 80."""
    frames: list[int] = []
    send_now = wire.FrameWriter.send_now

    def counting(self: wire.FrameWriter, kind: wire.Kind, header: bytes, data: Any = ()) -> None:
        if kind == wire.Kind.TOKENS:
            frames.append(len(contract.decode_tokens(header).streams))
        send_now(self, kind, header, data)

    monkeypatch.setattr(wire.FrameWriter, "send_now", counting)
    async with started(repository) as engine, over_the_bridge(engine) as client:
        requests = [
            request_for(client, (5, index + 1), max_tokens=10, ignore_eos=True)
            for index in range(8)
        ]
        streams = await asyncio.gather(*(collect(client, request) for request in requests))
    assert sum(len(item.token_ids) for items in streams for item in items) == 80
    assert sum(frames) == 80  # each stream's token of each step, once
    assert len(frames) <= 12  # ten steps, and a joining step or two for the slow


async def test_a_llama_shaped_model_generates_as_it_does_alone(tmp_path: Path) -> None:
    """Grouped-query attention (4 heads, 2 of keys and values) and rotary positions, through
    packaging, the engine's KV cache and its steps."""
    model = generative_models.llama()
    folder = save_folder(tmp_path / "llama", model)
    repository = tmp_path / "repository"
    package(folder, repository)
    async with started(repository) as engine:
        prompts = mixed_prompts(6, seed=13)
        streams = await asyncio.gather(
            *(collect(engine, request_for(engine, p, max_tokens=m)) for p, m in prompts)
        )
    for (prompt, most), items in zip(prompts, streams, strict=True):
        assert [t for item in items for t in item.token_ids] == generated_alone(model, prompt, most)
