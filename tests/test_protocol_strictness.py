"""Small mistakes a hostile or careless client makes are answered for what they are: V2
parameters of the wrong type, odd lengths and repeated outputs refused before the model runs;
``HEAD`` answered wherever ``GET`` is."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from fastapi import FastAPI

from service.config import Settings
from service.server.single import create_app
from tests.apps import registry_of
from tests.fixtures import lifespan, sample_total

IMAGE = {"name": "image", "datatype": "FP32", "shape": [1, 8, 8], "data": [0.5] * 64}
INFER = "/v2/models/digits/infer"
#: Issue 35, item 7: one rule and one message for every bad ``timeout``.
TIMEOUT_RULE = "must be a whole number of microseconds from 1 up"


@pytest.fixture
async def digits() -> AsyncIterator[FastAPI]:
    app = create_app(Settings(device="cpu", max_wait_ms=20.0))
    # Generous: starting takes seconds on a busy machine (the default 5 s timed out).
    async with lifespan(app):
        await app.state.loading
        yield app


@pytest.fixture
async def client(digits: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=digits)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def batches_run(app: FastAPI) -> float:
    return sample_total(registry_of(app), "batchserve_batch_size_rows_count")


async def test_a_unicode_digit_as_the_header_length_is_a_400_not_a_500(
    client: httpx.AsyncClient,
) -> None:
    body = orjson.dumps({"inputs": [IMAGE]})
    # Header values arrive as latin-1: b"\xb2" is "²", which str.isdigit takes.
    for length in (b"\xb2", b"\xb9\xb2", b"+5", b"-1"):
        answer = await client.post(
            INFER, content=body, headers={"Inference-Header-Content-Length": length}
        )
        assert answer.status_code == 400, (length, answer.text)
        assert "is not a length within the body" in answer.json()["error"]


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        ({"outputs": [{"name": "probabilities"}]}, "unknown ['probabilities']"),
        (
            {"outputs": [{"name": "logits"}, {"name": "logits"}]},
            "outputs ['logits'] are asked for more than once",
        ),
        *(
            ({"parameters": {"timeout": value}}, f"'timeout' {TIMEOUT_RULE}, got {value!r}")
            for value in (True, 0, -5, 1.5, "100")
        ),
        ({"parameters": {"priority": True}}, "'priority' must be a non-negative integer"),
        ({"parameters": {"priority": -1}}, "'priority' must be a non-negative integer"),
        (
            {"parameters": {"binary_data_output": "no"}},
            "binary_data_output of the request must be true or false, got 'no'",
        ),
        (
            {"outputs": [{"name": "logits", "parameters": {"binary_data": 1}}]},
            "binary_data of output 'logits' must be true or false, got 1",
        ),
    ],
)
async def test_bad_v2_parameters_and_outputs_are_refused_before_a_batch_runs(
    digits: FastAPI, client: httpx.AsyncClient, request_: dict[str, object], words: str
) -> None:
    await client.post(INFER, json={"inputs": [IMAGE]})  # the metric exists
    before = batches_run(digits)

    answer = await client.post(INFER, json={"inputs": [IMAGE], **request_})

    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]
    assert batches_run(digits) == before


async def test_boolean_v2_parameters_are_read_as_booleans(client: httpx.AsyncClient) -> None:
    plain = await client.post(
        INFER, json={"inputs": [IMAGE], "parameters": {"binary_data_output": False}}
    )
    binary = await client.post(
        INFER, json={"inputs": [IMAGE], "parameters": {"binary_data_output": True}}
    )
    assert plain.headers["content-type"] == "application/json"
    assert binary.headers["content-type"] == "application/octet-stream"


async def test_a_504_names_the_v2_timeout_that_applied(client: httpx.AsyncClient) -> None:
    answer = await client.post(INFER, json={"inputs": [IMAGE], "parameters": {"timeout": 1}})
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"].startswith(
        "the request was not answered within 1 µs (the request's 'timeout' parameter)"
    )


@pytest.mark.parametrize(
    "path",
    [
        "/healthz",
        "/readyz",
        "/models",
        "/metrics",
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/digits",
        "/v2/models/digits/ready",
        "/docs",
        "/openapi.json",
    ],
)
async def test_head_is_answered_wherever_get_is(client: httpx.AsyncClient, path: str) -> None:
    got = await client.get(path)
    head = await client.head(path)
    assert (head.status_code, got.status_code) == (200, 200)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


async def test_head_on_a_post_route_is_still_405(client: httpx.AsyncClient) -> None:
    assert (await client.head("/admin/models")).status_code in (404, 405)
    assert (await client.head("/predict")).status_code == 405
