"""Generation through a real engine process started by the supervisor (``--workers 2``): a
front end's bridge client gets greedy streams equal to ``generate(do_sample=False)`` alone,
and a front end that disconnects mid-stream frees its sequence at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from service.bridge.client import BridgeClient
from service.processes import ENGINE_SOCKET_ENV
from service.server.cli import main
from tests import generative_models
from tests.generation_streams import PROMPTLY_S, assert_greedy_parity, request_for
from tests.generative_models import save_folder
from tests.processes import (
    engine_environment,
    engine_pids,
    scraped,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


async def test_streams_through_an_engine_process_and_a_disconnect_frees_the_slot(
    tmp_path: Path,
) -> None:
    reference: Any = generative_models.gpt2()
    folder = save_folder(tmp_path / "lm", reference)
    repository = tmp_path / "repository"
    assert (
        main(["package", "--repository", str(repository), "--name", "lm", "--hf", str(folder)]) == 0
    )
    with serve_with_engines(
        tmp_path,
        workers=2,
        BATCHSERVE_MODEL_REPOSITORY=str(repository),
        BATCHSERVE_MODELS="lm",
        BATCHSERVE_WARMUP_BATCH_SIZES="1",
        BATCHSERVE_LENGTH_BUCKETS="64",
        BATCHSERVE_MAX_BATCH_TOKENS="1024",
        BATCHSERVE_SPARE_ENGINE="false",  # its torch import would only compete for the CPU
    ) as server:
        wait_until_serving(server, workers=2)
        [pid] = engine_pids(server)
        socket = Path(engine_environment(pid)[ENGINE_SOCKET_ENV])

        async def front_end() -> BridgeClient:
            client = BridgeClient(
                [(socket, "cpu")], heartbeat_timeout_s=10.0, request_timeout_ms=5_000
            )
            await client.start()
            async with asyncio.timeout(PROMPTLY_S):
                await client.wait_until_settled()
            return client

        client = await front_end()
        try:
            await assert_greedy_parity(client, reference)
        finally:
            await client.close()

        leaving = await front_end()
        most = 500  # as many as the context leaves: far more than come before the cancel
        stream = leaving.generate(request_for(leaving, (5, 6, 7), max_tokens=most, ignore_eos=True))
        async with asyncio.timeout(PROMPTLY_S):
            assert (await anext(stream)).token_ids
        assert scraped(server.url, "batchserve_running_sequences", {"model": "lm"}) == 1
        assert scraped(server.url, "batchserve_kv_cache_slots", {"kind": "used"}) == 1
        before = scraped(server.url, "batchserve_generated_tokens_total", {"model": "lm"})
        await leaving.close()  # the front end is gone, its connection with it
        await asyncio.to_thread(
            wait_for,
            lambda: scraped(server.url, "batchserve_kv_cache_slots", {"kind": "used"}) == 0,
            "the stream's slot freed",
            server,
            timeout_s=PROMPTLY_S,
        )
        after = scraped(server.url, "batchserve_generated_tokens_total", {"model": "lm"})
        assert after - before < most - 1  # cut short, not run to its end
        await stream.aclose()
