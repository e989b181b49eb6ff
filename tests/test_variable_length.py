"""Variable-length inputs (the textenc model): buckets, padding, token budget, validation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from service.buckets import batch_group, bucket_of, default_edges, resolve_edges
from service.config import Settings
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of, frontend_of, registry_of, runner_of
from tests.fixtures import lifespan, sample_total


def sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, size=length).tolist() for length in lengths]


@pytest.fixture
async def textenc() -> AsyncIterator[FastAPI]:
    app = create_app(Settings(model_name="textenc", device="cpu", max_wait_ms=50.0))
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        yield app


@pytest.fixture
async def client(textenc: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=textenc)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def alone(app: FastAPI, sequence: list[int]) -> np.ndarray:
    """The model on this one sequence, unpadded and unbatched."""
    with torch.inference_mode():
        output: np.ndarray = runner_of(app)._model(torch.tensor([sequence]))[0].numpy()
    return output


def test_default_edges_are_powers_of_two_up_to_the_maximum() -> None:
    assert default_edges(512) == (8, 16, 32, 64, 128, 256, 512)
    assert default_edges(100) == (8, 16, 32, 64, 100)
    assert resolve_edges((), 512) == default_edges(512)
    assert resolve_edges((128, 32, 1000), 512) == (32, 128, 512)
    assert resolve_edges((64,), 512) == (64, 512)
    assert [bucket_of(length, (8, 16, 512)) for length in (1, 8, 9, 16, 17, 512)] == [
        8, 8, 16, 16, 512, 512,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_of(513, (8, 512))


async def test_padding_changes_nothing_when_batched_with_longer_sequences(
    textenc: FastAPI, client: httpx.AsyncClient
) -> None:
    # All in the 128 bucket, so they share batches; the short ones are padded to the longest.
    batch = sequences([70, 128, 65, 100, 127, 90], seed=1)
    responses = await asyncio.gather(
        *(client.post("/predict", json={"instances": [sequence]}) for sequence in batch)
    )
    registry = registry_of(textenc)
    assert sample_total(registry, "batchserve_batch_size_rows_count") < len(batch)
    for sequence, response in zip(batch, responses, strict=True):
        assert response.status_code == 200
        np.testing.assert_allclose(
            response.json()["predictions"][0], alone(textenc, sequence), rtol=0, atol=1e-5
        )


async def test_a_request_of_mixed_lengths_keeps_each_instance_exact(
    textenc: FastAPI, client: httpx.AsyncClient
) -> None:
    mixed = sequences([3, 300, 17, 1], seed=2)
    response = await client.post("/predict", json={"instances": mixed})
    assert response.status_code == 200
    for sequence, row in zip(mixed, response.json()["predictions"], strict=True):
        np.testing.assert_allclose(row, alone(textenc, sequence), rtol=0, atol=1e-5)


async def test_requests_in_different_buckets_never_share_a_batch(
    textenc: FastAPI, client: httpx.AsyncClient
) -> None:
    frontend = frontend_of(textenc)
    layout = frontend.layout_for(frontend.serving_model())
    short = NamedArrays({"token_ids": np.ones((2, 5), dtype=np.int64)})
    long = NamedArrays({"token_ids": np.ones((1, 200), dtype=np.int64)})
    assert batch_group(layout.manifest, short, layout.length_edges) == ((8,), 8)
    assert batch_group(layout.manifest, long, layout.length_edges) == ((256,), 256)
    lengths = [5, 200, 6, 201, 7]
    responses = await asyncio.gather(
        *(client.post("/predict", json={"instances": [s]}) for s in sequences(lengths))
    )
    assert all(response.status_code == 200 for response in responses)
    registry = registry_of(textenc)
    # Two buckets (8 and 256): three rows in one batch and two in another, never all five.
    assert sample_total(registry, "batchserve_batch_size_rows_count") == 2
    assert sample_total(registry, "batchserve_batch_size_rows_sum") == 5


async def test_token_budget_limits_the_rows_of_a_batch() -> None:
    app = create_app(
        Settings(model_name="textenc", device="cpu", max_wait_ms=50.0, max_batch_tokens=256)
    )
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            batch = sequences([100, 110, 120, 105, 90], seed=3)  # bucket 128: 2 rows per 256
            responses = await asyncio.gather(
                *(http.post("/predict", json={"instances": [s]}) for s in batch)
            )
            split = await http.post("/predict", json={"instances": batch})
        assert all(response.status_code == 200 for response in [*responses, split])
        np.testing.assert_allclose(
            split.json()["predictions"][4], alone(app, batch[4]), rtol=0, atol=1e-5
        )
        registry = registry_of(app)
        assert sample_total(registry, "batchserve_batch_size_rows_bucket", {"le": "2.0"}) == (
            sample_total(registry, "batchserve_batch_size_rows_count")
        )


@pytest.mark.parametrize(
    ("instances", "fragment"),
    [
        ([[1, 2, 1000]], "values must lie in [1, 999] (or be the padding value 0), got 1000"),
        ([[1, -3]], "got -3"),
        ([[1.5, 2]], "only integers"),
        ([["1"]], "only integers"),
        ([[]], "instance 0 is empty"),
        ([[1, 2], []], "instance 1 is empty"),
        ([list(range(1, 514))], "1 to 512 long on their variable axis, got 513"),
        ([[[1, 2]]], "instance with 2 dimension(s) instead of 1"),
        ([7], "instance with 0 dimension(s) instead of 1"),
        ([[2**70]], "integers outside [-9007199254740992, 9007199254740992]"),
    ],
)
async def test_invalid_token_ids_are_refused_before_queuing(
    client: httpx.AsyncClient, instances: list[object], fragment: str
) -> None:
    response = await client.post("/predict", json={"instances": instances})
    assert response.status_code == 422
    assert fragment in response.json()["error"]["message"]
