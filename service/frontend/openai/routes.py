"""OpenAI's API for generative models: ``POST /v1/completions``, ``POST /v1/chat/completions``
(inference routes of the one table, ``inference_routes.py``) and ``GET /v1/models``. Every
error is in OpenAI's shape (``errors.py``), so the ``openai`` SDK works unchanged."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from service.errors import ServiceError
from service.frontend.generation.text_model import is_generative
from service.frontend.inference import DirectRoute, answer_inference
from service.frontend.inference_routes import COMPLETIONS_PATH, of_protocol
from service.frontend.oip.schemas import inlined_schema
from service.frontend.openai.chat import serve_chat_completion
from service.frontend.openai.completions import serve_completion
from service.frontend.openai.errors import ERROR_SCHEMA, openai_error_response
from service.frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from service.frontend.responses import json_response
from service.frontend.state import FrontendState

TAG = "OpenAI-compatible"
router = APIRouter(prefix="/v1", tags=[TAG])

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for status in (400, 404, 413, 429, 500, 503, 504)
}


async def completions(request: Request) -> Response:
    """Complete a prompt (a text, texts, or token ids) with a text-generation model; with
    ``stream: true``, as server-sent events ending with ``data: [DONE]``."""

    async def serve(frontend: FrontendState, request_id: str) -> Response:
        return await serve_completion(frontend, request.scope, request.receive, request_id)

    return await answer_inference(request, serve, openai_error_response)


async def chat_completions(request: Request) -> Response:
    """Answer a chat, rendered with the model's chat template; with ``stream: true``, as
    server-sent events ending with ``data: [DONE]``."""

    async def serve(frontend: FrontendState, request_id: str) -> Response:
        return await serve_chat_completion(frontend, request.scope, request.receive, request_id)

    return await answer_inference(request, serve, openai_error_response)


def add_openai_routes(app_router: APIRouter) -> None:
    """Register the OpenAI inference routes (``inference_routes``) with ``app_router``: the
    app's own (``app.py``)."""
    for route in of_protocol("openai_generation"):
        is_completion = route.path == COMPLETIONS_PATH
        schema = inlined_schema(CompletionRequest if is_completion else ChatCompletionRequest)
        app_router.add_api_route(
            route.path,
            completions if is_completion else chat_completions,
            methods=["POST"],
            summary=route.summary,
            tags=[TAG],
            route_class_override=DirectRoute,
            responses={
                200: {"content": {"application/json": {}, "text/event-stream": {}}},
                **_ERRORS,
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
            },
        )


@router.get("/models", summary="Models (OpenAI)")
async def models(request: Request) -> Response:
    """The models the OpenAI routes answer with (text generation, and embeddings), in OpenAI's
    list shape."""
    frontend: FrontendState = request.app.state.frontend
    try:
        served = frontend.engine.status().models
    except ServiceError as error:
        return openai_error_response(error)
    data = [
        {
            "id": model.manifest.name,
            "object": "model",
            "created": int(model.manifest.created_at.timestamp()),
            "owned_by": "batchserve",
        }
        for model in served
        if is_generative(model.manifest)
        or model.manifest.metadata.get("task") == "feature-extraction"
    ]
    return json_response({"object": "list", "data": data})
