"""The HTTP ceiling: batchserve's own front end answering ``/predict`` without running a model.

The front end is the real one (``create_frontend_app``), given ``ZeroEngine`` as its
``EngineClient``: every request is answered at once with zero rows, nothing is queued, batched
or computed, and torch is never imported. No server can answer faster than this on the same
machine, whatever its batching. It runs as ``batchserve serve`` would with the same
``BATCHSERVE_*`` settings: one uvicorn process, or gunicorn front ends with the server's own
configuration and this module's ``create_app_from_environment()`` as the app (gunicorn takes
an app named on its command line over the config's ``wsgi_app``).

    BATCHSERVE_MODEL_NAME=digits python -m service.server.tuning.ceiling --port 8098
    BATCHSERVE_WORKERS=2 python -m service.server.tuning.ceiling --port 8098

``batchserve tune`` measures it before its search; ``python -m loadtests.sweep`` runs
the same program for the load-test harness.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from types import FrameType

import numpy as np
from fastapi import FastAPI

from service.bridge.interface import (
    EngineStatus,
    GeneratedTokens,
    GenerateRequest,
    InferenceRequest,
    InferenceResult,
    ModelInfo,
    ShadowReport,
    SwitchResult,
)
from service.buckets import manifest_length_edges
from service.config import Settings, load_settings
from service.errors import ConflictError, ServiceError
from service.frontend.app import create_frontend_app
from service.frontend.state import FrontendState
from service.logs import configure_logging
from service.manifest import TensorSpec
from service.repository import ModelRepository
from service.server.child_processes import die_with_parent
from service.server.cli import serves_in_one_process
from service.server.draining import DrainingServer, uvicorn_config
from service.server.launcher import (
    clear_configured_multiprocess_dir,
    prepare_multiprocess_dir,
    settings_environment,
)
from service.server.supervisor import gunicorn_command
from service.tensors import NamedArrays
from service.traffic_window import WINDOW_S, TrafficReport
from service.types import Priority

APP_FACTORY = "service.server.tuning.ceiling:create_app_from_environment()"


class ZeroEngine:
    """An ``EngineClient`` that answers every request at once with zero rows of each of the
    model's outputs (its shape and dtype; a variable axis as long as the input it follows,
    ``length_of``, else 1 long), for the version it was validated against; it never switches
    versions."""

    def __init__(self, model: ModelInfo) -> None:
        self._status = EngineStatus(phase="ready", models=(model,), device="none", pid=os.getpid())
        self._outputs = {spec.name: spec for spec in model.manifest.outputs}
        self._inputs = {spec.name: spec for spec in model.manifest.inputs}

    def status(self) -> EngineStatus:
        return self._status

    def engines(self) -> list[EngineStatus]:
        return [self._status]

    def refusal_before_body(
        self, model: str, version: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        return None

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        rows = len(request.instances)
        outputs = NamedArrays(
            {
                name: np.zeros((rows, *self._row_shape(spec, request)), dtype=spec.numpy_dtype)
                for name, spec in self._outputs.items()
            }
        )
        return InferenceResult(outputs=outputs, version=request.version)

    def _row_shape(self, spec: TensorSpec, request: InferenceRequest) -> list[int]:
        shape = [max(size, 1) for size in spec.instance_shape]
        source = self._inputs.get(spec.length_of or "")
        if source is not None and source.variable_axis is not None:
            assert spec.variable_axis is not None  # the manifest checks that length_of has one
            length = request.instances[source.name].shape[1 + source.variable_axis]
            shape[spec.variable_axis] = length
        return shape

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GeneratedTokens]:
        """The HTTP ceiling measures tensor requests only: refused before the first item."""
        raise ConflictError("the HTTP ceiling serves tensor models, not generation")
        yield  # an async generator, as the protocol's callers iterate it

    async def switch(self, name: str, version: str) -> SwitchResult:
        raise ConflictError("the HTTP ceiling serves one version and never switches")

    async def rollback(self, name: str | None = None) -> SwitchResult:
        raise ConflictError("the HTTP ceiling serves one version and never switches")

    async def unload(self, name: str) -> str:
        raise ConflictError("the HTTP ceiling serves one model and never unloads it")

    async def split(self, name: str, weights: dict[str, int]) -> SwitchResult:
        raise ConflictError("the HTTP ceiling serves one version and never splits its traffic")

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport:
        raise ConflictError("the HTTP ceiling serves one version and never shadows")

    async def shadow_report(self, name: str) -> ShadowReport:
        raise ConflictError("the HTTP ceiling serves one version and never shadows")

    async def stop_shadow(self, name: str) -> ShadowReport:
        raise ConflictError("the HTTP ceiling serves one version and never shadows")

    async def traffic(self, name: str) -> TrafficReport:
        return TrafficReport(WINDOW_S, {})  # it computes nothing


def model_info(settings: Settings) -> ModelInfo:
    """The configured version as an engine would report it: its manifest (read, not loaded)
    and the length buckets requests are grouped by."""
    manifest = ModelRepository(settings.model_repository).resolve(
        settings.model_name, settings.model_version
    )
    return ModelInfo(
        manifest=manifest,
        device="none",
        precision=settings.precision,
        compiled=False,
        length_edges=manifest_length_edges(manifest, settings.length_buckets),
    )


def create_ceiling_app(settings: Settings, *, in_process: bool) -> FastAPI:
    """The real front-end app over a ``ZeroEngine``. ``app.state.loading`` is done at once
    (the gunicorn worker awaits it before it accepts connections)."""
    engine = ZeroEngine(model_info(settings))
    frontend = FrontendState.over(engine, settings, engine_in_process=in_process)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading: asyncio.Future[EngineStatus] = asyncio.get_running_loop().create_future()
        loading.set_result(engine.status())
        app.state.loading = loading
        if in_process:
            # As the one-process server does once its model serves (service.engine.lifecycle):
            # later full collections then skip everything alive now.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            frontend.draining = True
            frontend.refresh_gauges()

    return create_frontend_app(frontend, lifespan)


def create_app_from_environment() -> FastAPI:
    """The app of one gunicorn front end of the ceiling, from the ``BATCHSERVE_*`` variables."""
    return create_ceiling_app(load_settings(), in_process=False)


def serve_in_one_process(settings: Settings) -> int:
    """uvicorn with the options ``service.server.single.serve`` gives it."""
    clear_configured_multiprocess_dir()  # as ``batchserve serve`` does before serving alone
    app = create_ceiling_app(settings, in_process=True)
    DrainingServer(uvicorn_config(app, settings), app.state.frontend, settings.drain_delay_s).run()
    return 0


def serve_with_gunicorn(settings: Settings) -> int:
    """``settings.workers`` gunicorn front ends until SIGTERM/SIGINT, which go to gunicorn."""
    environ = dict(os.environ) | settings_environment(
        {"host": settings.host, "port": settings.port, "workers": settings.workers}
    )
    metrics_dir, temporary = prepare_multiprocess_dir(environ)
    # This process has no threads (no torch), so preexec_fn is safe here, as in the supervisor.
    gunicorn = subprocess.Popen(
        gunicorn_command(APP_FACTORY), env=environ, preexec_fn=die_with_parent
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        gunicorn.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    try:
        return gunicorn.wait()
    finally:
        if temporary:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--workers", type=int, default=None, help="front ends (default BATCHSERVE_WORKERS)"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {"host": args.host, "port": args.port}
    if args.workers is not None:
        overrides["workers"] = args.workers
    settings = load_settings(**overrides)
    configure_logging(settings.log_level, settings.library_log_level)
    if serves_in_one_process(settings):
        return serve_in_one_process(settings)
    return serve_with_gunicorn(settings)


if __name__ == "__main__":
    sys.exit(main())
