"""What goes on the wire for every kind of answer, byte for byte: the same requests, over real
sockets to a front end served as batchserve serves it (``draining.uvicorn_config``, whose
protocol gunicorn's workers use too), are answered exactly as by uvicorn's own httptools
protocol without the head limits in front of it, and each kind of answer is what it should
be: status lines, headers in order, the request id, ``connection: close`` while draining, 429
with ``Retry-After``, 413 closing, HTTP/1.0, ``Expect: 100-continue``, pipelined keep-alive,
``HEAD``.

Only the ``date`` header's value (the server's clock) and generated request ids are masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI

from service.bridge.interface import InferenceRequest, InferenceResult, ModelInfo
from service.config import Settings
from service.errors import QueueFullError
from service.frontend.app import create_frontend_app
from service.frontend.state import FrontendState
from service.manifest import Architecture, Manifest, TensorSpec
from service.server.draining import uvicorn_config
from service.server.tuning.ceiling import ZeroEngine
from tests.fixtures import uvicorn_port

FEATURES = 4
#: Wide enough that 16 instances' answer (over half a megabyte) outgrows a socket's buffer.
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


VERSION = wide_model().manifest.version


def frontend_app(folder: Path) -> FastAPI:
    frontend = FrontendState.over(
        EngineAnsweringZerosOrQueueFull(wide_model()),
        Settings(model_repository=folder, max_body_bytes=64 * 1024),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield

    return create_frontend_app(frontend, lifespan)


@contextlib.asynccontextmanager
async def serving(app: Any, limited: bool = True) -> AsyncIterator[int]:
    """The port of uvicorn serving ``app`` as ``batchserve serve`` configures it, or, unless
    ``limited``, with uvicorn's own httptools protocol in place of the head limits."""
    config = uvicorn_config(app, Settings(port=1))
    if not limited:
        config.http = "httptools"
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


async def answers_to_all(app: Any, frontend: FrontendState, limited: bool) -> list[bytes]:
    """What each connection of the scenario got back, masked."""
    got: list[bytes] = []
    async with serving(app, limited) as port:
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


def answer_of(answers: bytes, request_id: bytes) -> bytes:
    """The answer carrying ``request_id`` among pipelined ``answers``: its status line to the
    end of its body (the next status line, or the end)."""
    starts = [match.start() for match in re.finditer(rb"HTTP/1\.1 \d{3} ", answers)]
    for start, end in zip(starts, [*starts[1:], len(answers)], strict=True):
        if b"\r\nx-request-id: " + request_id + b"\r\n" in answers[start:end]:
            return answers[start:end]
    raise AssertionError(f"no answer with request id {request_id!r}")


async def test_every_answer_is_the_bytes_uvicorn_writes_and_what_it_should_be(
    tmp_path: Path,
) -> None:
    app = frontend_app(tmp_path)
    frontend: FrontendState = app.state.frontend
    served = await answers_to_all(app, frontend, limited=True)
    uvicorns = await answers_to_all(app, frontend, limited=False)
    assert served == uvicorns

    pipelined = served[0]
    # The scenario is what it claims: each request answered, the kinds of answers there.
    assert pipelined.count(b"HTTP/1.1 ") == PIPELINED.count(b" HTTP/1.1\r\n")
    for status in (b"200 OK", b"400 Bad Request", b"404 Not Found", b"429 Too Many Requests"):
        assert b"HTTP/1.1 " + status + b"\r\n" in pipelined
    assert b"\r\nx-request-id: (id)\r\n" in pipelined
    assert pipelined.endswith(b"}")
    body = orjson.dumps({"model": "wide", "version": VERSION, "predictions": [[0.0] * CLASSES]})
    assert answer_of(pipelined, b"req-1") == (
        b"HTTP/1.1 200 OK\r\ndate: (date)\r\nx-model-version: wide@"
        + VERSION.encode()
        + b"\r\ncontent-length: %d\r\ncontent-type: application/json\r\n" % len(body)
        + b"x-request-id: req-1\r\n\r\n"
        + body
    )
    refused = orjson.dumps(
        {
            "error": {
                "code": "queue_full",
                "message": "the model's queue is full; retry shortly",
                "request_id": "full-6",
            }
        }
    )
    assert answer_of(pipelined, b"full-6") == (
        b"HTTP/1.1 429 Too Many Requests\r\ndate: (date)\r\nretry-after: 3\r\n"
        + b"content-length: %d\r\ncontent-type: application/json\r\n" % len(refused)
        + b"x-request-id: full-6\r\n\r\n"
        + refused
    )
    assert answer_of(pipelined, b"head-10").startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    assert answer_of(pipelined, b"head-10").endswith(b"\r\n\r\n")  # HEAD: no body
    last = answer_of(pipelined, b"last-11")
    assert b"\r\nconnection: close\r\n" in last

    _, http10, too_large, media, full_close, continued, *drained = served
    assert b"\r\nconnection: close\r\n" in http10
    assert too_large.startswith(b"HTTP/1.1 413 ")
    assert b"\r\nconnection: close\r\n" in too_large
    assert media.startswith(b"HTTP/1.1 415 ")
    assert full_close.startswith(b"HTTP/1.1 429 ")
    assert continued.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    for answer in drained:
        assert answer.count(b"\r\nconnection: close\r\n") == 1
        assert answer.endswith(b"}")
