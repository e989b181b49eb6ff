"""Faults through the real app: a model that raises, runs out of memory, or hangs; clients that
disconnect; priorities. Each test packages a small model from tests/torch_models.py."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from safetensors.torch import save_file

from service.config import Settings
from service.engine.batcher import DynamicBatcher
from service.manifest import Architecture, TensorSpec
from service.packaging.package import Packager
from service.server.single import create_app
from service.tensors import NamedArrays
from service.types import Array
from tests.apps import engine_of, registry_of
from tests.fixtures import lifespan, predict_scope, sample_total, wait_until
from tests.torch_models import FEATURES, HANG_ENTERED, HANG_RELEASE, HANG_VALUE

PROMPTLY_S = 5.0


def package(repository: Path, architecture: str, **kwargs: Any) -> None:
    """Package a parameterless test model (its behaviour is in code) as model 'fault'."""
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "empty.safetensors"
        save_file({}, str(weights), metadata={"architecture": architecture})
        Packager(repository).package(
            name="fault",
            artifact=weights,
            format="safetensors",
            architecture=Architecture(import_path=architecture, kwargs=kwargs),
            inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
            outputs=(TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES)),),
        )


@asynccontextmanager
async def serving(
    tmp_path: Path,
    architecture: str,
    kwargs: dict[str, Any] | None = None,
    on_stall: Callable[[], None] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    package(tmp_path, architecture, **(kwargs or {}))
    app = create_app(
        Settings(
            model_repository=tmp_path,
            model_name="fault",
            device="cpu",
            warmup_batch_sizes=(1,),
            **settings,
        ),
        on_stall=on_stall,
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield app, client


def rows(value: float, count: int = 1) -> list[list[float]]:
    return [[value] * FEATURES for _ in range(count)]


async def predict(client: httpx.AsyncClient, value: float, **headers: str) -> httpx.Response:
    return await client.post("/predict", json={"instances": rows(value)}, headers=headers)


def sample(app: FastAPI, name: str, labels: dict[str, str] | None = None) -> float:
    return sample_total(registry_of(app), name, labels or {}) or 0.0


def batcher_of(app: FastAPI) -> DynamicBatcher[Array, Array]:
    served = engine_of(app).served
    assert served is not None
    return served.batcher


@pytest.fixture
def hang_released() -> Iterator[None]:
    HANG_RELEASE.clear()
    HANG_ENTERED.clear()
    yield
    HANG_RELEASE.set()


async def test_a_request_the_model_fails_on_gets_500_and_its_batch_mates_succeed(
    tmp_path: Path,
) -> None:
    async with serving(
        tmp_path, "tests.torch_models:RaisesOnNegative", max_wait_ms=100.0, batch_policy="fixed"
    ) as (app, client):
        values = [1.0, 2.0, -1.0, 3.0, 4.0]
        responses = await asyncio.gather(*(predict(client, value) for value in values))
        assert [response.status_code for response in responses] == [200, 200, 500, 200, 200]
        for value, response in zip(values, responses, strict=True):
            if value >= 0:
                assert response.json()["predictions"] == rows(2 * value + 1)
        error = responses[2].json()["error"]
        assert error["code"] == "inference_failed"
        assert error["request_id"] == responses[2].headers["x-request-id"]
        assert "ValueError" in error["message"]
        assert sample(app, "batchserve_batch_failures_total") >= 1
        assert sample(app, "batchserve_batch_size_rows_bucket", {"le": "1.0"}) < len(values)


async def test_out_of_memory_splits_the_batch_and_lowers_the_batch_size(
    tmp_path: Path,
) -> None:
    async with serving(
        tmp_path,
        "tests.torch_models:OutOfMemoryAbove",
        {"max_rows": 2},
        max_wait_ms=100.0,
        batch_policy="fixed",
    ) as (app, client):
        values = [float(value) for value in range(8)]
        responses = await asyncio.gather(*(predict(client, value) for value in values))
        assert [response.status_code for response in responses] == [200] * 8
        for value, response in zip(values, responses, strict=True):
            assert response.json()["predictions"] == rows(2 * value + 1)
        assert sample(app, "batchserve_out_of_memory_total") >= 1
        assert sample(app, "batchserve_effective_max_batch_size") <= 2

        # Batches stay capped: the next burst never tries more than two rows at once.
        failures_before = sample(app, "batchserve_out_of_memory_total")
        responses = await asyncio.gather(*(predict(client, value) for value in values))
        assert [response.status_code for response in responses] == [200] * 8
        assert sample(app, "batchserve_out_of_memory_total") == failures_before

        # One request too large for the device even alone: 503 with Retry-After.
        too_big = await client.post("/predict", json={"instances": rows(1.0, count=3)})
        assert too_big.status_code == 503
        assert too_big.json()["error"]["code"] == "out_of_device_memory"
        assert "Retry-After" in too_big.headers


async def test_a_hung_model_times_out_requests_and_turns_unhealthy(
    tmp_path: Path, hang_released: None
) -> None:
    stalls: list[str] = []
    async with serving(
        tmp_path,
        "tests.torch_models:HangsOnValue",
        on_stall=lambda: stalls.append("stalled"),
        request_timeout_ms=400.0,
        stall_timeout_s=0.2,
    ) as (app, client):
        assert (await client.get("/healthz")).status_code == 200
        async with asyncio.timeout(PROMPTLY_S):
            hung = await predict(client, HANG_VALUE)
        assert hung.status_code == 504
        assert hung.json()["error"]["code"] == "deadline_exceeded"
        assert stalls == ["stalled"]
        health = await client.get("/healthz")
        assert health.status_code == 503
        assert health.json() == {"status": "stalled", "engine": "stalled"}
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "stalled"
        refused = await predict(client, 1.0)
        assert refused.status_code == 503
        assert sample(app, "batchserve_ready") == 0
        HANG_RELEASE.set()  # let the stuck thread finish so shutdown can complete


async def test_a_client_that_disconnects_while_queued_is_never_computed(
    tmp_path: Path, hang_released: None
) -> None:
    async with serving(tmp_path, "tests.torch_models:HangsOnValue", stall_timeout_s=0.0) as (
        app,
        client,
    ):
        batcher = batcher_of(app)
        blocker = asyncio.create_task(predict(client, HANG_VALUE))  # holds the device
        await wait_until(HANG_ENTERED.is_set)

        disconnect = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if not sent:
                sent.append({})
                body = orjson.dumps({"instances": rows(5.0)})
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        responses: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            responses.append(message)

        scope = predict_scope([(b"content-type", b"application/json")])
        leaving = asyncio.create_task(app(scope, receive, send))
        await wait_until(lambda: batcher.queue_depth == 1)
        disconnect.set()
        async with asyncio.timeout(PROMPTLY_S):
            await leaving
        assert responses == [], "nobody is left to answer"
        assert batcher.queue_depth == 0
        assert sample(app, "batchserve_dropped_requests_total", {"reason": "cancelled"}) == 1

        HANG_RELEASE.set()
        async with asyncio.timeout(PROMPTLY_S):
            assert (await blocker).status_code == 200
        # The front end writes its request counts once it is idle (request_metrics).
        left = {"route": "/predict", "status": "499"}
        await wait_until(lambda: sample(app, "batchserve_requests_total", left) == 1)
        # Only the blocker's row was ever computed: one batch of one row.
        assert sample(app, "batchserve_batch_size_rows_sum") == 1


async def loop_turns(count: int = 20) -> None:
    """Let the event loop run ``count`` turns: what a disconnect sets off takes a few, and no
    real time passes (a timer the server armed does not fire)."""
    for _ in range(count):
        await asyncio.sleep(0)


async def test_clients_that_leave_stop_counting_as_queued_work_at_once(
    tmp_path: Path, hang_released: None
) -> None:
    """Issue 35.6: clients that send and leave must not hold the queue, nor the work that
    admission counts ahead of the next request, until the collector reaches them (or until a
    watch started late notices): their requests are withdrawn as they leave, and the next
    request is admitted."""
    async with serving(
        tmp_path, "tests.torch_models:HangsOnValue", request_timeout_ms=2_500, stall_timeout_s=0.0
    ) as (app, client):
        batcher = batcher_of(app)
        served = engine_of(app).served
        assert served is not None
        group, _ = served.group_of(NamedArrays({"x": np.zeros((1, FEATURES), np.float32)}))
        blocker = asyncio.create_task(predict(client, HANG_VALUE))  # holds the device
        await wait_until(lambda: sample(app, "batchserve_batch_size_rows_count") == 1)

        def slow_device() -> None:  # each row now takes 1 s by the recent durations
            batcher.times.record(group, 1, 1.0)

        disconnect = asyncio.Event()

        async def leaving_client(value: float) -> list[dict[str, Any]]:
            body = orjson.dumps({"instances": rows(value)})
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await disconnect.wait()
                return {"type": "http.disconnect"}

            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            await app(predict_scope([(b"content-type", b"application/json")]), receive, send)
            return sent

        slow_device()
        leaving = [asyncio.create_task(leaving_client(value)) for value in (2.0, 3.0)]
        await wait_until(lambda: batcher.queue_depth == 2)
        slow_device()
        assert batcher.estimated_wait_s() >= 2.0
        refused = await predict(client, 4.0)  # 2 s queued ahead + its own 1 s > 2.5 s
        assert refused.status_code == 429, refused.text

        disconnect.set()
        await loop_turns()
        assert batcher.queue_depth == 0, "the clients left: their requests are not queued work"
        slow_device()
        assert batcher.estimated_wait_s() < 1.0
        admitted = asyncio.create_task(predict(client, 5.0))
        await wait_until(lambda: batcher.queue_depth == 1 or admitted.done())
        assert not admitted.done(), admitted.result().text  # queued, not refused

        async with asyncio.timeout(PROMPTLY_S):
            assert await asyncio.gather(*leaving) == [[], []], "nobody is left to answer"
            HANG_RELEASE.set()
            assert (await blocker).status_code == 200
            answer = await admitted
        assert answer.status_code == 200
        assert answer.json()["predictions"] == rows(2 * 5.0 + 1)
        assert sample(app, "batchserve_dropped_requests_total", {"reason": "cancelled"}) == 2
        # The leaving clients' rows were never computed: the blocker's, then the admitted one.
        assert sample(app, "batchserve_batch_size_rows_sum") == 2


async def test_high_priority_requests_run_before_waiting_normal_ones(
    tmp_path: Path, hang_released: None
) -> None:
    async with serving(
        tmp_path, "tests.torch_models:HangsOnValue", max_batch_size=1, stall_timeout_s=0.0
    ) as (app, client):
        batcher = batcher_of(app)
        finished: list[str] = []

        async def tracked(name: str, value: float, priority: str) -> None:
            response = await predict(client, value, **{"X-Priority": priority})
            assert response.status_code == 200
            finished.append(name)

        blocker = asyncio.create_task(predict(client, HANG_VALUE))
        await wait_until(HANG_ENTERED.is_set)
        tasks = [asyncio.create_task(tracked(f"normal{i}", i, "normal")) for i in range(2)]
        await wait_until(lambda: batcher.queue_depth == 2)  # both queued before the high one
        tasks.append(asyncio.create_task(tracked("high", 9.0, "high")))
        await wait_until(lambda: batcher.queue_depth == 3)
        HANG_RELEASE.set()
        async with asyncio.timeout(PROMPTLY_S):
            await asyncio.gather(blocker, *tasks)
        assert finished[0] == "high"


async def test_an_unknown_priority_is_refused(tmp_path: Path) -> None:
    async with serving(tmp_path, "tests.torch_models:RaisesOnNegative") as (_, client):
        response = await predict(client, 1.0, **{"X-Priority": "urgent"})
        assert response.status_code == 422
        assert "X-Priority must be 'high' or 'normal'" in response.json()["error"]["message"]


async def test_non_finite_outputs_fail_only_their_request_never_200_with_nulls(
    tmp_path: Path,
) -> None:
    async with serving(
        tmp_path, "tests.torch_models:OverflowsOnSeven", max_wait_ms=100.0, batch_policy="fixed"
    ) as (app, client):
        values = [1.0, 7.0, 2.0]
        responses = await asyncio.gather(*(predict(client, value) for value in values))
        assert [response.status_code for response in responses] == [200, 500, 200]
        assert responses[0].json()["predictions"] == rows(3.0)
        assert responses[2].json()["predictions"] == rows(5.0)
        error = responses[1].json()["error"]
        assert error["code"] == "inference_failed"
        assert "not finite" in error["message"]
        assert sample(app, "batchserve_batch_size_rows_count") == 1, "one batch, no retries"
