"""An engine serving a tiny GPT-2 (``lm``) for the generation tests, in process or behind a
bridge socket, or a whole server on a free port; requests and their streams, each read whole
and checked against ``transformers``' greedy generation of its prompt alone."""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import torch

from service.bridge.client import BridgeClient
from service.bridge.interface import EngineClient, GeneratedTokens, GenerateRequest
from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine
from service.metrics import EngineMetrics
from service.server.cli import main
from service.server.draining import uvicorn_config
from service.server.single import create_app
from tests.fixtures import uvicorn_port
from tests.generative_models import EOS, VOCAB

PROMPTLY_S = 60.0
PROMPT_LENGTHS = (1, 2, 7, 16, 33, 64, 100, 130)
MAX_TOKENS = (1, 3, 8, 17, 32, 40)


def request_for(client: EngineClient, prompt: tuple[int, ...], **fields: Any) -> GenerateRequest:
    model = client.status().find("lm")
    assert model is not None
    return GenerateRequest(
        model="lm", version=model.manifest.version, prompt_ids=prompt, temperature=0.0, **fields
    )


async def collect(client: EngineClient, request: GenerateRequest) -> list[GeneratedTokens]:
    items = []
    async with asyncio.timeout(PROMPTLY_S):
        async for item in client.generate(request):
            items.append(item)
    return items


def generated_alone(model: Any, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    tokens: list[int] = output[0, len(prompt) :].tolist()
    return tokens


def mixed_prompts(count: int, seed: int) -> list[tuple[tuple[int, ...], int]]:
    chooser = random.Random(seed)
    return [
        (
            tuple(
                chooser.randrange(1, VOCAB) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])
            ),
            chooser.choice(MAX_TOKENS),
        )
        for i in range(count)
    ]


async def assert_greedy_parity(client: EngineClient, reference: Any) -> None:
    prompts = mixed_prompts(16, seed=3)
    streams = await asyncio.gather(
        *(collect(client, request_for(client, prompt, max_tokens=most)) for prompt, most in prompts)
    )
    version = client.status().find("lm")
    assert version is not None
    for (prompt, most), items in zip(prompts, streams, strict=True):
        tokens = [token for item in items for token in item.token_ids]
        assert tokens == generated_alone(reference, prompt, most)
        assert items[-1].finish_reason == ("stop" if tokens[-1] == EOS else "length")
        assert all(item.finish_reason is None for item in items[:-1])
        assert {item.version for item in items} == {version.manifest.version}


def package(folder: Path, repository: Path, name: str = "lm") -> None:
    """``batchserve package --hf folder`` as ``name`` into ``repository``."""
    command = ["package", "--repository", str(repository), "--name", name, "--hf", str(folder)]
    assert main(command) == 0


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


@contextlib.asynccontextmanager
async def served(
    repository: Path, models: tuple[str, ...], kv_cache_mb: int, ready_within_s: float = 120.0
) -> AsyncIterator[str]:
    """``models`` served by one process on a free port, once ready (loaded and warmed up):
    its base URL."""
    settings = Settings(
        model_repository=repository,
        models=models,
        device="cpu",
        torch_threads=1,
        warmup_batch_sizes=(1,),
        kv_cache_mb=kv_cache_mb,
    )
    config = uvicorn_config(create_app(settings), settings)
    config.host, config.port = "127.0.0.1", 0
    async with uvicorn_port(config) as port, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{port}"
        deadline_s = asyncio.get_running_loop().time() + ready_within_s
        while (await client.get(url + "/readyz")).status_code != 200:
            assert asyncio.get_running_loop().time() < deadline_s, "not ready in time"
            await asyncio.sleep(0.05)
        yield url
