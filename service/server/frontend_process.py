"""A front-end process of a server with engine processes: its app, connected over the bridge.

gunicorn calls ``create_app_from_environment()`` in each worker after the fork. Nothing here
imports torch: a front end parses, validates and answers, and the engines do the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from service.bridge.client import BridgeClient
from service.bridge.interface import EngineStatus
from service.config import Settings, load_settings
from service.frontend.app import create_frontend_app
from service.frontend.state import FrontendState
from service.metrics import FrontendMetrics
from service.processes import ENGINES_ENV


def engines_from_environment() -> list[tuple[Path, str]]:
    return [(Path(path), str(device)) for path, device in orjson.loads(os.environ[ENGINES_ENV])]


def create_frontend_process_app(settings: Settings, engines: list[tuple[Path, str]]) -> FastAPI:
    """A front end reaching ``engines`` through the bridge. ``app.state.loading`` finishes
    once an engine is ready (or every engine failed), for the worker to start accepting."""
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    frontend: FrontendState | None = None

    def refresh() -> None:
        if frontend is not None:
            frontend.refresh_gauges()
            export_roles(metrics, engines, client.engines(), settings.standby_engines > 0)

    def taken_over(device: str, seconds: float, failover: bool) -> None:
        metrics.engine_takeover.labels(device).observe(seconds)
        if failover:
            metrics.engine_failovers.labels(device).inc()

    client = BridgeClient(
        engines,
        # The supervisor kills an engine quiet for engine_heartbeat_timeout_s, which closes
        # its socket and fails its requests here at once; a front end's own limit is a
        # fallback, kept longer so that a loop paused by a busy host costs no 503s.
        heartbeat_timeout_s=2 * settings.engine_heartbeat_timeout_s,
        request_timeout_ms=settings.request_timeout_ms,
        on_status=refresh,
        on_takeover=taken_over,
    )
    frontend = FrontendState.over(client, settings, registry=registry, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        app.state.loading = asyncio.get_running_loop().create_task(client.wait_until_settled())
        try:
            yield
        finally:
            app.state.loading.cancel()
            await client.close()

    app = create_frontend_app(frontend, lifespan)
    app.state.client = client
    return app


def export_roles(
    metrics: FrontendMetrics,
    engines: list[tuple[Path, str]],
    statuses: list[EngineStatus],
    with_standby: bool,
) -> None:
    """Each engine's role, and each device's standbys ready (with standbys configured)."""
    standbys: dict[str, int] = dict.fromkeys((device for _, device in engines), 0)
    for (path, device), status in zip(engines, statuses, strict=True):
        for role in ("active", "standby"):
            metrics.engine_role.labels(device, path.stem, role).set(status.role == role)
        standbys[device] += status.role == "standby"
    if with_standby:
        for device, ready in standbys.items():
            metrics.standby_engines_ready.labels(device).set(ready)


def create_app_from_environment() -> FastAPI:
    """The app of one gunicorn worker, from the ``BATCHSERVE_*`` variables."""
    return create_frontend_process_app(load_settings(), engines_from_environment())
