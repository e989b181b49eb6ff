"""The access log (issue 37.4): one JSON line per request on ``batchserve.access`` while
``access_log`` is on, none while it is off; in one process and with two front ends, over HTTP
and gRPC. And library loggers kept at their own level, so ``debug`` is the service's."""

from __future__ import annotations

import logging
import logging.config
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc_client
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service import tracing
from service.config import Settings
from service.logs import configure_logging
from service.server.gunicorn_setup import logging_config
from service.server.single import create_app
from tests.fixtures import lifespan
from tests.processes import (
    BATCHSERVE,
    Running,
    batchserve_environment,
    free_port,
    running,
    wait_for,
    wait_until_serving,
)

ACCESS_LOGGER = "batchserve.access"
DIGIT = np.linspace(0.0, 1.0, 64, dtype=np.float32).reshape(1, 8, 8)


@pytest.fixture
async def app_with_access_log(request: pytest.FixtureRequest) -> AsyncIterator[FastAPI]:
    settings = Settings(device="cpu", access_log=request.param)
    application = create_app(settings)
    async with lifespan(application):
        await application.state.loading
        yield application


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == ACCESS_LOGGER]


@pytest.mark.parametrize("app_with_access_log", [True], indirect=True)
async def test_a_line_names_the_request_its_answer_and_its_ids(
    app_with_access_log: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    transport = httpx.ASGITransport(app=app_with_access_log, client=("10.1.2.3", 5678))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"instances": DIGIT.tolist()}
        answered = await client.post(
            "/models/digits/predict", json=body, headers={"x-request-id": "ok-1"}
        )
        refused = await client.post("/models/digits/predict", json={"instances": [[1.0]]})
    assert answered.status_code == 200
    assert refused.status_code == 422
    first, second = access_records(caplog)
    version = answered.json()["version"]
    assert first.getMessage() == "request"
    assert {key: getattr(first, key) for key in ACCESS_FIELDS} == {
        "protocol": "http",
        "method": "POST",
        "route": "/models/{name}/predict",
        "path": "/models/digits/predict",
        "status": 200,
        "model": "digits",
        "version": version,
        "request_id": "ok-1",
        "client": "10.1.2.3:5678",
        "request_bytes": int(answered.request.headers["content-length"]),
        "response_bytes": len(answered.content),
    }
    assert 0 < first.duration_ms < 60_000  # type: ignore[attr-defined]
    # A refusal: the model its path names, no version (none answered); never the body.
    assert (second.status, second.model, second.version) == (422, "digits", None)  # type: ignore[attr-defined]
    assert second.request_id == refused.headers["x-request-id"]  # type: ignore[attr-defined]
    assert "instances" not in orjson.dumps(vars(second), default=str).decode()


@pytest.mark.parametrize("app_with_access_log", [False], indirect=True)
async def test_no_line_while_it_is_off(
    app_with_access_log: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    transport = httpx.ASGITransport(app=app_with_access_log)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.post("/predict", json={"instances": DIGIT.tolist()})).is_success
        assert (await client.get("/healthz")).is_success
    assert access_records(caplog) == []


async def test_a_traced_request_has_its_trace_and_span_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    exporter = InMemorySpanExporter()
    tracing.start([SimpleSpanProcessor(exporter)], role="server")
    try:
        application = create_app(Settings(device="cpu", access_log=True))
        async with lifespan(application):
            await application.state.loading
            transport = httpx.ASGITransport(app=application)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"instances": DIGIT.tolist()}
                assert (await client.post("/predict", json=body)).is_success
    finally:
        tracing.stop()
    (server,) = [span for span in exporter.get_finished_spans() if span.name == "POST /predict"]
    (line,) = access_records(caplog)
    assert line.trace_id == format(server.context.trace_id, "032x")  # type: ignore[attr-defined]
    assert line.span_id == format(server.context.span_id, "016x")  # type: ignore[attr-defined]


ACCESS_FIELDS = (
    "protocol",
    "method",
    "route",
    "path",
    "status",
    "model",
    "version",
    "request_id",
    "client",
    "request_bytes",
    "response_bytes",
)


