"""``GET /admin/models/{name}/traffic`` counts every request, whichever front end it came
through: the engine counts what it answers, by version, and the admin API sums the engines
(with ``--workers N``, a rollout judges the whole traffic, not one front end's share)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine
from service.metrics import EngineMetrics
from service.server.frontend_process import create_frontend_process_app
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan

TOKEN = "traffic-every-frontend-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIGIT_ROWS = {"instances": [[[(row * 8 + col) / 64 for col in range(8)] for row in range(8)]]}


@contextlib.asynccontextmanager
async def frontend(settings: Settings, socket_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """One front end (a gunicorn worker's app) reaching the engine through the bridge."""
    app = create_frontend_process_app(settings, [(socket_path, "cpu")])
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


async def test_two_front_ends_read_the_same_traffic_of_every_request(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    settings = Settings(
        model_repository=root, model_version=DIGITS.version, device="cpu", admin_token=TOKEN
    )
    with tempfile.TemporaryDirectory(prefix="traffic-") as folder:
        socket_path = Path(folder) / "engine.sock"
        engine = Engine(settings, EngineMetrics())
        server = BridgeServer(engine, socket_path, heartbeat_interval_s=0.2)
        engine.add_listener(server.status_changed)
        await server.start()
        await engine.start()
        try:
            async with (
                frontend(settings, socket_path) as first,
                frontend(settings, socket_path) as second,
            ):
                weights = {DIGITS.version: 50, retrained: 50}
                put = "/admin/models/digits/traffic"
                assert (await first.put(put, json={"weights": weights}, headers=AUTH)).is_success
                sent = {DIGITS.version: 0, retrained: 0}
                for http, count in ((first, 3), (second, 5)):
                    for _ in range(count):
                        answer = await http.post("/predict", json=DIGIT_ROWS)
                        assert answer.status_code == 200, answer.text
                        sent[answer.json()["version"]] += 1
                path = f"/models/digits/versions/{retrained}/predict"
                assert (await second.post(path, json=DIGIT_ROWS)).status_code == 200
                sent[retrained] += 1

                for http in (first, second):
                    read = (await http.get(put, headers=AUTH)).json()
                    counted = {v: w["requests"] for v, w in read["versions"].items()}
                    assert counted == sent, (counted, sent)
                    assert all(w["errors"] == 0 for w in read["versions"].values())
                    assert all(w["p99_ms"] > 0 for w in read["versions"].values())
        finally:
            await engine.shut_down()
            await server.close()
