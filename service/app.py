"""``create_app(settings)``: the app with its state, routes, middleware and error answers.

The model loads in a background task started by the lifespan (``lifecycle.py`` builds the
runner and batcher), so ``/healthz`` answers while weights are verified, the model is compiled
and warmed up; ``/readyz`` turns 200 only then. On shutdown readiness turns off first, then the
batcher drains and the device is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from service import admin, api, lifecycle
from service.config import Settings
from service.errors import ServiceError
from service.metrics import ServiceMetrics
from service.middleware import ServiceMiddleware
from service.model_store import ModelStore
from service.state import ServiceState

logger = logging.getLogger(__name__)


try:
    __version__ = version("batchserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"


def create_app(
    settings: Settings,
    on_load_failure: Callable[[], None] | None = None,
    on_stall: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the ASGI app for ``settings``; nothing is loaded until its lifespan starts.

    ``on_load_failure`` is called if the model cannot be loaded (the CLI uses it to stop the
    server and exit non-zero); ``app.state.loading`` is the loading task, for tests to await.
    """
    metrics = ServiceMetrics()
    service = ServiceState(
        settings=settings,
        metrics=metrics,
        store=ModelStore(settings.model_repository),
        on_stall=on_stall,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loading = asyncio.create_task(lifecycle.start_serving(service, on_load_failure))
        try:
            yield
        finally:
            await lifecycle.shut_down(service, app.state.loading)

    app = ServingApp(
        service,
        title="batchserve",
        version=__version__,
        summary="PyTorch model serving with dynamic batching.",
        lifespan=lifespan,
    )
    app.include_router(api.router)
    app.include_router(admin.router)
    app.add_exception_handler(ServiceError, _service_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error_response)
    return app


class ServingApp(FastAPI):
    """FastAPI with ``ServiceMiddleware`` in front of FastAPI's own middleware stack.

    Placed outside, the middleware answers ``POST /predict`` before FastAPI's per-request
    error, telemetry and body-limit layers run; every other request goes through them.
    """

    def __init__(self, service: ServiceState, **options: Any) -> None:
        super().__init__(**options)
        self.state.service = service
        self._outer = ServiceMiddleware(super().__call__, service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._outer(scope, receive, send)


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "-")


async def _service_error_response(request: Request, error: ServiceError) -> Response:
    return api.error_response(
        error.status_code, error.code, error.message, _request_id(request), error.headers
    )


async def _http_error_response(request: Request, error: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
    return api.error_response(
        error.status_code, code, str(error.detail), _request_id(request), error.headers
    )


async def _validation_error_response(request: Request, error: RequestValidationError) -> Response:
    problems = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
        for problem in error.errors()
    )
    return api.error_response(422, "invalid_input", problems, _request_id(request))


async def _unexpected_error_response(request: Request, error: Exception) -> Response:
    logger.error(
        "unhandled_error",
        exc_info=error,
        extra={"request_id": _request_id(request), "path": request.url.path},
    )
    return api.error_response(500, "internal_error", "internal server error", _request_id(request))
