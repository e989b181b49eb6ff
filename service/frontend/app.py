"""``create_frontend_app``: a front end's ASGI app, with its routes, middleware and error answers.

The app knows the engines only as ``frontend.engine`` (an ``EngineClient``). What starts and
stops them is the caller's ``lifespan``: ``server/single.py`` runs an engine in this process,
``server/frontend_process.py`` connects to engine processes through the bridge.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from service import tracing
from service.bridge.interface import ModelInfo
from service.errors import HandlerError, ServiceError
from service.frontend import admin, docs, routes, tei
from service.frontend.about import __version__
from service.frontend.head_requests import HeadAsGet
from service.frontend.inference import DirectRoute
from service.frontend.middleware import ServiceMiddleware
from service.frontend.oip import routes as oip_routes
from service.frontend.openai import embeddings
from service.frontend.openai import routes as openai_routes
from service.frontend.openai.errors import openai_error_response
from service.frontend.openapi import model_openapi, with_model_routes
from service.frontend.openapi_clients import for_clients
from service.frontend.responses import (
    error_response,
    internal_error_response,
    service_error_response,
)
from service.frontend.state import FrontendState

logger = logging.getLogger(__name__)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
#: Where OpenAI's API is served: every error there is in its shape.
OPENAI_PREFIX = "/v1/"


def create_frontend_app(frontend: FrontendState, lifespan: Lifespan) -> FastAPI:
    """The ASGI app serving ``frontend``; ``lifespan`` brings its engines up and down."""
    app = ServingApp(
        frontend,
        title="batchserve",
        version=__version__,
        summary="PyTorch model serving with dynamic batching.",
        lifespan=_with_tracing(frontend, _with_grpc(frontend, lifespan)),
        # FastAPI's pages load their scripts from CDNs; docs.py serves Swagger UI offline.
        docs_url=None,
        redoc_url=None,
        # The service traces requests itself (request_spans.py): FastAPI's own spans, metrics
        # and logs would duplicate them, and checking for them costs every request.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    # The inference routes on the app's own router, first (ServingApp answers them directly).
    routes.add_predict_routes(app.router)
    oip_routes.add_infer_routes(app.router)
    embeddings.add_embeddings_routes(app.router)
    tei.add_tei_routes(app.router)
    oip_routes.add_generate_routes(app.router)
    openai_routes.add_openai_routes(app.router)
    app.inference_routes = [route for route in app.router.routes if isinstance(route, DirectRoute)]
    app.include_router(routes.router)
    app.include_router(admin.router)
    app.include_router(oip_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(docs.router)
    app.add_exception_handler(ServiceError, _service_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error_response)
    return app


def _with_tracing(frontend: FrontendState, lifespan: Lifespan) -> Lifespan:
    """``lifespan``, with tracing started first when the ``OTEL_*`` variables ask for it
    (in each worker process: the span exporter's thread does not survive a fork), and its
    last spans exported at the end."""

    @contextlib.asynccontextmanager
    async def traced(app: FastAPI) -> AsyncIterator[None]:
        started = tracing.start_from_environment(
            "server" if frontend.engine_in_process else "frontend"
        )
        try:
            async with lifespan(app):
                yield
        finally:
            if started:
                tracing.stop()

    return traced


def _with_grpc(frontend: FrontendState, lifespan: Lifespan) -> Lifespan:
    """``lifespan``, and the V2 gRPC service beside HTTP when ``grpc_port`` is set: started
    once the engines are starting, stopped (in-flight calls finished) before they stop."""

    @contextlib.asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app):
            if not frontend.settings.grpc_port:
                yield
                return
            from service.frontend.oip.grpc_server import start_grpc_server

            server = await start_grpc_server(frontend)
            try:
                yield
            finally:
                await server.stop(grace=frontend.settings.request_timeout_ms / 1000.0)

    return serving


class ServingApp(FastAPI):
    """FastAPI with ``ServiceMiddleware`` (and ``HeadAsGet``) in front of FastAPI's own
    middleware stack, a short way to the inference routes, and an OpenAPI document that
    describes the served model.

    Placed outside, the middleware gives a request id to every answer, FastAPI's 500s
    included, and counts them all by the route taken. A request an inference route answers
    (a ``POST`` to one of their paths) goes to that route straight from the middleware:
    FastAPI's middleware stack and router, which every other request goes through, cost a
    front end more CPU per request than the rest of its own work on one (the figure is in
    docs/architecture.md). The routes are the router's own (``inference.DirectRoute``,
    ``inference_routes``): FastAPI documents them, and answers anything else sent to their
    paths (405) as for every route.
    """

    def __init__(self, frontend: FrontendState, **options: Any) -> None:
        super().__init__(**options)
        self.state.frontend = frontend
        self.inference_routes: list[DirectRoute] = []
        """The router's inference routes, in its order (``create_frontend_app`` sets them)."""
        self._static_matches: dict[tuple[str, str, str], tuple[DirectRoute, Scope]] = {}
        """``_inference_match``'s kept matches, by method, path and root path."""
        self._served = ServiceMiddleware(self._route, frontend)
        self._head_as_get = HeadAsGet(self._served)
        # The served version and its document: built once a version, not once a request.
        self._model_openapi: tuple[str, dict[str, Any]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # HeadAsGet's own test, made here: a request of another method skips its layer.
        if scope["type"] == "http" and scope["method"] == "HEAD":
            await self._head_as_get(scope, receive, send)
        else:
            await self._served(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            matched = self._inference_match(scope)
            if matched is not None:
                route, child_scope = matched
                scope["app"] = self
                scope.update(child_scope)
                await route.serve(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _inference_match(self, scope: Scope) -> tuple[DirectRoute, Scope] | None:
        """The inference route that fully matches ``scope``, and its child scope; None if
        none does.

        A route without path parameters matches one method and path only: its match is
        kept, and an inference request to it skips the routes' matching (their regular
        expressions) from then on."""
        key = (scope["method"], scope["path"], scope.get("root_path", ""))
        known = self._static_matches.get(key)
        if known is not None and "path_params" not in scope:
            route, child_scope = known
            return route, {**child_scope, "path_params": {}}
        for route in self.inference_routes:
            match, child_scope = route.matches(scope)
            if match is Match.FULL:
                if not route.param_convertors and "path_params" not in scope:
                    self._static_matches[key] = (route, child_scope)
                return route, child_scope
        return None

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document with ``/predict`` stating the first model's inputs and outputs
        (``openapi.model_openapi``) and a predict route per model served, each stating its
        own (``openapi.with_model_routes``); FastAPI's own while no model is loaded. Either
        way as client generators take it (``openapi_clients.for_clients``)."""
        base = super().openapi()
        frontend: FrontendState = self.state.frontend
        models = frontend.engine.status().models
        if not models:
            return for_clients(base)
        key = ",".join(model.manifest.label for model in models)
        if self._model_openapi is not None and self._model_openapi[0] == key:
            return self._model_openapi[1]
        max_instances = frontend.settings.max_instances_per_request
        described: list[tuple[ModelInfo, dict[str, Any] | None]] = []
        complete = True
        for model in models:
            try:
                described.append((model, _handler_description(frontend, model)))
            except HandlerError:  # logged by the front end; described loosely, tried again
                described.append((model, None))
                complete = False
        first, first_described = described[0]
        document = model_openapi(
            base, first, max_instances=max_instances, handler_description=first_described
        )
        document = for_clients(with_model_routes(document, described, max_instances=max_instances))
        if complete:
            self._model_openapi = (key, document)
        return document


def _handler_description(frontend: FrontendState, model: ModelInfo) -> dict[str, Any] | None:
    """What the version's handler says of its bodies, with the media types and the query
    parameters it reads (the names ``predict`` checks a query against, each with its schema);
    None for a version without a handler, whose bodies are the manifest's tensors."""
    if model.manifest.handler is None:
        return None
    handler = frontend.handler_for(model)
    schemas = handler.query_schemas()
    return {
        **handler.describe(),
        "media_types": sorted(handler.media_types),
        "query_parameters": {
            name: schemas.get(name, {"type": "string"}) for name in sorted(handler.query_parameters)
        },
    }


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "-")


async def _service_error_response(request: Request, error: ServiceError) -> Response:
    return service_error_response(error, _request_id(request))


async def _http_error_response(request: Request, error: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
    allowed = _allowed_methods(request) if error.status_code == 405 else ""
    if allowed:  # else a path the document leaves out: Starlette's own Allow stands
        error.headers = {**(error.headers or {}), "Allow": allowed}
    if request.url.path.startswith(OPENAI_PREFIX):  # OpenAI's clients read their own shape
        failure = ServiceError(str(error.detail), headers=dict(error.headers or {}))
        failure.status_code, failure.code = error.status_code, code
        return openai_error_response(failure, _request_id(request))
    return error_response(
        error.status_code, code, str(error.detail), _request_id(request), error.headers
    )


def _allowed_methods(request: Request) -> str:
    """Every method the OpenAPI document gives the request's path: Starlette's 405 names only
    the first matching route's, where a path has a route per method
    (``/admin/models/{name}/traffic``)."""
    path = request.url.path
    methods: dict[str, None] = {}
    for template, operations in request.app.openapi().get("paths", {}).items():
        parts = re.split(r"(\{[^}]+\})", template)
        pattern = "".join("[^/]+" if part[:1] == "{" else re.escape(part) for part in parts)
        if re.fullmatch(pattern, path):
            methods.update(dict.fromkeys(method.upper() for method in sorted(operations)))
    return ", ".join(methods)


async def _validation_error_response(request: Request, error: RequestValidationError) -> Response:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
        for problem in error.errors()
    )
    return error_response(422, "invalid_input", problems, _request_id(request))


async def _unexpected_error_response(request: Request, error: Exception) -> Response:
    logger.error(
        "unhandled_error",
        exc_info=error,
        extra={"request_id": _request_id(request), "path": request.url.path},
    )
    return internal_error_response(_request_id(request))