@pytest.fixture(params=[("in_process", 1), ("process", 2)], ids=["one_process", "two_front_ends"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Running]:
    mode, workers = request.param
    port, grpc_port = free_port(), free_port()
    env = batchserve_environment(
        port,
        BATCHSERVE_ENGINE_MODE=mode,
        BATCHSERVE_WORKERS=str(workers),
        BATCHSERVE_GRPC_PORT=str(grpc_port),
        BATCHSERVE_ACCESS_LOG="true",
        # Less start-up work on a busy machine: no spare interpreter importing torch meanwhile.
        BATCHSERVE_SPARE_ENGINE="false",
        BATCHSERVE_WARMUP_BATCH_SIZES="1",
    )
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as running_server:
        if workers > 1:
            wait_until_serving(running_server, workers)
        else:
            wait_for(lambda: _ready(url), "ready", running_server)
        running_server.grpc = f"127.0.0.1:{grpc_port}"  # type: ignore[attr-defined]
        yield running_server


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def access_lines(server: Running) -> list[dict[str, Any]]:
    """The server's access-log lines, but for the tests' own polls of readiness and metrics
    (every line of the log a JSON object)."""
    lines = [orjson.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    return [
        line
        for line in lines
        if line["logger"] == ACCESS_LOGGER and line["route"] not in ("/readyz", "/metrics")
    ]


def test_one_line_per_request_over_http_and_grpc(server: Running) -> None:
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        answers = [
            client.post(
                "/predict", json={"instances": DIGIT.tolist()}, headers={"x-request-id": "p-1"}
            ),
            client.post(
                "/models/nosuch/predict", json={"instances": []}, headers={"x-request-id": "p-2"}
            ),
            client.get("/healthz", headers={"x-request-id": "h-1"}),
        ]
    assert [answer.status_code for answer in answers] == [200, 404, 200]
    tensor = triton_grpc_client.InferInput("image", [1, 8, 8], "FP32")
    tensor.set_data_from_numpy(DIGIT)
    grpc = triton_grpc_client.InferenceServerClient(server.grpc)  # type: ignore[attr-defined]
    grpc.infer("digits", [tensor], request_id="g-1")
    wait_for(lambda: len(access_lines(server)) >= 4, "4 access-log lines", server, 30.0)
    lines = {line["request_id"]: line for line in access_lines(server)}
    assert sorted(lines) == ["g-1", "h-1", "p-1", "p-2"], server.output()
    assert len(access_lines(server)) == 4, server.output()
    version = answers[0].json()["version"]
    summary = {
        request_id: (
            line["protocol"],
            line["route"],
            line["status"],
            line["model"],
            line["version"],
        )
        for request_id, line in lines.items()
    }
    assert summary == {
        "p-1": ("http", "/predict", 200, "digits", version),
        "p-2": ("http", "/models/{name}/predict", 404, "nosuch", None),
        "h-1": ("http", "/healthz", 200, None, None),
        "g-1": ("grpc", "/inference.GRPCInferenceService/ModelInfer", 200, "digits", version),
    }
    assert lines["g-1"]["client"].startswith("127.0.0.1:")
    assert lines["g-1"]["request_bytes"] > DIGIT.nbytes


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """Put back what configuring logging changes in this process's loggers."""
    names = ("", "service", "uvicorn", "gunicorn", "gunicorn.error", ACCESS_LOGGER, "PIL")
    loggers = [logging.getLogger(name) for name in names]
    saved = [(logger.level, logger.handlers[:], logger.propagate) for logger in loggers]
    try:
        yield
    finally:
        for logger, (level, handlers, propagate) in zip(loggers, saved, strict=True):
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate


def test_debug_is_the_services_and_libraries_stay_at_their_own_level(
    restored_logging: None,
) -> None:
    """Issue 37.4: ``--log-level debug`` flooded the log with Pillow's PNG chunk messages."""
    configure_logging("debug")
    assert logging.getLogger("service.frontend.predict").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("uvicorn.error").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.INFO)
    assert logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.WARNING)
    configure_logging("debug", library_level="debug")
    assert logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.DEBUG)
    configure_logging("error")
    assert logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.INFO)


def test_gunicorn_front_ends_log_at_the_same_levels(restored_logging: None) -> None:
    logging.config.dictConfig(logging_config("debug", "warning"))
    assert logging.getLogger("service.frontend.predict").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("gunicorn.error").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("multipart.multipart").isEnabledFor(logging.INFO)
    assert logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.INFO)
