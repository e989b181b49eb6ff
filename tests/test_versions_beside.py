"""Several versions of one model loaded at once: each answers the requests named for it, exactly
as it answers alone, and the model's plain routes stay about its primary version."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from service.bridge.interface import EngineStatus
from service.bridge.published import PublishedVersion, read_published
from service.config import Settings
from service.processes import RUN_DIR_ENV
from service.server.single import create_app
from tests.apps import frontend_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan

DIGIT_ROWS = {"instances": [[[(row * 8 + col) / 64 for col in range(8)] for row in range(8)]] * 3}


@pytest.fixture
def repository(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    return root, add_digits_version(root, 0.5)


async def serve(root: Path, version: str) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    app = create_app(Settings(model_repository=root, model_version=version, device="cpu"))
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, app


async def alone(root: Path, version: str) -> object:
    async for http, _ in serve(root, version):
        response = await http.post("/predict", json=DIGIT_ROWS)
        assert response.status_code == 200
        return response.json()["predictions"]
    raise AssertionError("not served")


async def test_a_version_loaded_beside_answers_as_it_does_alone(
    repository: tuple[Path, str],
) -> None:
    root, retrained = repository
    original = DIGITS.version
    expected = {original: await alone(root, original), retrained: await alone(root, retrained)}
    assert expected[original] != expected[retrained]
    async for http, app in serve(root, original):
        engine = frontend_of(app).engine
        result = await engine.split("digits", {original: 100, retrained: 0})
        assert result.serving.version == original

        for version in (original, retrained):
            path = f"/models/digits/versions/{version}/predict"
            response = await http.post(path, json=DIGIT_ROWS)
            assert response.status_code == 200, response.text
            assert response.headers["x-model-version"] == f"digits@{version}"
            assert response.json()["predictions"] == expected[version]
            v2 = await http.post(
                f"/v2/models/digits/versions/{version}/infer",
                json={
                    "inputs": [
                        {
                            "name": "image",
                            "shape": [1, 8, 8],
                            "datatype": "FP32",
                            "data": DIGIT_ROWS["instances"][0],
                        }
                    ]
                },
            )
            assert v2.status_code == 200, v2.text
            assert v2.json()["model_version"] == version
        # Weight 0: every plain request meets the primary, and its metadata is the primary's.
        for _ in range(20):
            plain = await http.post("/predict", json=DIGIT_ROWS)
            assert plain.json()["version"] == original
        assert (await http.get("/models")).json()["loaded"]["version"] == original
        ready = await http.get(f"/v2/models/digits/versions/{retrained}/ready")
        assert ready.json()["ready"] is True

        status = engine.status()
        assert status.weights("digits") == {original: 100, retrained: 0}

        # A version switch ends the split: the version switched to alone, the others unloaded.
        await engine.switch("digits", retrained)
        assert engine.status().weights("digits") == {retrained: 100}
        gone = await http.post(f"/models/digits/versions/{original}/predict", json=DIGIT_ROWS)
        assert gone.status_code == 404
        assert (await http.post("/predict", json=DIGIT_ROWS)).json()["version"] == retrained


async def test_a_split_is_recorded_and_an_engine_started_later_serves_it(
    repository: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights live with the published record: an engine started on it (a replacement)
    loads every version of the split and serves the same weights, and its status carries
    them to a front end (over the bridge, as JSON)."""
    root, retrained = repository
    original = DIGITS.version
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    async for _, app in serve(root, original):
        await frontend_of(app).engine.split("digits", {original: 25, retrained: 75})
    assert read_published() == [
        PublishedVersion(
            "digits", retrained, previous=original, weights={original: 25, retrained: 75}
        )
    ]
    async for http, app in serve(root, original):  # model_version is the record's no more
        status = frontend_of(app).engine.status()
        primary = status.find("digits")
        assert primary is not None
        assert primary.manifest.version == retrained
        assert status.weights("digits") == {retrained: 75, original: 25}
        assert EngineStatus.from_wire(status.to_wire()).weights("digits") == {
            retrained: 75,
            original: 25,
        }
        for version in (original, retrained):
            path = f"/models/digits/versions/{version}/predict"
            assert (await http.post(path, json=DIGIT_ROWS)).json()["version"] == version


async def test_models_lists_the_versions_loaded_beside_with_their_weights(
    repository: tuple[Path, str],
) -> None:
    root, retrained = repository
    original = DIGITS.version
    async for http, app in serve(root, original):
        await frontend_of(app).engine.split("digits", {original: 30, retrained: 70})
        listed = (await http.get("/models")).json()
        assert [(m["version"], m["weight"]) for m in listed["models"]] == [(retrained, 70)]
        assert [(m["version"], m["weight"]) for m in listed["beside"]] == [(original, 30)]
        assert listed["loaded"]["version"] == retrained
        assert listed["beside"][0]["memory_bytes"] > 0
