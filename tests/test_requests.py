"""The one request path every entry point shares (``service/frontend/requests.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from starlette.types import Message, Scope

from service.bridge.interface import (
    EngineStatus,
    InferenceRequest,
    InferenceResult,
    ModelInfo,
    SwitchResult,
)
from service.config import Settings
from service.errors import DeadlineExceededError, QueueFullError, ServiceError
from service.frontend.app import create_frontend_app
from service.frontend.middleware import request_id_of
from service.frontend.requests import (
    SERVER_TIMEOUT,
    ClientDisconnectedError,
    Deadline,
    DisconnectWatcher,
    HeldRequest,
)
from service.frontend.state import FrontendState
from service.manifest import Architecture, Manifest, TensorSpec
from service.repository import ModelRepository
from service.tensors import NamedArrays
from service.types import Priority

SETTINGS = Settings(request_timeout_ms=2000)


def test_the_deadline_is_request_timeout_ms_from_arrival() -> None:
    deadline = Deadline.start(SETTINGS, now_s=100.0)
    assert deadline == Deadline(102.0, 2000, SERVER_TIMEOUT)


def test_a_client_limit_shortens_the_deadline_only_when_it_ends_sooner() -> None:
    deadline = Deadline.start(SETTINGS, now_s=100.0)
    sooner = deadline.sooner(0.05, "the call's gRPC deadline", now_s=100.5)
    assert sooner == Deadline(100.55, 50.0, "the call's gRPC deadline")
    assert deadline.sooner(5.0, "the call's gRPC deadline", now_s=100.5) is deadline
    assert deadline.sooner(None, "the call's gRPC deadline") is deadline


def test_the_504_names_the_limit_that_applied_and_keeps_why() -> None:
    """The engine knows only ``request_timeout_ms``; the answer names the client's limit."""
    shortened = Deadline(100.05, 50.0, "the request's 'timeout' parameter")
    late = shortened.exceeded(DeadlineExceededError("the request was not answered within 2000 ms"))
    assert late.message == (
        "the request was not answered within 50 ms (the request's 'timeout' parameter)"
    )
    unreachable = shortened.exceeded(
        DeadlineExceededError(
            "the request could not be answered within 2000 ms: its rows would take about 90 ms"
        )
    )
    assert unreachable.message.endswith("(the request's 'timeout' parameter): its rows would "
                                        "take about 90 ms")  # fmt: skip
    assert unreachable.status_code == 504


