"""Shadowing a generative model: a greedy stream is copied to the candidate once it has
finished and compared by its token ids; a sampled one is never copied; the client's stream is
the served version's, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from service.engine.model_store import ModelStore
from tests import generative_models
from tests.generation_streams import (
    PROMPTLY_S,
    collect,
    generated_alone,
    package,
    request_for,
    started,
)
from tests.generative_models import save_folder

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``lm`` at two versions: a tiny GPT-2, then the same architecture with other weights."""
    root = tmp_path_factory.mktemp("shadow-generation")
    package(save_folder(root / "lm", generative_models.gpt2()), root / "repo")
    package(save_folder(root / "lm2", generative_models.gpt2(seed=1)), root / "repo")
    return root / "repo"


async def test_greedy_streams_are_compared_by_token_ids_and_sampled_ones_skipped(
    repository: Path,
) -> None:
    versions = [manifest.version for manifest in ModelStore(repository).versions("lm")]
    served, candidate = versions
    reference = generative_models.gpt2()
    other = generative_models.gpt2(seed=1)
    prompts = [(5, 6, 7), (11, 12), (40, 41, 42, 43)]
    async with started(repository, models=(f"lm@{served}",)) as engine:
        await engine.start_shadow("lm", candidate, 100)
        for prompt in prompts:
            items = await collect(engine, request_for(engine, prompt, max_tokens=8))
            assert [token for item in items for token in item.token_ids] == generated_alone(
                reference, prompt, 8
            )
            assert {item.version for item in items} == {served}
        greedy = request_for(engine, (5, 6, 7), max_tokens=8)
        sampled = dataclasses.replace(greedy, temperature=1.0, seed=3)
        await collect(engine, sampled)

        deadline_s = time.monotonic() + PROMPTLY_S
        while (report := await engine.shadow_report("lm")).compared < len(prompts):
            assert time.monotonic() < deadline_s, report
            await asyncio.sleep(0.05)
        assert report.chosen == len(prompts)  # the sampled stream was not copied
        expected = sum(
            generated_alone(reference, prompt, 8) != generated_alone(other, prompt, 8)
            for prompt in prompts
        )
        assert expected > 0  # the two versions generate differently from some prompt
        assert (report.compared, report.disagreed, report.failed) == (3, expected, 0)
        for entry in report.disagreements:
            assert entry["candidate_version"] == candidate
            assert entry["detail"].startswith("tokens: ")
        await engine.stop_shadow("lm")


async def test_generated_streams_are_counted_in_the_engines_traffic_window(
    repository: Path,
) -> None:
    """The traffic window a rollout judges by counts generation too, in the engine."""
    served = ModelStore(repository).versions("lm")[0].version
    async with started(repository, models=(f"lm@{served}",)) as engine:
        for prompt in ((5, 6, 7), (11, 12)):
            await collect(engine, request_for(engine, prompt, max_tokens=4))
        stats = (await engine.traffic("lm")).stats()
        assert set(stats) == {served}
        assert (stats[served].requests, stats[served].errors) == (2, 0)
        p99_ms = stats[served].p99_ms
        assert p99_ms is not None
        assert p99_ms > 0
