"""CPU per request of a front end's own Python, without HTTP parsing, sockets or an engine.

``python loadtests/frontend_asgi_cost.py [--requests 20000] [--concurrency 64] [--model mlp]``,
run with ``PYTHONPATH`` naming the checkout to measure (it imports only ``service``, so it
measures any checkout whose front end has the same constructor): drives the front end's ASGI
app directly with ``POST /predict`` (one JSON instance: the MLP's 256 floats, or with
``--model digits`` the digits model's 8x8 pixels in [0, 1] on a 1/16 grid, as
``loadtests.bodies.digits_bodies`` draws them) from ``--concurrency`` tasks, answered at once
by an engine that returns zeros, and prints the process CPU time per request in µs. What it
leaves out (uvicorn, the bridge) ``loadtests.frontend_cost`` measures with the rest.

Under callgrind, count instructions per request with ``PYTHONHASHSEED=0`` and
``--concurrency 8``, as the difference of two runs (``--requests 640`` and ``1920``, divided
by 1,280): slowed down fifty times, a loop turn of 64 clients' requests outlasts the
disconnect watch's 100 ms (``requests.DisconnectWatcher``), which then starts watches whose
number depends on the machine's speed, and the hash seed moves dict layouts; with both fixed,
a count repeats within a few hundred instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from service.bridge.interface import EngineStatus, InferenceRequest, InferenceResult, ModelInfo
from service.config import Settings
from service.errors import ServiceError
from service.frontend.app import create_frontend_app
from service.frontend.state import FrontendState
from service.manifest import Architecture, Manifest, TensorSpec
from service.metrics import FrontendMetrics, ProcessMetrics
from service.repository import ModelRepository
from service.tensors import NamedArrays
from service.types import Priority

FEATURES = 256
CLASSES = 10


class EngineAnsweringZeros:
    """An engine that answers every request with zero logits on the event loop's next turn
    (so that requests overlap, as they do waiting for a real engine)."""

    def __init__(self, model: ModelInfo) -> None:
        self._status = EngineStatus(phase="ready", models=(model,))

    def status(self) -> EngineStatus:
        return self._status

    def engines(self) -> list[EngineStatus]:
        return [self._status]

    def refusal_before_body(
        self, model: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        return None

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        await asyncio.sleep(0)
        rows = len(next(iter(request.instances.arrays.values())))
        logits = np.zeros((rows, CLASSES), np.float32)
        return InferenceResult(NamedArrays({"logits": logits}), request.version)

    async def switch(self, name: str, version: str) -> Any:
        raise NotImplementedError

    async def rollback(self, name: str | None = None) -> Any:
        raise NotImplementedError

    async def unload(self, name: str) -> str:
        raise NotImplementedError


#: Per model: its architecture, its one input (as ``scripts/train_digits.py`` packages the
#: digits model) and a body's instance from a seeded generator.
MODELS: dict[str, tuple[str, TensorSpec, Callable[[np.random.Generator], list[Any]]]] = {
    "mlp": (
        "service.models.mlp:PeerMLP",
        TensorSpec(name="features", dtype="float32", shape=(-1, FEATURES)),
        lambda rng: rng.standard_normal(FEATURES).round(4).tolist(),
    ),
    "digits": (
        "service.models.digits:DigitsCNN",
        TensorSpec(name="image", dtype="float32", shape=(-1, 8, 8), min_value=0.0, max_value=1.0),
        lambda rng: (rng.integers(0, 17, size=(8, 8)) / 16).tolist(),
    ),
}


def model_info(name: str) -> ModelInfo:
    architecture, spec, _ = MODELS[name]
    manifest = Manifest.create(
        name=name,
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64},
        architecture=Architecture(import_path=architecture),
        inputs=(spec,),
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, CLASSES)),),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return ModelInfo(manifest, "cpu", "fp32", False, length_edges=())


def scope_of(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }


async def measure(requests: int, concurrency: int, model: str = "mlp") -> float:
    rng = np.random.default_rng(0)
    instance = MODELS[model][2]
    bodies = [json.dumps({"instances": [instance(rng)]}).encode() for _ in range(64)]
    with tempfile.TemporaryDirectory() as folder:
        registry = CollectorRegistry()
        settings = Settings(model_repository=Path(folder))
        frontend = FrontendState(
            settings=settings,
            metrics=FrontendMetrics(registry),
            process_metrics=ProcessMetrics("frontend", registry),
            registry=registry,
            engine=EngineAnsweringZeros(model_info(model)),
            repository=ModelRepository(Path(folder)),
            engine_in_process=False,
        )

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            yield

        app = create_frontend_app(frontend, lifespan)
        statuses: list[int] = []

        async def client(first: int, count: int) -> None:
            for index in range(first, first + count):
                body = bodies[index % len(bodies)]

                async def receive(body: bytes = body) -> dict[str, Any]:
                    return {"type": "http.request", "body": body, "more_body": False}

                async def send(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        statuses.append(message["status"])

                await app(scope_of(body), receive, send)

        per_client = requests // concurrency
        await asyncio.gather(*(client(0, 16) for _ in range(concurrency)))  # warm up
        statuses.clear()
        started = time.process_time()
        await asyncio.gather(*(client(i * per_client, per_client) for i in range(concurrency)))
        spent = time.process_time() - started
        if set(statuses) != {200}:
            raise RuntimeError(f"answers other than 200: {sorted(set(statuses))}")
        return spent / len(statuses) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    args = parser.parse_args()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(f"{runner(measure(args.requests, args.concurrency, args.model)):.1f}")


if __name__ == "__main__":
    main()
