"""``.npy`` request bodies and answers, validated exactly like JSON."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from service.config import Settings
from service.server.single import create_app
from tests.fixtures import lifespan

NPY = "application/x-npy"


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app: FastAPI = create_app(Settings(device="cpu", max_wait_ms=2.0))
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


async def test_npy_in_npy_out_matches_json(client: httpx.AsyncClient) -> None:
    images = np.random.default_rng(0).random((3, 8, 8), dtype=np.float32)
    as_json = await client.post("/predict", json={"instances": images.tolist()})
    as_npy = await client.post(
        "/predict", content=npy(images), headers={"content-type": NPY, "accept": NPY}
    )
    assert as_npy.status_code == 200
    assert as_npy.headers["content-type"] == NPY
    assert as_npy.headers["x-model-version"] == as_json.headers["x-model-version"]
    predictions = np.load(io.BytesIO(as_npy.content), allow_pickle=False)
    assert predictions.dtype == np.float32
    assert predictions.shape == (3, 10)
    np.testing.assert_allclose(predictions, as_json.json()["predictions"], rtol=1e-6, atol=1e-6)


async def test_one_instance_without_batch_axis_and_octet_stream(
    client: httpx.AsyncClient,
) -> None:
    image = np.zeros((8, 8), dtype=np.float32)
    response = await client.post(
        "/predict", content=npy(image), headers={"content-type": "application/octet-stream"}
    )
    assert response.status_code == 200
    assert len(response.json()["predictions"]) == 1  # JSON answer unless npy was asked for


async def test_json_answer_when_the_client_accepts_both(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/predict",
        content=npy(np.zeros((1, 8, 8), dtype=np.float32)),
        headers={"content-type": NPY, "accept": f"application/json, {NPY}"},
    )
    assert response.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (npy(np.zeros((1, 8, 8), dtype=np.float64)), 422, "expected dtype float32, got float64"),
        (npy(np.zeros((1, 8, 8), dtype=np.int32)), 422, "expected dtype float32, got int32"),
        (npy(np.zeros((2, 8, 7), dtype=np.float32)), 422, "shape (N, 8, 8), got (2, 8, 7)"),
        (npy(np.zeros((0, 8, 8), dtype=np.float32)), 422, "empty"),
        (npy(np.full((1, 8, 8), np.nan, dtype=np.float32)), 422, "not finite"),
        (npy(np.zeros((1, 8, 8), dtype=">f4")), 200, ""),  # big-endian float32 is float32
        (b"\x93NUMPY garbage", 400, "not a valid .npy array"),
        (b"", 400, "not a valid .npy array"),
    ],
)
async def test_binary_bodies_are_validated(
    client: httpx.AsyncClient, body: bytes, status: int, fragment: str
) -> None:
    response = await client.post("/predict", content=body, headers={"content-type": NPY})
    assert response.status_code == status, response.text
    if fragment:
        assert fragment in response.json()["error"]["message"]


async def test_pickled_object_arrays_are_refused_without_unpickling(
    client: httpx.AsyncClient,
) -> None:
    objects = np.empty((1,), dtype=object)
    objects[0] = {"not": "numbers"}
    buffer = io.BytesIO()
    np.save(buffer, objects, allow_pickle=True)
    response = await client.post(
        "/predict", content=buffer.getvalue(), headers={"content-type": NPY}
    )
    assert response.status_code == 400
    assert "not a valid .npy array" in response.json()["error"]["message"]


async def test_npz_archives_are_refused(client: httpx.AsyncClient) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, images=np.zeros((1, 8, 8), dtype=np.float32))
    response = await client.post(
        "/predict", content=buffer.getvalue(), headers={"content-type": NPY}
    )
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("accept", "npy_answer"),
    [
        (f"{NPY};q=1, application/json;q=0", True),
        (f"{NPY};q=0.5, application/json;q=0.9", False),
        (f"{NPY}, application/json;q=0.1", True),
        (f"{NPY};q=0", False),
        (f"{NPY};q=banana", False),
        (f"{NPY}, */*", True),
        ("application/json", False),
    ],
)
async def test_the_answer_format_follows_the_accept_qualities(
    client: httpx.AsyncClient, accept: str, npy_answer: bool
) -> None:
    images = np.zeros((1, 8, 8), dtype=np.float32)
    response = await client.post(
        "/predict", content=npy(images), headers={"content-type": NPY, "accept": accept}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(NPY if npy_answer else "application/json")


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 8, 8, }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': '(1",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 8, 8), 'x': \"\"\"",
    ],
)
async def test_an_npy_header_python_cannot_tokenize_is_400(
    client: httpx.AsyncClient, header: str
) -> None:
    """numpy reads the header with Python's tokenizer, which raised TokenError (a 500)."""
    text = header.encode("latin-1")
    text += b" " * ((64 - (10 + len(text) + 1) % 64) % 64) + b"\n"
    body = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + bytes(256)
    response = await client.post("/predict", content=body, headers={"content-type": NPY})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"
