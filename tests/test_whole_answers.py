"""An inference answer written in one call (``answer_writing.send_answer`` to the server's
``answers.AnswerCycle.send_whole``) is the same bytes as Starlette's ``Response`` sent
through uvicorn's ``send``: the same requests, over real sockets to a real front end served
as batchserve serves it, are answered byte for byte alike by three paths.

- ``whole``: as served (``send_whole``);
- ``messages``: ``send`` wrapped, so the middleware sends the two ASGI messages itself
  (what a test's or a tracing wrapper's ``send`` gets);
- ``starlette``: the middleware's general path (``sends_whole`` false): the ``Response``
  called with the send wrapper that adds the request id, as before ``send_answer``.

Only the ``date`` header's value (the server's clock) and generated request ids are masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from service.bridge.interface import InferenceRequest, InferenceResult, ModelInfo
from service.config import Settings
from service.errors import QueueFullError
from service.frontend import middleware
from service.frontend.answer_writing import WholeAnswerWriter, send_answer
from service.frontend.app import create_frontend_app
from service.frontend.responses import PreparedResponse
from service.frontend.state import FrontendState
from service.manifest import Architecture, Manifest, TensorSpec
from service.metrics import FrontendMetrics, ProcessMetrics
from service.repository import ModelRepository
from service.server.answers import JOINED_BODY_BYTES
from service.server.draining import uvicorn_config
from service.server.tuning.ceiling import ZeroEngine
from tests.fixtures import uvicorn_port

FEATURES = 4
#: Wide enough that 16 instances' answer is over ``JOINED_BODY_BYTES`` (head and body then
#: go out in two writes) and one instance's under it.
CLASSES = 8192
#: An instance whose first feature is this is refused 429 by the engine (queue full).
REFUSED = 429.0
#: How long a connection's answers may take before the server closes it.
EXCHANGE_S = 10.0


class EngineAnsweringZerosOrQueueFull(ZeroEngine):
    """The HTTP ceiling's engine (zeros of the model's output shape), which refuses an
    instance starting with ``REFUSED`` with ``QueueFullError`` (429, ``Retry-After``)."""

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        features = next(iter(request.instances.arrays.values()))
        if features[0, 0] == REFUSED:
            raise QueueFullError("the model's queue is full; retry shortly", retry_after_s=3)
        return await super().infer(request)


def wide_model() -> ModelInfo:
    manifest = Manifest.create(
        name="wide",
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64},
        architecture=Architecture(import_path="service.models.mlp:PeerMLP"),
        inputs=(TensorSpec(name="features", dtype="float32", shape=(-1, FEATURES)),),
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, CLASSES)),),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return ModelInfo(manifest, "cpu", "fp32", False, length_edges=())


def frontend_app(folder: Path) -> FastAPI:
    registry = CollectorRegistry()
    frontend = FrontendState(
        settings=Settings(model_repository=folder, max_body_bytes=64 * 1024),
        metrics=FrontendMetrics(registry),
        process_metrics=ProcessMetrics("frontend", registry),
        registry=registry,
        engine=EngineAnsweringZerosOrQueueFull(wide_model()),
        repository=ModelRepository(folder),
        engine_in_process=False,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield

    return create_frontend_app(frontend, lifespan)


def with_wrapped_send(app: FastAPI) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``app`` given a ``send`` that is no server's response cycle."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def passing(message: Message) -> None:
            await send(message)

        await app(scope, receive, passing)

    return wrapped


@contextlib.asynccontextmanager
async def serving(app: Any, headers: list[tuple[str, str]] | None = None) -> AsyncIterator[int]:
    """The port of uvicorn serving ``app`` as ``batchserve serve`` configures it (one
    process: ``draining.uvicorn_config``, whose protocol gunicorn's workers use too), with
    ``headers`` added to every answer."""
    config = uvicorn_config(app, Settings(port=1))
    config.headers = headers or []
    # Longer than ``exchange`` waits: a connection the server should close must be closed
    # by the answer, not by the keep-alive timeout.
    config.port, config.lifespan, config.timeout_keep_alive = 0, "off", 60
    async with uvicorn_port(config) as port:
        yield port


def post(
    path: str,
    body: bytes,
    *headers: str,
    request_id: str | None = "req-1",
    version: bytes = b"1.1",
    content_type: str = "application/json",
) -> bytes:
    lines = [f"POST {path} HTTP/{version.decode()}", "host: x", f"content-length: {len(body)}"]
    lines += [f"content-type: {content_type}", *headers]
    if request_id is not None:
        lines.append(f"x-request-id: {request_id}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def instances(rows: int, first: float = 0.5) -> bytes:
    return orjson.dumps({"instances": [[first] + [0.25] * (FEATURES - 1)] * rows})


CLOSE = "connection: close"
V2_INFER = orjson.dumps(
    {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [0.5] * 4}]}
)
#: One keep-alive connection, pipelined: every kind of inference answer, then a FastAPI route
#: and a last request that closes.
PIPELINED = b"".join(
    [
        post("/predict", instances(1)),
        post("/predict", instances(1), request_id=None),
        post("/predict", instances(1), "accept: application/x-npy", request_id="npy-2"),
        post("/predict", instances(16), request_id="large-3"),
        post("/predict", b'{"instances": [[1, 2]]}', request_id="bad-4"),
        post("/predict", b"{", request_id="bad-json-5"),
        post("/predict", instances(1, REFUSED), request_id="full-6"),
        post("/models/nope/predict", instances(1), request_id="unknown-7"),
        post("/v2/models/wide/infer", b'{"inputs": []}', request_id="v2-8"),
        post("/v2/models/wide/infer", V2_INFER, request_id="v2-ok-9"),
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-request-id: health-9\r\n\r\n",
        b"HEAD /predict HTTP/1.1\r\nhost: x\r\nx-request-id: head-10\r\n\r\n",
        b"GET /models HTTP/1.1\r\nhost: x\r\n\r\n",
        post("/predict", instances(1), CLOSE, request_id="last-11"),
    ]
)
#: Connections of one request each, the server closing them.
SINGLES = [
    post("/predict", instances(1), version=b"1.0", request_id="http10-1"),
    post("/predict", b"x" * (64 * 1024 + 1), request_id="too-large-2"),
    post("/predict", instances(1), CLOSE, request_id="media-3", content_type="text/plain"),
    post("/predict", instances(1, REFUSED), CLOSE, request_id="full-close-4"),
]


async def exchange(port: int, request: bytes, expect_continue: bool = False) -> bytes:
    """Everything the server sends back to ``request`` until it closes the connection; with
    ``expect_continue``, the body is sent after the server's ``100 Continue``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if expect_continue:
            head, _, body = request.partition(b"\r\n\r\n")
            writer.write(head + b"\r\nexpect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), EXCHANGE_S)
            writer.write(body)
            return interim + await asyncio.wait_for(reader.read(), timeout=EXCHANGE_S)
        writer.write(request)
        return await asyncio.wait_for(reader.read(), timeout=EXCHANGE_S)
    finally:
        writer.close()


def masked(answers: bytes) -> bytes:
    """``answers`` with the server's clock and generated request ids replaced."""
    answers = re.sub(rb"\r\ndate: [^\r]*\r\n", b"\r\ndate: (date)\r\n", answers)
    return re.sub(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", b"\r\nx-request-id: (id)\r\n", answers)


async def answers_to_all(app: Any, frontend: FrontendState) -> list[bytes]:
    """What each connection of the scenario got back, masked."""
    got: list[bytes] = []
    async with serving(app) as port:
        got.append(await exchange(port, PIPELINED))
        for request in SINGLES:
            got.append(await exchange(port, request))
        got.append(await exchange(port, post("/predict", instances(1), CLOSE), True))
        frontend.draining = True
        try:
            got.append(await exchange(port, post("/predict", instances(1))))
            got.append(await exchange(port, post("/predict", instances(1, REFUSED))))
            got.append(await exchange(port, post("/predict", b"x" * (64 * 1024 + 1))))
        finally:
            frontend.draining = False
    return [masked(answer) for answer in got]


async def test_whole_answers_are_the_bytes_of_starlettes_responses_through_uvicorn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = frontend_app(tmp_path)
    frontend: FrontendState = app.state.frontend
    whole = await answers_to_all(app, frontend)
    messages = await answers_to_all(with_wrapped_send(app), frontend)
    monkeypatch.setattr(middleware, "sends_whole", lambda response: False)
    starlette = await answers_to_all(app, frontend)
    assert whole == starlette
    assert messages == starlette
    pipelined = starlette[0]
    # The scenario is what it claims: each request answered, the kinds of answers there.
    assert pipelined.count(b"HTTP/1.1 ") == PIPELINED.count(b" HTTP/1.1\r\n")
    for status in (b"200 OK", b"400 Bad Request", b"404 Not Found", b"429 Too Many Requests"):
        assert b"HTTP/1.1 " + status + b"\r\n" in pipelined
    assert b"\r\nretry-after: 3\r\n" in pipelined
    assert b"\r\nx-request-id: (id)\r\n" in pipelined
    large = re.search(rb"content-length: (\d+)\r\n[^\r]*\r\nx-request-id: large-3", pipelined)
    assert large is not None
    assert int(large[1]) > JOINED_BODY_BYTES
    assert pipelined.endswith(b"}")
    assert b"\r\nconnection: close\r\n" in pipelined
    _, http10, too_large, media, full_close, continued, *drained = starlette
    assert b"\r\nconnection: close\r\n" in http10
    assert too_large.startswith(b"HTTP/1.1 413 ")
    assert media.startswith(b"HTTP/1.1 415 ")
    assert full_close.startswith(b"HTTP/1.1 429 ")
    assert continued.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    for answer in drained:
        assert answer.count(b"\r\nconnection: close\r\n") == 1


async def test_the_served_apps_send_writes_whole_answers(tmp_path: Path) -> None:
    """batchserve's protocol hands the app a ``send`` whose cycle takes whole answers (else
    ``send_answer`` would always send messages, and the test above compare one path twice)."""
    sends: list[Send] = []

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        sends.append(send)
        start = {"type": "http.response.start", "status": 204, "headers": []}
        await send(start)
        await send({"type": "http.response.body", "body": b""})

    async with serving(recording) as port:
        answer = await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 204 No Content\r\n")
    assert isinstance(getattr(sends[0], "__self__", None), WholeAnswerWriter)


#: Answers the front end does not send through ``send_answer`` today, which its writer must
#: still write as uvicorn would: no ``content-length`` (204, 304; chunked otherwise), a length
#: the body does not fill (uvicorn logs an error and closes the connection), a header value
#: with a line feed (refused), each for ``GET`` and ``HEAD``.
ODD_ANSWERS = {
    "json": PreparedResponse(b'{"a":1}', [(b"content-length", b"7"), (b"content-type", b"x/y")]),
    "empty": PreparedResponse(b"", [(b"content-length", b"0")]),
    "no-content": PreparedResponse(b"", [], status_code=204),
    "not-modified": PreparedResponse(b"", [(b"etag", b'"1"')], status_code=304),
    "short": PreparedResponse(b"abc", [(b"content-length", b"5")]),
    "unsized": PreparedResponse(b"abc", [(b"content-type", b"x/y")]),
    "mixed-case": PreparedResponse(b"ab", [(b"Content-Length", b"2"), (b"X-Thing", b"1")]),
    "refused": Response(b"ab", headers={"x-thing": "a\nb"}),
    "checked": Response(b"ab", headers={"x-thing": "a b"}),
}


async def answering_odd_answers(scope: Scope, receive: Receive, send: Send) -> None:
    """``/whole/NAME`` answers ``ODD_ANSWERS[NAME]`` through ``send_answer``, ``/general/NAME``
    the same headers and body as two ASGI messages to uvicorn's ``send``."""
    if scope["type"] != "http":
        return
    _, way, name = scope["path"].split("/")
    response = ODD_ANSWERS[name]
    if way == "whole":
        await send_answer(response, "id-1", False, send)
        return
    headers = [*response.raw_headers, (b"x-request-id", b"id-1")]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("name", sorted(ODD_ANSWERS))
async def test_the_whole_answer_writer_writes_any_answer_as_uvicorn(
    name: str, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    got = []
    async with serving(answering_odd_answers) as port:
        for way in ("whole", "general"):
            request = f"{method} /{way}/{name} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            got.append(masked(await exchange(port, request.encode())))
    assert got[0] == got[1]
    if name == "refused":
        assert got[0] == b""
        assert errors_logged(caplog) == ["Invalid HTTP header value."] * 2
    if name == "short" and method == "GET":
        assert errors_logged(caplog) == ["Response content shorter than Content-Length"] * 2


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [str(record.exc_info[1]) for record in caplog.records if record.exc_info]


async def test_a_servers_own_headers_are_checked_on_whole_answers_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got = []
    async with serving(answering_odd_answers, [("x-configured", "a\x01b")]) as port:
        for way in ("whole", "general"):
            request = f"GET /{way}/json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            got.append(await exchange(port, request.encode()))
    assert got == [b"", b""]
    assert errors_logged(caplog) == ["Invalid HTTP header value."] * 2
