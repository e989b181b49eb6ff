"""Generation served by an engine (``EngineClient.generate``), in process and over the bridge:
every greedy stream equals ``generate(do_sample=False)`` on its prompt alone, whatever runs
beside it; cancelling frees the slot; a full KV cache is 429 at once, a prompt that never
fits 422; a tensor model on the same engine answers right meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.bridge.client import BridgeClient
from service.bridge.interface import (
    EngineClient,
    GenerateRequest,
    InferenceRequest,
)
from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine
from service.engine.model_store import ModelStore
from service.errors import InvalidInputError, QueueFullError, ServiceError
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
        "models": ("lm", "bert"),
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
    async with started(repository) as engine:
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
    async with started(repository) as engine:
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
    async with started(switched, models=(f"lm@{old_version}", "bert")) as engine:
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
