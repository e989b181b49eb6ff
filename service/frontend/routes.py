"""The documented HTTP routes of a front end. Each reads ``request.app.state.frontend``."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request, Response

from service.errors import ModelNotFoundError
from service.frontend.bodies import NPY_MEDIA_TYPE, NPZ_MEDIA_TYPE
from service.frontend.inference import DirectRoute, Serve, answer_inference
from service.frontend.inference_routes import of_protocol
from service.frontend.predict import PredictHeaders, serve_prediction
from service.frontend.responses import JSON, json_response, service_error_response
from service.frontend.routing import routing_of
from service.frontend.schemas import (
    ErrorResponse,
    HealthResponse,
    ModelsResponse,
    PredictRequest,
    PredictResponse,
    ReadinessResponse,
)
from service.frontend.state import FrontendState
from service.manifest import manifest_summary
from service.metrics import METRICS_CONTENT_TYPE, exposition

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse}
    for status in (400, 404, 408, 413, 415, 422, 429, 500, 503, 504)
}
_BINARY = {"type": "string", "format": "binary"}


def frontend_of(request: Request) -> FrontendState:
    state: FrontendState = request.app.state.frontend
    return state


_PREDICT_DOCUMENT: dict[str, Any] = dict(
    responses={
        200: {
            "description": "One prediction row per instance.",
            "content": {
                JSON: {"schema": PredictResponse.model_json_schema()},
                NPY_MEDIA_TYPE: {"schema": _BINARY},
                NPZ_MEDIA_TYPE: {"schema": _BINARY},
            },
        },
        **_ERRORS,
    },
    # The served model's shapes replace these bodies once it is loaded (openapi.py); this is
    # what the document says while none is.
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                JSON: {"schema": PredictRequest.model_json_schema()},
                NPY_MEDIA_TYPE: {"schema": _BINARY},
                NPZ_MEDIA_TYPE: {"schema": _BINARY},
            },
        }
    },
)


async def predict(request: Request) -> Response:
    """Queue the instances for the next batch and answer with one prediction row each.

    Send JSON ``{"instances": [...]}``, a ``.npy`` array (``Content-Type: application/x-npy``,
    a model with one input) or an ``.npz`` archive with one array per input name
    (``application/x-npz``); ask for the outputs as ``.npy`` (one output) or ``.npz`` with
    ``Accept``. The schemas below are those of the first model served, which answers.
    """
    return await answer_inference(request, _serving(request), service_error_response)


async def predict_with_model(request: Request, name: str, version: str | None = None) -> Response:
    """As ``/predict``, answered by the model ``name`` (404 when it is not served), at
    ``version`` when one is named (404 when that version is not the one served)."""
    return await answer_inference(request, _serving(request, name, version), service_error_response)


def _serving(request: Request, name: str | None = None, version: str | None = None) -> Serve:
    """How ``answer_inference`` serves ``request`` (a plain function returning the
    coroutine: one coroutine less per request)."""
    scope = request.scope

    def serve(frontend: FrontendState, request_id: str) -> Awaitable[Response]:
        return serve_prediction(
            frontend,
            PredictHeaders.from_scope(scope),
            request.receive,
            request_id,
            scope.get("query_string", b""),
            name,
            version,
            routing_of(scope),
        )

    return serve


def add_predict_routes(router: APIRouter) -> None:
    """Register ``/predict`` and the model routes (``inference_routes``) with ``router``: the
    app's own (``app.py``)."""
    for route in of_protocol("predict"):
        router.add_api_route(
            route.path,
            predict_with_model if route.names_model else predict,
            methods=["POST"],
            summary=route.summary,
            route_class_override=DirectRoute,
            **_PREDICT_DOCUMENT,
        )


@router.head("/healthz", include_in_schema=False)
@router.get(
    "/healthz",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse}},
    summary="Liveness",
)
async def healthz(request: Request) -> Response:
    """200 while this process is alive and its event loop answers, with the engines' state.

    One process serving alone answers 503 once its model is hung (a batch outlived
    ``stall_timeout_s``), so that the orchestrator replaces it. Behind the bridge a hung or
    dead engine is restarted by the supervisor and the front end stays alive: 200, with
    ``engine`` saying what is wrong.
    """
    frontend = frontend_of(request)
    engine_phase = frontend.engine.status().phase
    if frontend.engine_in_process and engine_phase == "stalled":
        return json_response({"status": "stalled", "engine": engine_phase}, status_code=503)
    return json_response({"status": "alive", "engine": engine_phase})


@router.head("/readyz", include_in_schema=False)
@router.get(
    "/readyz",
    response_model=ReadinessResponse,
    responses={503: {"model": ReadinessResponse}},
    summary="Readiness",
)
async def readyz(request: Request) -> Response:
    """200 once an engine serves the warmed-up models; 503 while loading, draining, with no
    engine reachable, or failed."""
    frontend = frontend_of(request)
    status = frontend.engine.status()
    model = status.model
    content = {
        "status": frontend.phase,
        "model": model.manifest.name if model else None,
        "version": model.manifest.version if model else None,
        "models": [served.manifest.label for served in status.models],
        "engines": [
            {"device": e.device, "status": e.phase, "role": e.role, "detail": e.detail}
            for e in frontend.engine.engines()
        ],
    }
    return json_response(content, status_code=200 if frontend.ready else 503)


@router.get("/models", response_model=ModelsResponse, responses=_ERRORS, summary="Models")
async def models(request: Request) -> Response:
    """Every model served with its manifest, memory and weight, the versions loaded beside
    them, each engine, and every version of each served model in the repository."""
    frontend = frontend_of(request)
    status = frontend.engine.status()
    served = [
        {
            "name": model.manifest.name,
            "version": model.manifest.version,
            "device": model.device,
            "precision": model.precision,
            "compiled": model.compiled,
            "memory_bytes": model.memory_bytes,
            "manifest": manifest_summary(model.manifest),
            "weight": model.weight,
        }
        for model in (*status.models, *status.beside)
    ]
    primaries = served[: len(status.models)]
    engines = [
        {
            "device": engine.device,
            "status": engine.phase,
            "version": engine.model.manifest.version if engine.model else None,
            "models": [model.manifest.label for model in engine.models],
            "pid": engine.pid,
            "role": engine.role,
        }
        for engine in frontend.engine.engines()
    ]
    names = [model.manifest.name for model in status.models] or [frontend.settings.model_name]
    versions = []
    for name in names:
        with contextlib.suppress(ModelNotFoundError):
            versions += [
                manifest_summary(version) for version in frontend.repository.versions(name)
            ]
    return json_response(
        {
            "loaded": primaries[0] if primaries else None,
            "models": primaries,
            "beside": served[len(status.models) :],
            "engines": engines,
            "versions": versions,
        }
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {METRICS_CONTENT_TYPE: {}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format, or OpenMetrics (with exemplars) when ``Accept`` asks for it; the
    sum over every process of the server when there are several."""
    frontend = frontend_of(request)
    frontend.refresh_gauges()
    body, media_type = exposition(frontend.registry, request.headers.get("accept"))
    return Response(body, media_type=media_type)
