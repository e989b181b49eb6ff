"""The before-body 429 check of a request bound to a version loaded beside the primary looks at
that version's own queue, not the primary's."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from service.bridge.interface import InferenceRequest
from service.config import Settings
from service.errors import QueueFullError
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of, frontend_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan


async def test_a_full_primary_queue_does_not_refuse_a_version_beside_it(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    settings = Settings(
        model_repository=root,
        model_version=DIGITS.version,
        device="cpu",
        max_queue_size=2,
        max_batch_size=1,
        max_instances_per_request=1,
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        engine, frontend = engine_of(app), frontend_of(app)
        await engine.split("digits", {DIGITS.version: 50, retrained: 50})
        turns = engine.state.device_turns
        await turns.acquire("digits")  # no batch of digits runs: what is queued stays queued
        try:
            image = NamedArrays({"image": np.zeros((1, 8, 8), dtype=np.float32)})
            deadline_s = time.monotonic() + 60
            requests = [
                InferenceRequest("digits", DIGITS.version, image, "normal", deadline_s, str(i))
                for i in range(3)
            ]
            tickets = [engine.enqueue(request)[0] for request in requests[:2]]
            with pytest.raises(QueueFullError):
                engine.enqueue(requests[2])  # the primary's queue is full
            bound = frontend.admitting_model("digits", retrained)  # not refused
            assert bound.manifest.version == retrained
            with pytest.raises(QueueFullError):
                frontend.admitting_model("digits", DIGITS.version)
            assert engine.refusal_before_body("digits", DIGITS.version, "normal", None)
            assert engine.refusal_before_body("digits", retrained, "normal", None) is None
        finally:
            turns.release("digits")
        for ticket in tickets:
            await ticket.wait()
