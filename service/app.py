"""``create_app(settings)``: the one place where store, runner, batcher and routes are wired.

The model loads in a background task started by the lifespan, so ``/healthz`` answers while
weights are verified, the model is compiled and warmed up; ``/readyz`` turns 200 only then.
On shutdown readiness turns off first, then the batcher drains and the device is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from service import api
from service.batching import DynamicBatcher
from service.buckets import resolve_edges
from service.config import Settings
from service.errors import ServiceError
from service.inputs import InputLayout
from service.metrics import ServiceMetrics
from service.middleware import ServiceMiddleware
from service.model_store import ModelStore, TensorSpec
from service.runner import TorchRunner, configure_torch_threads, resolve_device
from service.state import Array, ServiceState

logger = logging.getLogger(__name__)

#: Longest variable length assumed when a spec gives no ``max_length`` and no buckets are set.
DEFAULT_MAX_LENGTH = 4096


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
        settings=settings, metrics=metrics, store=ModelStore(settings.model_repository)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loading = asyncio.create_task(_load_and_start(service, on_load_failure, on_stall))
        try:
            yield
        finally:
            await _shut_down(service, app.state.loading)

    app = ServingApp(
        service,
        title="batchserve",
        version=__version__,
        summary="PyTorch model serving with dynamic batching.",
        lifespan=lifespan,
    )
    app.include_router(api.router)
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


async def _load_and_start(
    service: ServiceState,
    on_load_failure: Callable[[], None] | None,
    on_stall: Callable[[], None] | None,
) -> None:
    """Verify and load the model, warm it up, then start the batcher (readiness follows)."""
    settings = service.settings
    started_s = time.perf_counter()
    try:
        loaded = await asyncio.to_thread(
            service.store.load, settings.model_name, settings.model_version
        )
        device = resolve_device(settings.device)
        configure_torch_threads(settings.torch_threads)
        layout = input_layout(loaded.manifest.input, settings)
        runner = await asyncio.to_thread(
            TorchRunner,
            loaded.module,
            device=device,
            precision=settings.precision,
            compile_mode=settings.compile_mode,
            max_batch_size=settings.max_batch_size,
            variable_axis=layout.spec.variable_axis,
            pad_value=layout.spec.pad_value,
            length_edges=layout.length_edges,
        )
        service.runner = runner
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            runner.executor, runner.warm_up, warmup_batches(layout, runner, settings)
        )
        batcher = DynamicBatcher[Array, Array](
            runner.run_batch,
            executor=runner.executor,
            metrics=service.metrics,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
            max_queue_size=settings.max_queue_size,
            request_timeout_ms=settings.request_timeout_ms,
            max_batch_cost=settings.max_batch_tokens if layout.length_edges else 0,
            policy=settings.batch_policy,
            stall_timeout_s=settings.stall_timeout_s,
            on_stall=lambda: _stalled(service, on_stall),
        )
        batcher.start()
    except Exception as error:
        service.load_error = str(error)
        logger.error(
            "model_load_failed",
            extra={
                "model": settings.model_name,
                "version": settings.model_version,
                "error": str(error),
            },
        )
        if on_load_failure is not None:
            on_load_failure()
        return
    manifest = loaded.manifest
    service.manifest = manifest
    service.layout = layout
    service.batcher = batcher
    service.metrics.model_info.labels(
        manifest.name, manifest.version, str(device), settings.precision, str(runner.compiled)
    ).set(1)
    service.metrics.ready.set(0 if service.draining else 1)
    logger.info(
        "model_ready",
        extra={
            "model": manifest.name,
            "version": manifest.version,
            "device": str(device),
            "precision": settings.precision,
            "compile_mode": settings.compile_mode,
            "seconds": round(time.perf_counter() - started_s, 3),
        },
    )


def input_layout(spec: TensorSpec, settings: Settings) -> InputLayout:
    """Validation, bucketing and batch cost for the model's input (buckets only if variable)."""
    edges: tuple[int, ...] = ()
    if spec.variable_axis is not None:
        longest = spec.max_length or max(settings.length_buckets, default=DEFAULT_MAX_LENGTH)
        edges = resolve_edges(settings.length_buckets, longest)
    return InputLayout(
        spec=spec, length_edges=edges, max_instances=settings.max_instances_per_request
    )


def warmup_batches(layout: InputLayout, runner: TorchRunner, settings: Settings) -> list[Array]:
    """The batch shapes to run before readiness.

    Fixed shapes: every padded batch size (or ``warmup_batch_sizes``). Variable lengths: one
    row at each bucket edge, plus the largest batch the token budget allows at the smallest.
    """
    spec = layout.spec
    sizes = list(settings.warmup_batch_sizes) or runner.padded_batch_sizes
    if not layout.length_edges:
        return [np.repeat(spec.example_instance()[np.newaxis], size, axis=0) for size in sizes]
    shortest = layout.length_edges[0]
    fullest = max(1, min(settings.max_batch_size, settings.max_batch_tokens // shortest))
    shapes = [(1, edge) for edge in layout.length_edges] + [(fullest, shortest)]
    return [
        np.repeat(spec.example_instance(length)[np.newaxis], rows, axis=0)
        for rows, length in shapes
    ]


def _stalled(service: ServiceState, on_stall: Callable[[], None] | None) -> None:
    """A batch outlived ``stall_timeout_s``: report unhealthy, then let the owner react."""
    service.metrics.ready.set(0)
    if on_stall is not None:
        on_stall()


async def _shut_down(service: ServiceState, loading: asyncio.Task[None]) -> None:
    """Readiness off, finish every queued request, stop the collector, free the device."""
    service.draining = True
    service.metrics.ready.set(0)
    if not loading.done():
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
    if service.stalled:
        # The device thread is stuck in the model: draining would wait forever. Queued
        # requests have been answered 504 by their deadlines; the process must be replaced.
        logger.error("shutdown_with_stalled_model")
        return
    if service.batcher is not None:
        await service.batcher.drain()
    if service.runner is not None:
        await asyncio.to_thread(service.runner.close)
    logger.info("shutdown_complete")


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
