"""Generation served by an engine (``EngineClient.generate``), in process and over the bridge:
every greedy stream equals ``generate(do_sample=False)`` on its prompt alone, whatever runs
beside it; cancelling frees the slot; a full KV cache is 429 at once, a prompt that never
fits 422; a tensor model on the same engine answers right meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service import tracing
from service.bridge.client import BridgeClient
from service.bridge.interface import (
    EngineClient,
    GeneratedTokens,
    GenerateRequest,
    InferenceRequest,
)
from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine
from service.engine.lifecycle import kv_cache_budget
from service.engine.model_store import ModelStore
from service.errors import (
    DeadlineExceededError,
    InvalidInputError,
    NotReadyError,
    QueueFullError,
    ServiceError,
)
from service.metrics import EngineMetrics
from service.server.cli import main
from service.tensors import NamedArrays
from tests import generative_models
from tests.fixtures import wait_until
from tests.generation_streams import (
    PROMPTLY_S,
    assert_greedy_parity,
    collect,
    generated_alone,
    mixed_prompts,
    request_for,
)
from tests.generative_models import CONTEXT, VOCAB, save_folder
from tests.hf_folders import save_text_model

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 (``lm``) and a tiny BERT classifier (``bert``), packaged with --hf."""
    root = tmp_path_factory.mktemp("generation")
    lm = save_folder(root / "lm", generative_models.gpt2())
    bert = save_text_model(root / "bert", "text-classification")
    for name, folder in (("lm", lm), ("bert", bert)):
        assert (
            main(
                ["package", "--repository", str(root / "repo"), "--name", name, "--hf", str(folder)]
            )
            == 0
        )
    return root / "repo"


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same GPT-2 as ``lm``, in this process: what each stream must equal."""
    return generative_models.gpt2()


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def settings(repository: Path, **values: Any) -> Settings:
    defaults: dict[str, Any] = {
        "model_repository": repository,
        "models": ("lm",),
        "device": "cpu",
        "warmup_batch_sizes": (1,),
        "length_buckets": (64,),
        "max_batch_tokens": 1024,
        "max_wait_ms": 1.0,
        "torch_threads": 1,
    }
    return Settings(**(defaults | values))


@contextlib.asynccontextmanager
async def started(repository: Path, **values: Any) -> AsyncIterator[Engine]:
    engine = Engine(settings(repository, **values), EngineMetrics())
    await engine.start()
    assert engine.state.load_error is None, engine.state.load_error
    try:
        yield engine
    finally:
        await engine.shut_down()


@contextlib.asynccontextmanager
async def over_the_bridge(engine: Engine) -> AsyncIterator[BridgeClient]:
    """``engine`` behind a bridge socket, and a front end's client of it."""
    with tempfile.TemporaryDirectory(prefix="gen-") as folder:
        socket = Path(folder) / "engine.sock"
        server = BridgeServer(engine, socket, heartbeat_interval_s=0.2)
        engine.add_listener(server.status_changed)
        await server.start()
        client = BridgeClient([(socket, "cpu")], heartbeat_timeout_s=10.0, request_timeout_ms=5_000)
        await client.start()
        try:
            async with asyncio.timeout(PROMPTLY_S):
                await client.wait_until_settled()
            yield client
        finally:
            await client.close()
            await server.close()


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


@pytest.mark.parametrize("bridged", [False, True], ids=["in process", "over the bridge"])
async def test_closing_a_stream_frees_its_slot_for_the_next_request(
    repository: Path, bridged: bool
) -> None:
    """One slot, no waiting room: a second request is 429 with Retry-After while the first
    streams; once the first is closed, the next one gets the slot."""
    async with (
        started(repository, max_running_sequences=1, max_waiting_sequences=0) as engine,
        contextlib.AsyncExitStack() as stack,
    ):
        client: EngineClient = (
            await stack.enter_async_context(over_the_bridge(engine)) if bridged else engine
        )
        first = client.generate(request_for(client, (5, 6, 7), max_tokens=400, ignore_eos=True))
        async with asyncio.timeout(PROMPTLY_S):
            assert (await anext(first)).token_ids
        with pytest.raises(QueueFullError) as refused:
            await collect(client, request_for(client, (8, 9), max_tokens=2))
        assert refused.value.status_code == 429
        assert "Retry-After" in refused.value.headers
        await first.aclose()
        loop = engine.generation_of("lm", request_for(client, (1,)).version)

        await wait_until(lambda: not (loop.streams or loop.batch.running), PROMPTLY_S)
        items = await collect(client, request_for(client, (8, 9), max_tokens=2))
        assert [token for item in items for token in item.token_ids]


