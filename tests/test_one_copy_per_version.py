"""One loaded copy of a version per engine, whatever asks for it: a traffic split, a shadow or a
switch share it, and it is unloaded only when none of them uses it any more."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.engine.engine import Engine
from service.engine.state import ServedModel
from service.errors import ModelNotFoundError, ModelRejectedError
from service.server.single import create_app
from tests.apps import engine_of
from tests.digits_versions import DIGITS, add_digits_variant, copy_bundled_digits
from tests.fixtures import lifespan

DIGIT_ROWS = {"instances": [[[(row * 8 + col) / 64 for col in range(8)] for row in range(8)]] * 2}
#: A shadow's copies are compared within this long of their served answer, on a busy machine.
SETTLE_S = 20.0

Served = tuple[httpx.AsyncClient, Engine, str]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """digits served at its bundled version, and a candidate version that may shadow it."""
    root = tmp_path / "models"
    copy_bundled_digits(root)
    candidate = add_digits_variant(root, {3: 0.25})
    app = create_app(Settings(model_repository=root, model_version=DIGITS.version, device="cpu"))
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, engine_of(app), candidate


def copies_of(engine: Engine, version: str) -> list[ServedModel]:
    """The distinct loaded copies of digits@``version``: served or a shadow's."""
    state = engine.state
    found: list[ServedModel] = []
    every = [*state.models.values(), *state.beside.get("digits", {}).values()]
    for copy in [*every, *state.shadow_candidates.values()]:
        if copy.manifest.version == version and not any(copy is seen for seen in found):
            found.append(copy)
    return found


async def compared_at_least(http: httpx.AsyncClient, engine: Engine, count: int) -> None:
    """Send plain requests until the shadow has compared ``count`` copies."""
    deadline_s = time.monotonic() + SETTLE_S
    while (await engine.shadow_report("digits")).compared < count:
        assert time.monotonic() < deadline_s, await engine.shadow_report("digits")
        assert (await http.post("/predict", json=DIGIT_ROWS)).status_code == 200
        await asyncio.sleep(0.05)


async def test_a_shadow_of_a_version_loaded_beside_runs_on_that_copy(served: Served) -> None:
    http, engine, candidate = served
    await engine.split("digits", {DIGITS.version: 90, candidate: 10})
    await engine.start_shadow("digits", candidate, 100)
    assert len(copies_of(engine, candidate)) == 1
    await compared_at_least(http, engine, 2)

    await engine.stop_shadow("digits")  # the split still serves it: not unloaded
    path = f"/models/digits/versions/{candidate}/predict"
    response = await http.post(path, json=DIGIT_ROWS)
    assert response.status_code == 200, response.text
    assert response.json()["version"] == candidate


async def test_a_split_naming_the_shadows_candidate_serves_the_shadows_copy(
    served: Served,
) -> None:
    http, engine, candidate = served
    await engine.start_shadow("digits", candidate, 100)
    await compared_at_least(http, engine, 1)
    await engine.split("digits", {DIGITS.version: 90, candidate: 10})
    assert len(copies_of(engine, candidate)) == 1
    assert engine.state.shadow_candidates["digits"] is engine.state.beside["digits"][candidate]
    before = (await engine.shadow_report("digits")).compared
    await compared_at_least(http, engine, before + 1)  # the shadow goes on, on the split's copy


async def test_a_split_that_drops_the_shadows_version_leaves_it_loaded_for_the_shadow(
    served: Served,
) -> None:
    http, engine, candidate = served
    await engine.split("digits", {DIGITS.version: 90, candidate: 10})
    await engine.start_shadow("digits", candidate, 100)
    await engine.split("digits", {DIGITS.version: 100})
    assert len(copies_of(engine, candidate)) == 1
    before = (await engine.shadow_report("digits")).compared
    await compared_at_least(http, engine, before + 1)
    copy = engine.state.shadow_candidates["digits"]
    await engine.stop_shadow("digits")  # nothing uses it now: unloaded
    assert copies_of(engine, candidate) == []
    assert not copy.batcher.accepting


async def test_switching_to_a_version_loaded_beside_promotes_that_copy(served: Served) -> None:
    http, engine, candidate = served
    await engine.split("digits", {DIGITS.version: 90, candidate: 10})
    copy = engine.state.beside["digits"][candidate]
    await engine.switch("digits", candidate)
    assert engine.state.models["digits"] is copy
    assert (await http.post("/predict", json=DIGIT_ROWS)).json()["version"] == candidate


async def test_a_refused_split_that_took_the_shadows_copy_stops_the_shadow(
    served: Served, tmp_path: Path
) -> None:
    """The shadow's copy made way for the split's, whose load then failed: the shadow stops
    (and says so, 404), rather than keep pointing at an unloaded copy."""
    _, engine, candidate = served
    tampered = add_digits_variant(tmp_path / "models", {5: 0.5})
    artifact = tmp_path / "models" / "digits" / tampered / DIGITS.artifact
    artifact.write_bytes(artifact.read_bytes()[:-4] + b"\0\0\0\0")
    await engine.start_shadow("digits", candidate, 100)
    with pytest.raises(ModelRejectedError):
        await engine.split("digits", {DIGITS.version: 50, candidate: 25, tampered: 25})
    assert copies_of(engine, candidate) == []
    with pytest.raises(ModelNotFoundError):
        await engine.shadow_report("digits")
