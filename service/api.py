"""HTTP routes. Each reads the running service from ``request.app.state.service``.

``POST /predict`` is answered by ``serve_prediction``. The service's middleware calls it
directly, without the framework's routing and dependency machinery (half of the event loop's
time per request under load, measured with py-spy); the FastAPI route below calls the same
function and documents the endpoint in the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from starlette.types import Message, Receive, Scope

from service.batching import PRIORITIES, Priority
from service.errors import (
    BadRequestError,
    InvalidInputError,
    ModelNotFoundError,
    NotReadyError,
    PayloadTooLargeError,
)
from service.inputs import NPY_MEDIA_TYPE, body_media_type, encode_npy, wants_npy
from service.metrics import METRICS_CONTENT_TYPE
from service.model_store import manifest_summary
from service.schemas import (
    ErrorResponse,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadinessResponse,
)
from service.state import ServiceState

router = APIRouter()

JSON = "application/json"
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 413, 415, 422, 429, 500, 503, 504)
}


def _service(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


def json_response(
    content: object, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type=JSON, headers=headers)


def error_response(
    status_code: int,
    code: str,
    message: str,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The JSON error every failure is answered with."""
    return json_response(
        {"error": {"code": code, "message": message, "request_id": request_id}},
        status_code=status_code,
        headers=headers,
    )


class ClientDisconnectedError(Exception):
    """The client went away before its body arrived; there is nobody to answer."""


@dataclass(frozen=True, slots=True)
class PredictHeaders:
    """The request headers ``/predict`` reads, found in one pass over the raw list."""

    content_type: str | None = None
    accept: str | None = None
    content_length: str | None = None
    priority: str | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> PredictHeaders:
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in _PREDICT_HEADERS:
                found[name] = value.decode("latin-1")
        return cls(
            found.get(b"content-type"),
            found.get(b"accept"),
            found.get(b"content-length"),
            found.get(b"x-priority"),
        )

    def batch_priority(self) -> Priority:
        """``X-Priority: high`` is served before normal traffic when both wait."""
        if self.priority is None:
            return "normal"
        priority = self.priority.strip().lower()
        if priority not in PRIORITIES:
            raise InvalidInputError(
                f"X-Priority must be 'high' or 'normal', got {self.priority[:32]!r}"
            )
        return priority


_PREDICT_HEADERS = frozenset({b"content-type", b"accept", b"content-length", b"x-priority"})


class DisconnectWatcher:
    """While the caller waits for its batch, cancels the wait if the client disconnects.

    The cancellation drops the request's queued work (it is never computed) and surfaces as
    ``ClientDisconnectedError``. Without it the server would only learn of the disconnect when
    it tried to write the answer. Watching costs a task, so it starts only once the request
    has waited ``WATCH_AFTER_S``: most requests are answered sooner, and those are the ones
    for which dropping queued work matters least.
    """

    WATCH_AFTER_S = 0.02

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._waiting = False
        self._watch: asyncio.Future[Message] | None = None
        self.disconnected = False

    def __enter__(self) -> DisconnectWatcher:
        self._caller = asyncio.current_task()
        self._waiting = True
        self._timer = asyncio.get_running_loop().call_later(self.WATCH_AFTER_S, self._start)
        return self

    def _start(self) -> None:
        if self._waiting:
            self._watch = asyncio.ensure_future(self._receive())
            self._watch.add_done_callback(self._on_message)

    def _on_message(self, watch: asyncio.Future[Message]) -> None:
        if not self._waiting or watch.cancelled() or watch.exception() is not None:
            return
        if watch.result()["type"] == "http.disconnect" and self._caller is not None:
            self.disconnected = True
            self._caller.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> None:
        self._waiting = False
        self._timer.cancel()
        if self._watch is not None:
            self._watch.cancel()
        if self.disconnected and kind is asyncio.CancelledError and self._caller is not None:
            self._caller.uncancel()
            raise ClientDisconnectedError from None


