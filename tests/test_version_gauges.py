"""An engine's batcher gauges are labelled by version too: two versions of one model loaded at
once (a traffic split) each show their own queue, rather than overwrite each other's."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from service.bridge.interface import InferenceRequest
from service.config import Settings
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan, wait_until


async def test_each_version_loaded_shows_its_own_queue_depth(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    settings = Settings(model_repository=root, model_version=DIGITS.version, device="cpu")
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        engine = engine_of(app)
        await engine.split("digits", {DIGITS.version: 50, retrained: 50})
        registry = engine.state.metrics.registry

        def depth(version: str) -> float | None:
            labels = {"model": "digits", "version": version}
            return registry.get_sample_value("batchserve_queue_depth", labels)

        def effective(version: str) -> float | None:
            labels = {"model": "digits", "version": version}
            return registry.get_sample_value("batchserve_effective_max_batch_size", labels)

        assert effective(DIGITS.version) == effective(retrained) == settings.max_batch_size
        turns = engine.state.device_turns
        await turns.acquire("digits")  # no batch of digits runs: what is queued stays queued
        try:
            image = NamedArrays({"image": np.zeros((1, 8, 8), dtype=np.float32)})
            deadline_s = time.monotonic() + 60
            tickets = [
                engine.enqueue(
                    InferenceRequest("digits", version, image, "normal", deadline_s, str(i))
                )[0]
                for i, version in enumerate([DIGITS.version] * 3 + [retrained])
            ]
            await wait_until(lambda: depth(DIGITS.version) == 3 and depth(retrained) == 1)
        finally:
            turns.release("digits")
        for ticket in tickets:
            await ticket.wait()
        await wait_until(lambda: depth(DIGITS.version) == 0 and depth(retrained) == 0)

        await engine.split("digits", {DIGITS.version: 100})  # the retrained one unloaded
        await wait_until(lambda: depth(retrained) is None)
        assert effective(retrained) is None
