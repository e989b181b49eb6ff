"""The /admin routes: bearer token, version switch, refusal of a tampered version, rollback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from service.bridge.published import PublishedVersion, publish, read_published
from service.config import Settings
from service.processes import RUN_DIR_ENV
from service.server.single import create_app
from tests.apps import frontend_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan, predict_scope, wait_until

TOKEN = "s3cret-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ONE_DIGIT = {"instances": [[[0.5] * 8] * 8]}


@dataclass
class Versions:
    original: str
    retrained: str
    tampered: str


@pytest.fixture
def repository(tmp_path: Path) -> tuple[Path, Versions]:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    tampered = add_digits_version(root, 1.0)
    artifact = root / "digits" / tampered / "model.safetensors"
    artifact.write_bytes(artifact.read_bytes()[:-4] + b"\0\0\0\0")
    return root, Versions(DIGITS.version, retrained, tampered)


async def client_for(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


@pytest.fixture
async def client(repository: tuple[Path, Versions]) -> AsyncIterator[httpx.AsyncClient]:
    root, versions = repository
    settings = Settings(
        model_repository=root, model_version=versions.original, device="cpu", admin_token=TOKEN
    )
    async for http in client_for(settings):
        yield http


async def serving_version(client: httpx.AsyncClient) -> str:
    response = await client.post("/predict", json=ONE_DIGIT)
    assert response.status_code == 200
    version: str = response.json()["version"]
    assert response.headers["x-model-version"] == f"digits@{version}"
    return version


async def test_admin_routes_need_the_bearer_token(client: httpx.AsyncClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = await client.get("/admin/models/digits/versions", headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in response.text
        assert response.json()["error"]["request_id"]


async def test_admin_api_is_disabled_without_a_token() -> None:
    async for http in client_for(Settings(device="cpu")):
        response = await http.post("/admin/rollback", headers=AUTH)
        assert response.status_code == 403
        assert "BATCHSERVE_ADMIN_TOKEN" in response.json()["error"]["message"]


async def test_list_load_and_roll_back(
    client: httpx.AsyncClient, repository: tuple[Path, Versions]
) -> None:
    _, versions = repository
    listed = (await client.get("/admin/models/digits/versions", headers=AUTH)).json()
    assert listed["serving"] == versions.original
    assert {entry["version"] for entry in listed["versions"]} == {
        versions.original,
        versions.retrained,
        versions.tampered,
    }
    assert await serving_version(client) == versions.original

    loaded = await client.post(
        f"/admin/models/digits/versions/{versions.retrained}/load", headers=AUTH
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["serving"]["version"] == versions.retrained
    assert loaded.json()["replaced"] == f"digits@{versions.original}"
    assert await serving_version(client) == versions.retrained
    models = (await client.get("/models")).json()
    assert models["loaded"]["version"] == versions.retrained
    metrics = (await client.get("/metrics")).text
    assert f'version="{versions.retrained}"' in metrics
    assert (
        f'batchserve_model_info{{compiled="False",device="cpu",model="digits",precision="fp32",version="{versions.original}"'
        not in metrics
    )

    rolled_back = await client.post("/admin/rollback", headers=AUTH)
    assert rolled_back.status_code == 200
    assert await serving_version(client) == versions.original


async def test_a_tampered_version_is_refused_and_the_old_one_keeps_serving(
    client: httpx.AsyncClient, repository: tuple[Path, Versions]
) -> None:
    root, versions = repository
    response = await client.post(
        f"/admin/models/digits/versions/{versions.tampered}/load", headers=AUTH
    )
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert "refusing to load" in message
    assert f"still serving digits@{versions.original}" in message
    assert str(root) not in message
    assert await serving_version(client) == versions.original
    assert (await client.get("/readyz")).status_code == 200


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/admin/models/digits/versions/0123456789ab/load", 404),
        ("/admin/models/nothing/versions/latest/load", 404),
        ("/admin/models/%2E%2E/versions/latest/load", 404),
        ("/admin/models/digits/versions/..%2F..%2Fetc/load", 404),
        ("/admin/models/digits/versions/LATEST/load", 404),
        ("/admin/models/..%5C..%5Cx/versions", 404),
    ],
)
async def test_unknown_and_path_traversal_names_are_404(
    client: httpx.AsyncClient, path: str, status: int
) -> None:
    response = await client.request("POST" if path.endswith("load") else "GET", path, headers=AUTH)
    assert response.status_code == status
    assert response.json()["error"]["code"] in ("model_not_found", "not_found")


async def test_nothing_to_roll_back_to_is_a_conflict(client: httpx.AsyncClient) -> None:
    response = await client.post("/admin/rollback", headers=AUTH)
    assert response.status_code == 409


async def test_an_engine_started_after_a_switch_serves_it_and_can_roll_it_back(
    repository: tuple[Path, Versions], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement engine starts on the version recorded by the engines before it
    (``bridge/published.py``), not on ``model_version``, and knows what came before it."""
    root, versions = repository
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    publish([PublishedVersion("digits", versions.retrained, previous=versions.original)])
    settings = Settings(
        model_repository=root, model_version=versions.original, device="cpu", admin_token=TOKEN
    )
    async for http in client_for(settings):
        assert await serving_version(http) == versions.retrained
        rolled_back = await http.post("/admin/rollback", headers=AUTH)
        assert rolled_back.status_code == 200, rolled_back.text
        assert await serving_version(http) == versions.original
        assert read_published() == [
            PublishedVersion("digits", versions.original, previous=versions.retrained)
        ]