@pytest.mark.parametrize("bridged", [False, True], ids=["in process", "over the bridge"])
async def test_a_prompt_that_never_fits_is_422_before_any_token(
    repository: Path, bridged: bool
) -> None:
    async with started(repository) as engine, contextlib.AsyncExitStack() as stack:
        client: EngineClient = (
            await stack.enter_async_context(over_the_bridge(engine)) if bridged else engine
        )
        prompt = (1,) * (CONTEXT - 10)
        with pytest.raises(InvalidInputError) as refused:
            await collect(client, request_for(client, prompt, max_tokens=20))
        assert refused.value.status_code == 422
        assert "shorten the prompt or lower max_tokens" in refused.value.message
        with pytest.raises(InvalidInputError, match="prompt token ids must be in"):
            await collect(client, request_for(client, (VOCAB + 5,), max_tokens=2))


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
    assert (
        main(["package", "--repository", str(switched), "--name", "lm", "--hf", str(folder)]) == 0
    )
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
async def test_no_first_token_by_the_deadline_is_504_and_frees_the_sequence(
    repository: Path, bridged: bool
) -> None:
    """The device is held (the model's turn taken here), so no step runs before the
    deadline."""
    async with started(repository) as engine, contextlib.AsyncExitStack() as stack:
        client: EngineClient = (
            await stack.enter_async_context(over_the_bridge(engine)) if bridged else engine
        )
        turns = engine.state.device_turns.for_model("lm")
        await turns.acquire()
        try:
            late = request_for(client, (5, 6), max_tokens=5, deadline_s=time.monotonic() + 0.3)
            with pytest.raises(DeadlineExceededError) as expired:
                await collect(client, late)
            assert expired.value.status_code == 504
        finally:
            turns.release()
        loop = engine.generation_of("lm", late.version)
        await wait_until(lambda: not (loop.streams or loop.batch.running), PROMPTLY_S)
        past = request_for(client, (5, 6), max_tokens=5, deadline_s=time.monotonic() - 1)
        with pytest.raises(DeadlineExceededError):
            await collect(client, past)


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


async def test_the_kv_cache_holds_what_kv_cache_mb_allows_and_a_full_one_is_429(
    repository: Path,
) -> None:
    """The tiny GPT-2 caches 1 KiB a token (2 layers, 4 heads of 16, keys and values in
    float32), so a slot of its 512-token context takes 512 KiB: 1 MiB holds two."""
    async with started(repository, kv_cache_mb=1, max_waiting_sequences=0) as engine:
        version = request_for(engine, (1,)).version
        assert engine.generation_of("lm", version).batch.slots == 2
        long = [
            engine.generate(request_for(engine, (5, 6), max_tokens=400, ignore_eos=True))
            for _ in range(2)
        ]
        async with asyncio.timeout(PROMPTLY_S):
            for stream in long:
                assert (await anext(stream)).token_ids
        with pytest.raises(QueueFullError, match="holds 2 sequences"):
            await collect(engine, request_for(engine, (7,), max_tokens=1))
        for stream in long:
            await stream.aclose()


def test_the_kv_cache_gets_no_more_than_the_device_memory_budget_leaves() -> None:
    mib = 1024 * 1024
    alone = Settings(kv_cache_mb=512)
    assert kv_cache_budget(alone, taken_bytes=30 * mib, others_bytes=20 * mib) == 512 * mib
    budgeted = Settings(kv_cache_mb=512, device_memory_budget_mb=100)
    assert kv_cache_budget(budgeted, taken_bytes=30 * mib, others_bytes=20 * mib) == 50 * mib
    assert kv_cache_budget(budgeted, taken_bytes=90 * mib, others_bytes=20 * mib) == 0


async def test_a_step_that_outlives_the_stall_timeout_marks_the_engine_stalled(
    repository: Path,
) -> None:
    """The device thread is held here, so the step waits behind it: the engine reports
    stalled (its owner replaces the process) and refuses new streams with 503."""
    release = threading.Event()
    async with started(repository, stall_timeout_s=0.3) as engine:
        assert engine.state.device_thread is not None
        held = engine.state.device_thread.submit(release.wait, PROMPTLY_S)
        try:
            stream = engine.generate(request_for(engine, (5, 6), max_tokens=3))
            first = asyncio.ensure_future(anext(stream))
            await wait_until(lambda: engine.status().phase == "stalled", PROMPTLY_S)
            with pytest.raises(NotReadyError, match="stalled"):
                await collect(engine, request_for(engine, (7,), max_tokens=1))
        finally:
            release.set()
            held.result(timeout=PROMPTLY_S)
        async with asyncio.timeout(PROMPTLY_S):
            assert (await first).token_ids
        await stream.aclose()
        loop = engine.generation_of("lm", request_for(engine, (1,)).version)
        await loop.drain()  # a stalled engine's shutdown leaves its models as they are


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
