"""The HTTP API through the real app: real digits model, real batcher, in-process transport."""

from __future__ import annotations

import asyncio
import gc
import shutil
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.lifecycle import load_version, switch_to
from service.engine.model_store import ModelStore
from service.server.single import create_app
from tests.apps import engine_of, frontend_of, registry_of, runner_of
from tests.fixtures import lifespan, sample_total, wait_until

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")


def make_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"device": "cpu", "max_wait_ms": 2.0}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


async def start(app: FastAPI) -> LifespanManager:
    manager = lifespan(app)
    await manager.__aenter__()
    await app.state.loading
    return manager


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    application = create_app(make_settings(max_batch_size=64))
    manager = await start(application)
    yield application
    await manager.__aexit__(None, None, None)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def reference_forward(app: FastAPI, instances: np.ndarray) -> np.ndarray:
    """The served module run in-process on one input at a time (no batching)."""
    module = runner_of(app)._model
    rows = []
    with torch.inference_mode():
        for instance in instances:
            rows.append(module(torch.from_numpy(instance[np.newaxis]))[0].numpy())
    return np.stack(rows)


def random_digits(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 8, 8), dtype=np.float32)


async def post_json(client: httpx.AsyncClient, document: object) -> httpx.Response:
    return await client.post(
        "/predict", content=orjson.dumps(document), headers={"content-type": "application/json"}
    )


