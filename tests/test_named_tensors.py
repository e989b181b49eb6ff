"""A model with two named inputs and two named outputs, served as it is (``PairClassifier``:
``input_ids`` and ``attention_mask`` in, ``logits`` and an int64 ``label`` out)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from service.config import Settings
from service.server.single import create_app
from tests.apps import engine_of, registry_of, runner_of
from tests.fixtures import lifespan, sample_total
from tests.torch_models import package_pair_classifier


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    package_pair_classifier(root)
    return root


@pytest.fixture
async def pairs(repository: Path) -> AsyncIterator[FastAPI]:
    settings = Settings(
        model_repository=repository, model_name="pairs", device="cpu", max_wait_ms=50.0
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        yield app


@pytest.fixture
async def client(pairs: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=pairs)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def tokens(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 100, size=length).tolist()


def instance(length: int, seed: int) -> dict[str, list[int]]:
    return {"input_ids": tokens(length, seed), "attention_mask": [1] * length}


def alone(app: FastAPI, ids: list[int]) -> tuple[np.ndarray, int]:
    """The model on this one unpadded sequence: (logits row, label)."""
    with torch.inference_mode():
        out = runner_of(app)._model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return out["logits"][0].numpy(), int(out["label"][0])


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


async def test_concurrent_callers_each_get_their_own_rows_of_each_output(
    pairs: FastAPI, client: httpx.AsyncClient
) -> None:
    # Lengths 9 to 16 share the 16 bucket, so the requests share batches and are padded.
    lengths = [9, 16, 11, 13, 10, 15, 12, 14]
    bodies = [{"instances": [instance(length, seed)]} for seed, length in enumerate(lengths)]
    responses = await asyncio.gather(*(client.post("/predict", json=body) for body in bodies))

    registry = registry_of(pairs)
    assert sample_total(registry, "batchserve_batch_size_rows_count") < len(bodies)
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        (prediction,) = response.json()["predictions"]
        assert set(prediction) == {"logits", "label"}
        logits, label = alone(pairs, body["instances"][0]["input_ids"])
        np.testing.assert_allclose(prediction["logits"], logits, rtol=0, atol=1e-5)
        assert prediction["label"] == label
        assert isinstance(prediction["label"], int)  # int64 answered as an integer, not 3.0


async def test_npz_in_and_out_carry_every_tensor(pairs: FastAPI, client: httpx.AsyncClient) -> None:
    ids = np.array([tokens(6, 1), tokens(6, 2)], dtype=np.int64)
    body = npz(input_ids=ids, attention_mask=np.ones_like(ids))
    response = await client.post(
        "/predict",
        content=body,
        headers={"Content-Type": "application/x-npz", "Accept": "application/x-npz"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-npz"
    answer = np.load(io.BytesIO(response.content), allow_pickle=False)
    assert sorted(answer.files) == ["label", "logits"]
    assert answer["label"].dtype == np.int64
    for row, ids_row in enumerate(ids.tolist()):
        logits, label = alone(pairs, ids_row)
        np.testing.assert_allclose(answer["logits"][row], logits, rtol=0, atol=1e-5)
        assert answer["label"][row] == label


async def test_ids_and_mask_are_bucketed_and_padded_together(
    pairs: FastAPI, client: httpx.AsyncClient
) -> None:
    # One request of two instances, 3 and 7 long: both inputs padded to 7 with their own pad
    # value (0), and the answer for the short one is that of the short one alone.
    body = {"instances": [instance(3, 5), instance(7, 6)]}
    response = await client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    for item, prediction in zip(body["instances"], response.json()["predictions"], strict=True):
        logits, _ = alone(pairs, item["input_ids"])
        np.testing.assert_allclose(prediction["logits"], logits, rtol=0, atol=1e-5)
    layout = engine_of(pairs).served
    assert layout is not None
    assert layout.length_edges[0] == 8  # both lengths fall in the 8 bucket, one group


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"instances": [{"input_ids": [1, 2, 3], "attention_mask": [1, 1]}]},
            "instance 0: inputs with a variable axis must be equally long, got lengths "
            "{'input_ids': 3, 'attention_mask': 2}",
        ),
        (
            {"instances": [{"input_ids": [1, 2]}]},
            "instance 0 must have exactly the inputs ['input_ids', 'attention_mask']; "
            "missing ['attention_mask']",
        ),
        ({"instances": []}, "'instances' is empty; send at least one instance"),
        (
            {"instances": [[1, 2, 3]]},
            "instance 0 must be an object keyed by input name ['input_ids', 'attention_mask'], "
            "got a list",
        ),
        (
            {"instances": [{"input_ids": [1, 200], "attention_mask": [1, 1]}]},
            "values must lie in [1, 99] (or be the padding value 0), got 200",
        ),
    ],
)
async def test_bad_named_inputs_are_422_naming_the_problem(
    client: httpx.AsyncClient, body: object, message: str
) -> None:
    response = await client.post("/predict", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["message"] == message


async def test_binary_formats_that_cannot_carry_several_tensors_are_refused(
    client: httpx.AsyncClient,
) -> None:
    one_array = io.BytesIO()
    np.save(one_array, np.ones((1, 4), dtype=np.int64))
    response = await client.post(
        "/predict", content=one_array.getvalue(), headers={"Content-Type": "application/x-npy"}
    )
    assert response.status_code == 422
    assert "send them as one application/x-npz archive" in response.json()["error"]["message"]

    wrong_names = npz(ids=np.ones((1, 4), dtype=np.int64))
    response = await client.post(
        "/predict", content=wrong_names, headers={"Content-Type": "application/x-npz"}
    )
    assert response.status_code == 422
    assert "exactly the arrays ['input_ids', 'attention_mask'], got ['ids']" in response.text

    response = await client.post(
        "/predict", content=b"PK\x03\x04 not a zip", headers={"Content-Type": "application/x-npz"}
    )
    assert response.status_code == 400

    response = await client.post(
        "/predict",
        json={"instances": [instance(4, 0)]},
        headers={"Accept": "application/x-npy"},
    )
    assert response.status_code == 406
    assert "ask for application/x-npz" in response.json()["error"]["message"]


async def test_an_npz_bomb_is_refused_before_it_is_inflated(client: httpx.AsyncClient) -> None:
    buffer = io.BytesIO()
    zeros = np.zeros((1, 32), dtype=np.int64)
    np.savez_compressed(buffer, input_ids=zeros, attention_mask=np.zeros((4096, 4096), np.int64))
    response = await client.post(
        "/predict", content=buffer.getvalue(), headers={"Content-Type": "application/x-npz"}
    )
    assert response.status_code == 413
    assert "inflates to more than" in response.json()["error"]["message"]
