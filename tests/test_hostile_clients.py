"""One costly request never holds the front end: handler work runs off the event loop, is
bounded before it starts, and is abandoned at the request's deadline with 504.

Timings are relative to the machine: a probe's latency is compared with the costly request's
own duration on the same server, never with a fixed number of milliseconds.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.manifest import HandlerSpec
from service.packaging.package import Packager
from service.server.single import create_app
from tests.apps import engine_of
from tests.fixtures import HANDLER_GATE, lifespan
from tests.test_handler_serving import multipart, png

STORE = ModelStore(BUNDLED_MODEL_REPOSITORY)
DIGITS = STORE.resolve("digits")
DIGIT = {"instances": [[[0.5] * 8] * 8]}

GATED_HANDLER = '''
from service.frontend.handlers.base import Handler
from tests.fixtures import HANDLER_GATE


class WaitsAtTheGate(Handler):
    """The tensor handler, held at the test's gate first (a slow tokenizer, say)."""

    def preprocess(self, request):
        HANDLER_GATE.entered.set()
        HANDLER_GATE.opened.wait(timeout=5.0)
        request.check_deadline("the gate was passed")
        return super().preprocess(request)
'''


def gated_repository(tmp_path: Path) -> Path:
    """``digits`` as bundled, and ``gated``: its weights behind ``WaitsAtTheGate``."""
    repository = tmp_path / "repository"
    shutil.copytree(BUNDLED_MODEL_REPOSITORY / "digits", repository / "digits")
    module = tmp_path / "gated.py"
    module.write_text(GATED_HANDLER)
    Packager(repository).package(
        name="gated",
        artifact=STORE.version_folder("digits", DIGITS.version) / DIGITS.artifact,
        format=DIGITS.format,
        architecture=DIGITS.architecture,
        inputs=DIGITS.inputs,
        outputs=DIGITS.outputs,
        handler=HandlerSpec(import_path="gated:WaitsAtTheGate"),
        files=[module],
    )
    return repository


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(device="cpu", **settings))
    # Generous: starting takes seconds on a busy machine (the default 5 s timed out).
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=30.0
        ) as client:
            yield client


async def test_a_handler_held_up_never_holds_healthz_or_another_model(tmp_path: Path) -> None:
    HANDLER_GATE.reset()
    async with serving(
        model_repository=gated_repository(tmp_path), models=("digits", "gated")
    ) as server:
        held = asyncio.create_task(server.post("/models/gated/predict", json=DIGIT))
        assert await asyncio.to_thread(HANDLER_GATE.entered.wait, 5.0)

        health = await server.get("/healthz")
        other = await server.post("/models/digits/predict", json=DIGIT)
        still_held = not held.done()
        HANDLER_GATE.opened.set()
        answer = await held

    assert still_held  # the probes were answered while the handler waited
    assert (health.status_code, other.status_code, answer.status_code) == (200, 200, 200)
    assert answer.json()["predictions"] == other.json()["predictions"]


async def test_a_deadline_passing_during_preprocessing_is_504_at_the_deadline(
    tmp_path: Path,
) -> None:
    HANDLER_GATE.reset()
    async with serving(
        model_repository=gated_repository(tmp_path),
        models=("digits", "gated"),
        request_timeout_ms=1000.0,
    ) as server:
        HANDLER_GATE.opened.set()
        await server.post("/models/gated/predict", json=DIGIT)  # an estimate exists
        HANDLER_GATE.reset()
        started_s = time.monotonic()
        late = await server.post("/models/gated/predict", json=DIGIT)
        waited_s = time.monotonic() - started_s
        HANDLER_GATE.opened.set()

    assert late.status_code == 504, late.text
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded"
    assert "while its body was being preprocessed" in error["message"]
    assert waited_s < 4.0  # answered at its 1 s deadline, not when the gate's 5 s ran out


def bilevel_png(side: int) -> bytes:
    """A one-bit white square: a few KB that decode to ``side``² pixels."""
    return png(Image.new("1", (side, side), 1))


async def test_a_costly_image_request_delays_a_probe_by_a_fraction_of_its_own_time() -> None:
    # 4 x 16 Mpx: the most one request may declare (64 Mpx), decoded in a handler thread.
    body, content_type = multipart([bilevel_png(4000)] * 4)
    headers = {"Content-Type": content_type}
    async with serving(models=("digits_png", "digits")) as server:
        idle = []
        for _ in range(5):
            started_s = time.perf_counter()
            assert (await server.get("/healthz")).status_code == 200
            idle.append(time.perf_counter() - started_s)
        started_s = time.perf_counter()
        costly = asyncio.create_task(
            server.post("/models/digits_png/predict", content=body, headers=headers)
        )
        probes = []
        while not costly.done():
            probe_started_s = time.perf_counter()
            health = await server.get("/healthz")
            other = await server.post("/models/digits/predict", json=DIGIT)
            assert (health.status_code, other.status_code) == (200, 200)
            probes.append(time.perf_counter() - probe_started_s)
        answer = await costly
        costly_s = time.perf_counter() - started_s
    assert answer.status_code == 200, answer.text
    assert len(probes) >= 3, (probes, costly_s)
    # Before: the first probe waited for the whole decode (the loop was held).
    assert max(probes) < costly_s / 3, (probes, costly_s, statistics.median(idle))


async def test_a_decompression_bomb_of_many_images_is_refused_from_their_headers() -> None:
    """128 images of 16 Mpx in 1 MB: refused with 413 in about the time a small request takes,
    since no image is decoded (before: 5.4 s decoding on the event loop)."""
    bomb, content_type = multipart([bilevel_png(4000)] * 128)
    small, _ = multipart([bilevel_png(28)])
    headers = {"Content-Type": content_type}
    async with serving(model_name="digits_png") as server:
        await server.post("/predict", content=small, headers=headers)
        started_s = time.perf_counter()
        ok = await server.post("/predict", content=small, headers=headers)
        small_s = time.perf_counter() - started_s
        started_s = time.perf_counter()
        refused = await server.post("/predict", content=bomb, headers=headers)
        bomb_s = time.perf_counter() - started_s
    assert ok.status_code == 200
    assert refused.status_code == 413, refused.text
    assert "declare 2,048,000,000 pixels together" in refused.json()["error"]["message"]
    assert bomb_s < max(0.5, 20 * small_s), (bomb_s, small_s)