async def test_loading_another_model_serves_it_beside_the_first_until_unloaded() -> None:
    """/predict stays with the first model; the second answers on its own route, and
    unloading it takes that route away again. The only model left cannot be unloaded."""
    async for http in client_for(Settings(device="cpu", admin_token=TOKEN)):  # both models
        response = await http.post("/admin/models/textenc/versions/latest/load", headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["replaced"] == "nothing"
        assert await serving_version(http) == DIGITS.version
        tokens = {"instances": [[1, 2, 3]]}
        answered = await http.post("/models/textenc/predict", json=tokens)
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == "textenc"

        unloaded = await http.post("/admin/models/textenc/unload", headers=AUTH)
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json()["unloaded"].startswith("textenc@")
        gone = await http.post("/models/textenc/predict", json=tokens)
        assert gone.status_code == 404
        assert "unknown model 'textenc'" in gone.json()["error"]["message"]

        last = await http.post("/admin/models/digits/unload", headers=AUTH)
        assert last.status_code == 409
        assert "the only model served" in last.json()["error"]["message"]
        assert await serving_version(http) == DIGITS.version


async def test_a_version_whose_manifest_names_another_is_refused_with_422(
    client: httpx.AsyncClient, repository: tuple[Path, Versions]
) -> None:
    root, versions = repository
    folder = root / "digits" / versions.retrained
    impostor = root / "digits" / "abcdefabcdef"
    folder.rename(impostor)  # its manifest still says versions.retrained
    response = await client.post("/admin/models/digits/versions/abcdefabcdef/load", headers=AUTH)
    assert response.status_code == 422, response.text
    assert "the manifest describes" in response.json()["error"]["message"]
    assert await serving_version(client) == versions.original


async def test_switching_versions_while_bodies_upload_fails_no_request(
    repository: tuple[Path, Versions],
) -> None:
    """A request bound to the version served when it arrived found that version's batcher
    draining after its body came: 8.7 % got 503 while versions toggled."""
    root, versions = repository
    settings = Settings(
        model_repository=root, model_version=versions.original, device="cpu", admin_token=TOKEN
    )
    app = create_app(settings)
    body = orjson.dumps(ONE_DIGIT)
    statuses: list[int] = []

    async def slow_upload() -> None:
        pieces = [body[:20], body[20:]]

        async def receive() -> dict[str, object]:
            if len(pieces) == 2:
                piece = pieces.pop(0)
                return {"type": "http.request", "body": piece, "more_body": True}
            await asyncio.sleep(0.02)  # the second half comes 20 ms later
            return {"type": "http.request", "body": pieces.pop(0), "more_body": False}

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(int(message["status"]))  # type: ignore[call-overload]

        await app(predict_scope([(b"content-type", b"application/json")]), receive, send)

    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as admin:
            for round_index in range(6):
                target = versions.retrained if round_index % 2 == 0 else versions.original
                uploads = [asyncio.create_task(slow_upload()) for _ in range(20)]
                # Headers in (each request bound to the version served), bodies still coming.
                await wait_until(lambda: frontend_of(app).receiving == 20)
                switched = await admin.post(
                    f"/admin/models/digits/versions/{target}/load", headers=AUTH
                )
                assert switched.status_code == 200, switched.text
                await asyncio.gather(*uploads)
    assert statuses == [200] * 120
