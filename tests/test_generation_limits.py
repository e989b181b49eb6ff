"""What a generative model refuses, and when a stream's slot is free again, in an engine in
process and over the bridge: a closed stream frees its slot for the next request, a full KV
cache is 429 with Retry-After at once, a prompt that never fits 422, no first token by the
deadline 504, a deadline passed mid-stream ends the stream with 504, a hung step marks the
engine stalled."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

from service.bridge.interface import EngineClient, GeneratedTokens
from service.config import Settings
from service.engine.lifecycle import kv_cache_budget
from service.errors import (
    DeadlineExceededError,
    InvalidInputError,
    NotReadyError,
    QueueFullError,
)
from service.types import Priority
from tests import generative_models
from tests.fixtures import wait_until
from tests.generation_streams import (
    PROMPTLY_S,
    collect,
    over_the_bridge,
    package,
    request_for,
    started,
)
from tests.generative_models import CONTEXT, VOCAB, save_folder

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 (``lm``), packaged with --hf."""
    root = tmp_path_factory.mktemp("generation")
    package(save_folder(root / "lm", generative_models.gpt2()), root / "repo", "lm")
    return root / "repo"


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
async def test_a_deadline_passed_mid_stream_ends_it_with_504_and_frees_the_sequence(
    repository: Path, bridged: bool
) -> None:
    """Once the first token came, the device is held (the model's turn taken here) so that
    the stream cannot finish: at its deadline it ends with 504 after the tokens it had, and
    its slot is free at the next step."""
    async with started(repository) as engine, contextlib.AsyncExitStack() as stack:
        client: EngineClient = (
            await stack.enter_async_context(over_the_bridge(engine)) if bridged else engine
        )
        turns = engine.state.device_turns.for_model("lm")
        request = request_for(
            client,
            (5, 6),
            max_tokens=400,
            ignore_eos=True,
            deadline_s=time.monotonic() + PROMPTLY_S,
            stream_deadline_s=time.monotonic() + 2.0,
        )
        items: list[GeneratedTokens] = []

        async def read_holding_the_device_after_the_first_token() -> None:
            held = False
            try:
                async with asyncio.timeout(PROMPTLY_S):
                    async for item in client.generate(request):
                        items.append(item)
                        if not held:
                            await turns.acquire()
                            held = True
            finally:
                if held:
                    turns.release()

        with pytest.raises(DeadlineExceededError) as expired:
            await read_holding_the_device_after_the_first_token()
        assert expired.value.status_code == 504
        tokens = sum(len(item.token_ids) for item in items)  # over the bridge, coalesced
        assert f"deadline passed after {tokens} generated tokens" in expired.value.message
        assert items
        assert all(item.finish_reason is None for item in items)
        loop = engine.generation_of("lm", request.version)
        await wait_until(lambda: not (loop.streams or loop.batch.running), PROMPTLY_S)


async def test_a_stream_whose_first_token_came_in_time_runs_on_past_the_first_tokens_deadline(
    repository: Path,
) -> None:
    """The first token's deadline (``request_timeout_ms``) bounds the wait for it, not the
    stream: held past it (the device taken here once the first token came), the stream
    still ends as the model ends it."""
    async with started(repository) as engine:
        first_deadline_s = time.monotonic() + 1.0
        request = request_for(
            engine, (5, 6), max_tokens=6, ignore_eos=True, deadline_s=first_deadline_s
        )
        turns = engine.state.device_turns.for_model("lm")
        items: list[GeneratedTokens] = []
        async with asyncio.timeout(PROMPTLY_S):
            async for item in engine.generate(request):
                items.append(item)
                if len(items) == 1:
                    await turns.acquire()
                    try:
                        await wait_until(lambda: time.monotonic() > first_deadline_s + 0.2, 5.0)
                    finally:
                        turns.release()
        assert items[-1].finish_reason == "length"
        assert sum(len(item.token_ids) for item in items) == 6


async def test_a_high_priority_request_takes_a_free_slot_before_a_normal_one_sent_first(
    repository: Path,
) -> None:
    """One slot, held by a long stream; a normal then a high request wait (the device held
    here, so that nothing finishes meanwhile). Once the long stream is closed, the high one
    generates first."""
    async with started(repository, max_running_sequences=1) as engine:
        long = engine.generate(request_for(engine, (5, 6, 7), max_tokens=400, ignore_eos=True))
        async with asyncio.timeout(PROMPTLY_S):
            assert (await anext(long)).token_ids
        loop = engine.generation_of("lm", request_for(engine, (1,)).version)
        order: list[str] = []

        async def read(priority: Priority) -> None:
            request = request_for(engine, (8, 9), max_tokens=2, ignore_eos=True, priority=priority)
            async for item in engine.generate(request):
                order.extend([priority] * len(item.token_ids))

        turns = engine.state.device_turns.for_model("lm")
        await turns.acquire()
        try:
            normal = asyncio.ensure_future(read("normal"))
            await wait_until(lambda: loop.streams == 2, PROMPTLY_S)
            high = asyncio.ensure_future(read("high"))
            await wait_until(lambda: loop.streams == 3, PROMPTLY_S)
            await long.aclose()
        finally:
            turns.release()
        async with asyncio.timeout(PROMPTLY_S):
            await asyncio.gather(normal, high)
        assert order == ["high", "high", "normal", "normal"]


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