class EngineAnsweringLate:
    """An engine that answers every request 504, as the engine does past its deadline, and
    keeps what it was asked."""

    def __init__(self, model: ModelInfo | None = None) -> None:
        self.requests: list[InferenceRequest] = []
        self.refusal: ServiceError | None = None
        self.asked: list[tuple[str, Priority, float | None]] = []
        self._models = () if model is None else (model,)

    def status(self) -> EngineStatus:
        return EngineStatus(phase="ready", models=self._models)

    def engines(self) -> list[EngineStatus]:
        return [self.status()]

    def refusal_before_body(
        self, model: str, version: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        left_s = None if deadline_s is None else deadline_s - time.monotonic()
        self.asked.append((model, priority, left_s))
        return self.refusal

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        self.requests.append(request)
        raise DeadlineExceededError("the request was not answered within 2000 ms")

    async def switch(self, name: str, version: str) -> SwitchResult:
        raise NotImplementedError

    async def rollback(self, name: str | None = None) -> SwitchResult:
        raise NotImplementedError

    async def unload(self, name: str) -> str:
        raise NotImplementedError


def frontend_with(engine: EngineAnsweringLate, tmp_path: Path) -> FrontendState:
    return FrontendState.over(engine, SETTINGS, repository=ModelRepository(tmp_path))


def tokens_model() -> ModelInfo:
    manifest = Manifest.create(
        name="tokens",
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64},
        architecture=Architecture(import_path="service.models.mlp:PeerMLP"),
        inputs=(TensorSpec(name="ids", dtype="int64", shape=(-1, -1)),),
        outputs=(TensorSpec(name="out", dtype="float32", shape=(-1, 2)),),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return ModelInfo(manifest, "cpu", "fp32", False, length_edges=(8, 16))


async def test_a_held_request_reaches_the_engine_counted_and_with_its_deadline(
    tmp_path: Path,
) -> None:
    engine = EngineAnsweringLate()
    frontend = frontend_with(engine, tmp_path)
    deadline = Deadline(123.0, 50.0, "the call's gRPC deadline")
    instances = NamedArrays({"ids": np.ones((3, 10), np.int64)})
    with HeldRequest(frontend, deadline, "r-1") as held:
        assert frontend.holding == 1
        with pytest.raises(DeadlineExceededError, match=r"within 50 ms \(the call's gRPC"):
            await held.infer(tokens_model(), instances, "high")
    assert frontend.holding == 0
    (request,) = engine.requests
    assert (request.model, request.priority, request.request_id) == ("tokens", "high", "r-1")
    assert request.deadline_s == 123.0
    assert request.frontend_load == 1


async def test_a_v2_timeout_sets_the_deadline_and_its_504_names_it(tmp_path: Path) -> None:
    engine = EngineAnsweringLate(tokens_model())
    app = create_frontend_app(frontend_with(engine, tmp_path), no_lifespan)
    document = {
        "parameters": {"timeout": 50_000},
        "inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}],
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        started_s = time.monotonic()
        answer = await http.post("/v2/models/tokens/infer", json=document)
        plain = await http.post("/v2/models/tokens/infer", json={"inputs": document["inputs"]})
    assert answer.status_code == 504
    assert answer.json()["error"] == (
        "the request was not answered within 50 ms (the request's 'timeout' parameter)"
    )
    first, second = engine.requests
    assert started_s < first.deadline_s <= time.monotonic() + 0.05
    assert plain.json()["error"].endswith("within 2000 ms (request_timeout_ms)")
    assert second.deadline_s > first.deadline_s + 1.0


@contextlib.asynccontextmanager
async def no_lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield


async def post(http: httpx.AsyncClient, route: str, body: bytes) -> httpx.Response:
    return await http.post(route, content=body, headers={"Content-Type": "application/json"})


async def test_a_full_queue_refuses_before_the_body_is_parsed(tmp_path: Path) -> None:
    """A storm of requests a full queue refuses must not cost their parse (issue 23): the
    refusal comes before the body is read, so even a malformed body is answered 429."""
    engine = EngineAnsweringLate(tokens_model())
    app = create_frontend_app(frontend_with(engine, tmp_path), no_lifespan)
    malformed = b'{"instances": [[1, 2,'
    routes = ("/predict", "/models/tokens/predict", "/v2/models/tokens/infer")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        engine.refusal = QueueFullError("the queue is full (8 requests waiting); retry shortly")
        refused = [await post(http, route, malformed) for route in routes]
        engine.refusal = None
        parsed = [await post(http, route, malformed) for route in routes]
    for answer in refused:
        assert answer.status_code == 429, answer.text
        assert "the queue is full" in answer.text
        assert int(answer.headers["Retry-After"]) >= 1
    assert [answer.status_code for answer in parsed] == [400, 400, 400]
    assert engine.requests == []
    # /predict's deadline and priority are known before its body (time left when asked); a
    # V2 body may set its own.
    predict, _, v2 = engine.asked[:3]
    assert predict[:2] == ("tokens", "normal")
    assert predict[2] == pytest.approx(SETTINGS.request_timeout_ms / 1000, abs=0.5)
    assert v2 == ("tokens", "normal", None)


async def asgi_post(app: FastAPI, path: str, body: bytes) -> int:
    """``app``'s status for a JSON ``POST`` of ``body``, called as a server calls it (no
    client library whose own objects the garbage collector would find)."""
    messages: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }
    await app(scope, receive, send)
    return int(sent[0]["status"])


@pytest.mark.parametrize("route", ["/predict", "/v2/models/tokens/infer"])
@pytest.mark.parametrize("refused", [True, False], ids=["refused-429", "late-504"])
async def test_an_error_answer_leaves_no_garbage_for_the_collector(
    tmp_path: Path, route: str, refused: bool
) -> None:
    """An error raised from a frame that holds it is a reference cycle (the exception, its
    traceback, every frame and what they hold); in a storm of refusals the collections that
    freed them paused the event loop for 7-34 ms (issue 23). Answered, they are freed at once."""
    engine = EngineAnsweringLate(tokens_model())
    app = create_frontend_app(frontend_with(engine, tmp_path), no_lifespan)
    body = b'{"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}]}'
    if route == "/predict":
        body = b'{"instances": [[1, 2, 3]]}'
    expected = 429 if refused else 504
    for _ in range(2):  # caches and lazily built parts made once
        engine.refusal = QueueFullError("the queue is full; retry shortly") if refused else None
        assert await asgi_post(app, route, body) == expected
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(10):
            engine.refusal = QueueFullError("the queue is full; retry shortly") if refused else None
            assert await asgi_post(app, route, body) == expected
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def test_a_request_id_is_the_clients_one_plain_token_else_a_fresh_one() -> None:
    ids = random.Random()

    def of(*values: bytes) -> str:
        headers = [(b"host", b"x"), *((b"x-request-id", value) for value in values)]
        return request_id_of({"headers": headers}, ids)

    assert of(b"abc-1.2_X") == "abc-1.2_X"
    for refused in ((b"a b",), (b"x" * 65,), (b"",), (b"one", b"two"), (b"\xe9",)):
        fresh = of(*refused)
        assert re.fullmatch(r"[0-9a-f]{32}", fresh), fresh
    random.seed(0)  # a seeded global generator does not make ids repeat
    fresh_ids = {of() for _ in range(2000)}
    assert len(fresh_ids) == 2000
    assert all(re.fullmatch(r"[0-9a-f]{32}", value) for value in fresh_ids)
    assert any(value.startswith("0") for value in fresh_ids)  # zero-padded to 32 digits


async def test_a_disconnect_cancels_the_wait_at_once_not_when_a_timer_says() -> None:
    """The watch starts with the wait: a client that leaves is noticed within a few turns of
    the event loop, whether or not it has waited long (issue 35: clients that sent and left at
    once held the queue)."""
    left = asyncio.Event()

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    async def waiting() -> None:
        with DisconnectWatcher(receive):
            await asyncio.Event().wait()  # an answer that never comes

    waiter = asyncio.create_task(waiting())
    await asyncio.sleep(0)
    left.set()
    for _ in range(10):  # turns of the loop, no real time: no timer fires meanwhile
        await asyncio.sleep(0)
    assert waiter.done()
    with pytest.raises(ClientDisconnectedError):
        waiter.result()


async def test_a_watch_ends_with_the_wait_and_leaves_the_caller_uncancelled() -> None:
    received: list[str] = []

    async def receive() -> Message:
        received.append("asked")
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    with DisconnectWatcher(receive) as watcher:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert received == ["asked"]
    assert not watcher.disconnected
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
