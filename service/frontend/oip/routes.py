"""The V2 REST routes besides inference: server and model metadata, health, readiness, and the
model repository extension (behind the admin token). Errors are ``{"error": "..."}``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from fastapi import APIRouter, Request, Response

from service.errors import ModelNotFoundError, ServiceError
from service.frontend.about import __version__
from service.frontend.admin import require_admin_token
from service.frontend.inference import DirectRoute, answer_inference
from service.frontend.inference_routes import of_protocol
from service.frontend.oip.datatypes import datatype_of
from service.frontend.oip.generate import GenerateBody, generate, generate_stream
from service.frontend.oip.rest import (
    BINARY,
    JSON,
    error_response,
    serve_v2_inference,
)
from service.frontend.oip.schemas import (
    V2InferenceRequest,
    V2InferenceResponse,
    V2Liveness,
    V2Loaded,
    V2ModelMetadata,
    V2Readiness,
    V2RepositoryEntry,
    V2ServerMetadata,
    error_responses,
    inlined_schema,
)
from service.frontend.responses import json_response
from service.frontend.routing import routing_of
from service.frontend.state import FrontendState
from service.manifest import Manifest, TensorSpec, check_name

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (V2)"])

#: The protocol extensions served, as ``GET /v2`` lists them.
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]
PLATFORM = "batchserve_pytorch"

Route = Callable[..., Awaitable[Response]]


def v2_errors(route: Route) -> Route:
    """Answer a ``ServiceError`` in the protocol's ``{"error": "..."}`` form."""

    @wraps(route)
    async def answering(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except ServiceError as error:
            return error_response(error)

    return answering


def frontend_of(request: Request) -> FrontendState:
    state: FrontendState = request.app.state.frontend
    return state


@router.get("", summary="Server metadata", response_model=V2ServerMetadata)
@v2_errors
async def server_metadata() -> Response:
    return json_response({"name": "batchserve", "version": __version__, "extensions": EXTENSIONS})


@router.get("/health/live", summary="Server live", response_model=V2Liveness)
async def server_live() -> Response:
    """200 while this process answers."""
    return json_response({"live": True})


@router.get(
    "/health/ready",
    summary="Server ready",
    response_model=V2Readiness,
    responses={400: {"model": V2Readiness}},
)
async def server_ready(request: Request) -> Response:
    """200 once the model is served; 400 otherwise (the protocol's "4xx is not ready")."""
    ready = frontend_of(request).ready
    return json_response({"ready": ready}, 200 if ready else 400)


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": datatype_of(spec), "shape": list(spec.shape)}


def model_metadata(manifest: Manifest, versions: list[str]) -> dict[str, Any]:
    return {
        "name": manifest.name,
        "versions": versions,
        "platform": PLATFORM,
        "inputs": [tensor_metadata(spec) for spec in manifest.inputs],
        "outputs": [tensor_metadata(spec) for spec in manifest.outputs],
    }


_METADATA = {"response_model": V2ModelMetadata, "responses": error_responses(404, 503)}


@router.get("/models/{name}", summary="Model metadata", **_METADATA)  # type: ignore[arg-type]
@router.get(
    "/models/{name}/versions/{version}",
    summary="Model version metadata",
    **_METADATA,  # type: ignore[arg-type]
)
@v2_errors
async def model(request: Request, name: str, version: str | None = None) -> Response:
    """Inputs and outputs (datatype, shape with -1 for variable sizes) of the served version,
    and every version of the model in the repository."""
    frontend = frontend_of(request)
    served = frontend.serving_model(name, version)
    try:
        versions = [manifest.version for manifest in frontend.repository.versions(name)]
    except ModelNotFoundError:
        versions = [served.manifest.version]
    return json_response(model_metadata(served.manifest, versions))


_READY = {"response_model": V2Readiness, "responses": {400: {"model": V2Readiness}}}


@router.get("/models/{name}/ready", summary="Model ready", **_READY)  # type: ignore[arg-type]
@router.get(
    "/models/{name}/versions/{version}/ready",
    summary="Model version ready",
    **_READY,  # type: ignore[arg-type]
)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    try:
        frontend_of(request).serving_model(name, version)
    except ServiceError as error:
        return json_response({"name": name, "ready": False, "error": error.message}, 400)
    return json_response({"name": name, "ready": True})


_ADMIN_ERRORS = error_responses(401, 403, 404, 409, 422, 503)


@router.post(
    "/repository/index",
    summary="Repository index (admin)",
    response_model=list[V2RepositoryEntry],
    responses=_ADMIN_ERRORS,
)
@v2_errors
async def repository_index(request: Request) -> Response:
    """Every version in the repository and whether it is the one served."""
    frontend = frontend_of(request)
    require_admin_token(request)
    served = {model.manifest.label for model in frontend.engine.status().models}
    entries = []
    for name in frontend.repository.model_names():
        for manifest in frontend.repository.versions(name):
            serving = manifest.label in served
            entries.append(
                {
                    "name": manifest.name,
                    "version": manifest.version,
                    "state": "READY" if serving else "UNAVAILABLE",
                    "reason": "" if serving else "not loaded",
                }
            )
    return json_response(entries)


@router.post(
    "/repository/models/{name}/load",
    summary="Load a model (admin)",
    response_model=V2Loaded,
    responses=_ADMIN_ERRORS,
)
@v2_errors
async def repository_load(request: Request, name: str) -> Response:
    """Verify, load and warm up the newest version of ``name``, then serve it: the admin
    route's switch, on every engine."""
    frontend = frontend_of(request)
    require_admin_token(request)
    switched = await frontend.engine.switch(name, "latest")
    return json_response({"name": switched.serving.name, "version": switched.serving.version})


@router.post(
    "/repository/models/{name}/unload",
    summary="Unload a model (admin)",
    responses=_ADMIN_ERRORS,
)
@v2_errors
async def repository_unload(request: Request, name: str) -> Response:
    """Stop serving ``name`` on every engine (409 for the only model served)."""
    frontend = frontend_of(request)
    require_admin_token(request)
    await frontend.engine.unload(check_name(name))
    return json_response({"name": name, "unloaded": True})


_INFER = {
    "response_model": V2InferenceResponse,
    "responses": {
        200: {"content": {BINARY: {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(400, 404, 408, 413, 429, 500, 503, 504),
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                JSON: {"schema": inlined_schema(V2InferenceRequest)},
                BINARY: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": "The binary tensor extension: a JSON header of "
                    "Inference-Header-Content-Length bytes, then each input with a "
                    "binary_data_size.",
                },
            },
        }
    },
}


async def infer(request: Request, name: str, version: str | None = None) -> Response:
    """Run the model on the request's named tensors (JSON ``data`` or binary data); every
    output, or the ones asked for, in JSON or as binary data."""

    async def serve(frontend: FrontendState, request_id: str) -> Response:
        headers = {
            key.decode("latin-1").lower(): value.decode("latin-1")
            for key, value in request.scope["headers"]
        }
        return await serve_v2_inference(
            frontend, headers, request.receive, request_id, name, version, routing_of(request.scope)
        )

    return await answer_inference(request, serve, _error_answer)


def _error_answer(error: ServiceError, request_id: str) -> Response:
    return error_response(error)


def add_infer_routes(app_router: APIRouter) -> None:
    """Register the V2 inference routes (``inference_routes``) with ``app_router``: the
    app's own (``app.py``), under this module's tag."""
    for route in of_protocol("v2"):
        app_router.add_api_route(
            route.path,
            infer,
            methods=["POST"],
            summary=route.summary,
            tags=list(router.tags),
            route_class_override=DirectRoute,
            **_INFER,  # type: ignore[arg-type]
        )


_GENERATE_ERRORS = error_responses(400, 404, 413, 429, 500, 503, 504)


def add_generate_routes(app_router: APIRouter) -> None:
    """Register the generate extension's routes (``inference_routes``) with ``app_router``:
    the app's own (``app.py``), under this module's tag."""
    for route in of_protocol("v2_generate"):
        streamed = route.path.endswith("_stream")
        app_router.add_api_route(
            route.path,
            generate_stream if streamed else generate,
            methods=["POST"],
            summary=route.summary,
            tags=list(router.tags),
            route_class_override=DirectRoute,
            responses={
                200: {"content": {"text/event-stream" if streamed else JSON: {}}},
                **_GENERATE_ERRORS,
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": inlined_schema(GenerateBody)}},
                }
            },
        )