async def test_predict_answers_rows_of_the_served_model(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    instances = random_digits(3, seed=1)
    response = await post_json(client, {"instances": instances.tolist()})
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == "digits"
    assert body["version"] == DIGITS.version
    assert response.headers["x-model-version"] == f"digits@{DIGITS.version}"
    assert len(response.headers["x-request-id"]) == 32
    np.testing.assert_allclose(
        np.array(body["predictions"]), reference_forward(app, instances), rtol=1e-5, atol=1e-5
    )


async def test_300_concurrent_callers_each_get_their_own_rows(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    inputs = [random_digits(1 + index % 3, seed=index) for index in range(300)]
    responses = await asyncio.gather(
        *(post_json(client, {"instances": instance.tolist()}) for instance in inputs)
    )
    for instance, response in zip(inputs, responses, strict=True):
        assert response.status_code == 200, response.text
        # Tolerance, not equality: a row's float rounding may differ between batch sizes, but
        # distinct random inputs differ by far more than 1e-5, so any mix-up fails this.
        np.testing.assert_allclose(
            np.array(response.json()["predictions"]),
            reference_forward(app, instance),
            rtol=1e-5,
            atol=1e-5,
        )
    registry = registry_of(app)
    batches = sample_total(registry, "batchserve_batch_size_rows_count")
    rows = sample_total(registry, "batchserve_batch_size_rows_sum")
    single_row_batches = sample_total(registry, "batchserve_batch_size_rows_bucket", {"le": "1.0"})
    assert batches is not None
    assert rows is not None
    assert single_row_batches is not None
    assert rows == sum(len(instance) for instance in inputs)  # warm-up bypasses the batcher
    assert batches < 300 / 2, "requests should have been batched together"
    assert batches - single_row_batches > 0


async def test_request_larger_than_max_batch_size_is_split_and_rejoined_in_order() -> None:
    application = create_app(make_settings(max_batch_size=8))
    manager = await start(application)
    try:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            instances = random_digits(21, seed=7)
            response = await post_json(http, {"instances": instances.tolist()})
            assert response.status_code == 200
            np.testing.assert_allclose(
                np.array(response.json()["predictions"]),
                reference_forward(application, instances),
                rtol=1e-5,
                atol=1e-5,
            )
            registry = registry_of(application)
            assert sample_total(registry, "batchserve_batch_size_rows_count") == 3
    finally:
        await manager.__aexit__(None, None, None)


@pytest.mark.parametrize(
    ("document", "status", "fragment"),
    [
        (
            {"instances": [[[0.0] * 8] * 7]},
            422,
            "expected instances of shape (N, 8, 8), got (1, 7, 8)",
        ),
        ({"instances": [[0.0] * 8]}, 422, "expected instances of shape (N, 8, 8), got (1, 8)"),
        ({"instances": [[["a"] * 8] * 8]}, 422, "only numbers"),
        ({"instances": [[[True] * 8] * 8]}, 422, "booleans"),
        ({"instances": [[[None] * 8] * 8]}, 422, "nulls"),
        ({"instances": [[[0.0] * 8] * 8, [[0.0] * 7] * 8]}, 422, "uneven lengths"),
        ({"instances": [[[1e39] * 8] * 8]}, 422, "not finite"),
        ({"instances": []}, 422, "empty"),
        ({"inputs": []}, 422, "unknown field"),
        ({}, 422, "missing field 'instances'"),
        ({"instances": "abc"}, 422, "must be a list"),
        ([1, 2], 422, "JSON object"),
    ],
)
async def test_invalid_instances_are_refused_with_what_was_expected(
    client: httpx.AsyncClient, document: object, status: int, fragment: str
) -> None:
    response = await post_json(client, document)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["request_id"] == response.headers["x-request-id"]


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/predict", content=b'{"instances": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"


async def test_nan_literal_is_not_json(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/predict", content=b'{"instances": [NaN]}', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400


async def test_wrong_content_type_is_415(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict", content=b"a=1", headers={"content-type": "text/csv"})
    assert response.status_code == 415
    assert "application/json" in response.json()["error"]["message"]


async def test_too_many_instances_is_422() -> None:
    application = create_app(make_settings(max_instances_per_request=4))
    manager = await start(application)
    try:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await post_json(http, {"instances": random_digits(5, seed=0).tolist()})
            assert response.status_code == 422
            assert "at most 4" in response.json()["error"]["message"]
    finally:
        await manager.__aexit__(None, None, None)


async def test_body_over_the_limit_is_413_by_declared_length_and_by_stream() -> None:
    application = create_app(make_settings(max_body_bytes=2048))
    manager = await start(application)
    try:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            big = orjson.dumps({"instances": random_digits(8, seed=0).tolist()})
            assert len(big) > 2048
            declared = await http.post(
                "/predict", content=big, headers={"content-type": "application/json"}
            )
            assert declared.status_code == 413
            # Issue 37.6: the 413 names the limit and the setting that raises it.
            assert declared.json()["error"]["message"] == (
                f"the body is {len(big):,} bytes; at most 2,048 bytes are accepted (the "
                "server's max_body_bytes, set by BATCHSERVE_MAX_BODY_BYTES or --max-body-bytes)"
            )

            async def undeclared_length() -> AsyncIterator[bytes]:
                for start in range(0, len(big), 512):
                    yield big[start : start + 512]

            streamed = await http.post(
                "/predict",
                content=undeclared_length(),
                headers={"content-type": "application/json"},
            )
            assert streamed.status_code == 413
            assert streamed.json()["error"]["code"] == "payload_too_large"
            assert "at most 2,048 bytes" in streamed.json()["error"]["message"]
            assert "BATCHSERVE_MAX_BODY_BYTES" in streamed.json()["error"]["message"]
    finally:
        await manager.__aexit__(None, None, None)


async def test_a_bad_request_leaves_concurrent_good_ones_untouched(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    good = random_digits(1, seed=3)
    responses = await asyncio.gather(
        post_json(client, {"instances": good.tolist()}),
        post_json(client, {"instances": [[[0.0] * 3]]}),
        post_json(client, {"instances": good.tolist()}),
    )
    assert [response.status_code for response in responses] == [200, 422, 200]


async def test_health_readiness_and_models(client: httpx.AsyncClient, app: FastAPI) -> None:
    assert (await client.get("/healthz")).json() == {"status": "alive", "engine": "ready"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "model": "digits",
        "version": DIGITS.version,
        "models": [f"digits@{DIGITS.version}"],
        "engines": [{"device": "cpu", "status": "ready", "role": None, "detail": None}],
    }
    models = (await client.get("/models")).json()
    assert models["models"] == [models["loaded"]]
    assert models["loaded"]["memory_bytes"] > 0
    assert models["loaded"]["name"] == "digits"
    assert models["loaded"]["version"] == DIGITS.version
    assert models["loaded"]["device"] == "cpu"
    assert models["loaded"]["manifest"]["metadata"]["test_accuracy"] >= 0.95
    assert DIGITS.version in [version["version"] for version in models["versions"]]

    frontend_of(app).draining = True
    draining = await client.get("/readyz")
    assert draining.status_code == 503
    assert draining.json()["status"] == "draining"


async def test_metrics_expose_every_documented_family(client: httpx.AsyncClient) -> None:
    await post_json(client, {"instances": random_digits(2, seed=0).tolist()})
    await post_json(client, {"instances": []})
    text = (await client.get("/metrics")).text
    for sample in (
        'batchserve_requests_total{route="/predict",status="200"} 1.0',
        'batchserve_requests_total{route="/predict",status="422"} 1.0',
        'batchserve_request_duration_seconds_count{route="/predict",status="200"} 1.0',
        f'batchserve_queue_depth{{model="digits",version="{DIGITS.version}"}} 0.0',
        'batchserve_queue_wait_seconds_count{model="digits"} 1.0',
        'batchserve_batch_size_rows_sum{model="digits"} 2.0',
        'batchserve_inference_duration_seconds_count{model="digits"} 1.0',
        "batchserve_in_flight_requests 0.0",
        "batchserve_ready 1.0",
        'batchserve_model_info{compiled="False",device="cpu",model="digits",precision="fp32",'
        f'version="{DIGITS.version}"}} 1.0',
        'batchserve_device_memory_allocated_bytes{device="cpu"} 0.0',
        f'batchserve_model_memory_bytes{{device="cpu",model="digits",version="{DIGITS.version}"}}',
    ):
        assert sample in text, sample
    assert 'batchserve_process_resident_memory_bytes{role="server"} ' in text
    assert "# TYPE batchserve_dropped_requests_total counter" in text


async def test_unknown_route_is_json_404_with_the_clients_request_id(
    client: httpx.AsyncClient,
) -> None:
    response = await client.get("/nope", headers={"x-request-id": "client-abc.1"})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "code": "not_found",
        "message": "Not Found",
        "request_id": "client-abc.1",
    }
    assert response.headers["x-request-id"] == "client-abc.1"


async def test_a_model_failing_its_hash_check_is_never_served(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    shutil.copytree(BUNDLED_MODEL_REPOSITORY / "digits", repository / "digits")
    artifact = repository / "digits" / DIGITS.version / DIGITS.artifact
    data = bytearray(artifact.read_bytes())
    data[-1] ^= 0xFF
    artifact.write_bytes(bytes(data))
    failures: list[str] = []
    application = create_app(
        make_settings(model_repository=repository), on_load_failure=lambda: failures.append("x")
    )
    manager = await start(application)
    try:
        assert failures == ["x"]
        assert "refusing to load" in (engine_of(application).state.load_error or "")
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["status"] == "failed"
            response = await post_json(http, {"instances": random_digits(1, seed=0).tolist()})
            assert response.status_code == 503
    finally:
        await manager.__aexit__(None, None, None)


async def test_openapi_documents_the_predict_body(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    body = schema["paths"]["/predict"]["post"]["requestBody"]["content"]["application/json"]
    assert "instances" in body["schema"]["properties"]


async def test_the_served_heap_is_frozen_and_a_retired_version_is_still_collected(
    app: FastAPI,
) -> None:
    """Full collections over torch's heap stopped the event loop ~100 ms each under load, so
    what is alive once a version serves is frozen; a version switch must still free the old
    model, even when only the cycle collector can (here a reference cycle through it)."""
    engine = engine_of(app).state
    old = engine.served
    assert old is not None
    tracked = {id(obj) for obj in gc.get_objects()}
    assert gc.get_freeze_count() > 0
    assert id(old.runner._model) not in tracked
    old.runner._model.__dict__["cycle"] = [old.runner._model]
    retired_model = weakref.ref(old.runner._model)
    del old, tracked

    switch_to(engine, await load_version(engine, "digits", DIGITS.version))
    await asyncio.gather(*engine.retiring)
    assert retired_model() is None


@pytest.mark.parametrize("header", ["content-type", "x-priority", "x-request-id"])
async def test_a_header_that_must_appear_once_but_is_repeated_is_refused(
    client: httpx.AsyncClient, header: str
) -> None:
    values = {
        "content-type": ["application/json", "application/x-npy"],
        "x-priority": ["normal", "high"],
        "x-request-id": ["first-id", "second-id"],
    }[header]
    response = await client.post(
        "/predict",
        content=orjson.dumps({"instances": random_digits(1, seed=0).tolist()}),
        headers=[("content-type", "application/json")] * (header != "content-type")
        + [(header, value) for value in values],
    )
    assert response.status_code == 400
    assert f"the {header} header is repeated" in response.json()["error"]["message"]
    assert response.headers["x-request-id"] not in values  # neither copy is trusted


async def test_health_and_readiness_answer_head_requests(client: httpx.AsyncClient) -> None:
    for route in ("/healthz", "/readyz"):
        response = await client.head(route)
        assert response.status_code == 200
        assert response.content == b""


async def test_digits_refuse_pixels_outside_their_declared_range(
    client: httpx.AsyncClient,
) -> None:
    assert DIGITS.input.min_value == 0.0
    assert DIGITS.input.max_value == 1.0
    response = await post_json(client, {"instances": [[[1e38] * 8] * 8]})
    assert response.status_code == 422
    assert "values must lie in [0, 1]" in response.json()["error"]["message"]


async def test_a_front_end_holds_at_most_its_limit_of_requests_slow_uploads_included() -> None:
    from tests.fixtures import predict_scope

    application = create_app(make_settings(max_requests_per_frontend=2))
    manager = await start(application)
    stalled = asyncio.Event()
    try:

        async def never_finishes() -> dict[str, object]:
            await stalled.wait()
            return {"type": "http.disconnect"}

        async def ignore(message: dict[str, object]) -> None:
            pass

        scope = predict_scope([(b"content-type", b"application/json")])
        uploads = [
            asyncio.create_task(application(scope, never_finishes, ignore)) for _ in range(2)
        ]
        await wait_until(lambda: frontend_of(application).receiving == 2)
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            refused = await post_json(http, {"instances": random_digits(1, seed=0).tolist()})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_requests_in_progress"
            assert refused.headers["retry-after"] == "1"
            stalled.set()
            await asyncio.gather(*uploads)
            served = await post_json(http, {"instances": random_digits(1, seed=0).tolist()})
            assert served.status_code == 200
    finally:
        stalled.set()
        await manager.__aexit__(None, None, None)