async def read_body(receive: Receive, declared_length: str | None, max_bytes: int) -> bytes:
    """The request body, refusing more than ``max_bytes`` before reading it whole."""
    if declared_length is not None:
        if not declared_length.isdigit():
            raise BadRequestError(f"invalid Content-Length {declared_length[:32]!r}")
        if int(declared_length) > max_bytes:
            raise PayloadTooLargeError(
                f"the body is {int(declared_length)} bytes; at most {max_bytes} bytes are accepted"
            )
    chunks: list[bytes] = []
    received = 0
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnectedError
        chunk: bytes = message.get("body", b"")
        received += len(chunk)
        if received > max_bytes:
            raise PayloadTooLargeError(f"the body exceeds {max_bytes} bytes")
        chunks.append(chunk)
        more_body = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def serve_prediction(
    service: ServiceState, headers: PredictHeaders, receive: Receive, request_id: str
) -> Response:
    """Validate the body, queue its instances for the next batch, answer one row each."""
    served = service.served  # one version for the whole request, even across a switch
    if served is None:
        raise NotReadyError("the model is not loaded yet; retry when /readyz answers 200")
    batcher, manifest, layout = served.batcher, served.manifest, served.layout
    media_type = body_media_type(headers.content_type)
    with batcher.in_flight():
        body = await read_body(receive, headers.content_length, service.settings.max_body_bytes)
        instances = layout.parse(body, media_type)
        group, cost_per_row = layout.group_and_cost(instances)
        priority = headers.batch_priority()
        with DisconnectWatcher(receive):
            chunks = await batcher.submit(
                instances,
                group=group,
                cost_per_row=cost_per_row,
                priority=priority,
                request_id=request_id,
            )
    predictions = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    response_headers = {"X-Model-Version": f"{manifest.name}@{manifest.version}"}
    if wants_npy(headers.accept):
        return Response(
            encode_npy(predictions), media_type=NPY_MEDIA_TYPE, headers=response_headers
        )
    return json_response(
        {"model": manifest.name, "version": manifest.version, "predictions": predictions},
        headers=response_headers,
    )


@router.post(
    "/predict",
    summary="Predict one or more instances",
    response_model=PredictResponse,
    responses=_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                JSON: {"schema": PredictRequest.model_json_schema()},
                NPY_MEDIA_TYPE: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": "One instance or a batch as a NumPy .npy array of the "
                    "model's exact dtype; also accepted as application/octet-stream.",
                },
            },
        }
    },
)
async def predict(request: Request) -> Response:
    """Queue the instances for the next batch and answer with one prediction row each.

    Send JSON ``{"instances": [...]}`` or a ``.npy`` array (``Content-Type:
    application/x-npy``); ask for a ``.npy`` answer with ``Accept: application/x-npy``.
    """
    return await serve_prediction(
        _service(request),
        PredictHeaders.from_scope(request.scope),
        request.receive,
        request.state.request_id,
    )


@router.get(
    "/healthz",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse}},
    summary="Liveness",
)
async def healthz(request: Request) -> Response:
    """200 while the process is alive and its event loop answers; 503 once the model is hung
    (a batch outlived ``stall_timeout_s``), so the orchestrator replaces the process."""
    if _service(request).stalled:
        return json_response({"status": "stalled"}, status_code=503)
    return json_response({"status": "alive"})


@router.get(
    "/readyz",
    response_model=ReadinessResponse,
    responses={503: {"model": ReadinessResponse}},
    summary="Readiness",
)
async def readyz(request: Request) -> Response:
    """200 once the model is loaded and warmed up; 503 while loading, draining or failed."""
    service = _service(request)
    manifest = service.manifest
    content = {
        "status": service.phase,
        "model": manifest.name if manifest else None,
        "version": manifest.version if manifest else None,
    }
    return json_response(content, status_code=200 if service.ready else 503)


@router.get("/models", response_model=ModelsResponse, responses=_ERRORS, summary="Models")
async def models(request: Request) -> Response:
    """The loaded model with its manifest, and every version of it in the repository."""
    service = _service(request)
    manifest, runner = service.manifest, service.runner
    loaded = None
    if manifest is not None and runner is not None:
        loaded = {
            "name": manifest.name,
            "version": manifest.version,
            "device": str(runner.device),
            "precision": runner.precision,
            "compiled": runner.compiled,
            "manifest": manifest_summary(manifest),
        }
    try:
        versions = [
            manifest_summary(version)
            for version in service.store.versions(service.settings.model_name)
        ]
    except ModelNotFoundError:
        versions = []
    return json_response({"loaded": loaded, "versions": versions})


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {METRICS_CONTENT_TYPE: {}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format; aggregated over all workers under gunicorn."""
    service = _service(request)
    service.refresh_memory_gauges()
    return Response(service.metrics.render(), media_type=METRICS_CONTENT_TYPE)
