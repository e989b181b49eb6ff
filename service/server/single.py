"""One process serving alone: the front end and the engine in one event loop, no bridge.

The engine loads in a background task started by the lifespan, so ``/healthz`` answers while
weights are verified, the model is compiled and warmed up; ``/readyz`` turns 200 only then. On
shutdown readiness turns off first, then the batcher drains and the device is freed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from service.config import Settings
from service.engine.engine import Engine
from service.errors import ModelLoadError
from service.frontend.app import create_frontend_app
from service.frontend.state import FrontendState
from service.metrics import EngineMetrics
from service.processes import EXIT_STALLED
from service.server.draining import DrainingServer, uvicorn_config

logger = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    on_load_failure: Callable[[], None] | None = None,
    on_stall: Callable[[], None] | None = None,
) -> FastAPI:
    """The app of one process serving alone; nothing is loaded until its lifespan starts.

    ``on_load_failure`` is called if the model cannot be loaded (the CLI uses it to stop the
    server and exit non-zero); ``app.state.loading`` is the loading task, for tests to await,
    and ``app.state.engine`` the engine.
    """
    registry = CollectorRegistry()
    engine = Engine(
        settings, EngineMetrics(registry), on_load_failure=on_load_failure, on_stall=on_stall
    )
    frontend = FrontendState.over(
        engine,
        settings,
        engine_in_process=True,
        registry=registry,
        gauge_refreshers=[engine.state.refresh_device_memory],
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loading = engine.start()
        try:
            yield
        finally:
            frontend.draining = True
            frontend.refresh_gauges()
            await engine.shut_down()

    app = create_frontend_app(frontend, lifespan)
    app.state.engine = engine
    return app


@contextlib.asynccontextmanager
async def loaded(settings: Settings) -> AsyncIterator[FastAPI]:
    """``create_app``'s app with its models loaded and warmed up, as it serves, for a command
    that uses it without HTTP (``tune``'s model limit); shut down on exit.
    ``ModelLoadError`` when a model cannot be loaded."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.loading
        engine: Engine = app.state.engine
        if engine.state.load_error is not None:
            raise ModelLoadError(engine.state.load_error)
        yield app


def serve(settings: Settings) -> int:
    """Run one uvicorn process until SIGTERM/SIGINT; exit status 1 if the model fails to load."""
    server: DrainingServer | None = None

    def stop_serving() -> None:
        if server is not None:
            server.stop()

    app = create_app(settings, on_load_failure=stop_serving, on_stall=stop_serving)
    server = DrainingServer(
        uvicorn_config(app, settings), app.state.frontend, settings.drain_delay_s
    )
    server.run()
    engine: Engine = app.state.engine
    if engine.state.stalled:
        # The device thread is stuck inside the model and would block interpreter exit: leave
        # at once with a distinct status so the supervisor (Kubernetes, systemd) restarts us.
        logger.error("exiting_with_stalled_model")
        logging.shutdown()
        os._exit(EXIT_STALLED)
    return 1 if engine.state.load_error is not None else 0
