"""Shadow traffic (``engine/shadow.py``, ``PUT/GET/DELETE /admin/models/{name}/shadow``): the
candidate's answers are compared with the served ones; the client gets the served answer
alone, whatever the candidate does."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.config import Settings
from service.engine.model_store import ModelStore
from service.server.single import create_app
from tests.digits_versions import DIGITS, add_digits_variant, copy_bundled_digits
from tests.fixtures import lifespan

TOKEN = "shadow-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: A shadow's copies are compared within this long of their served answer, on a busy machine.
SETTLE_S = 20.0


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    return root


@pytest.fixture
async def client(repository: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        model_repository=repository, model_version=DIGITS.version, device="cpu", admin_token=TOKEN
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 8, 8), dtype=np.float32)


async def predict(client: httpx.AsyncClient, image: Any) -> dict[str, Any]:
    response = await client.post("/predict", json={"instances": [np.asarray(image).tolist()]})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def shadow(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/admin/models/digits/shadow", headers=AUTH)
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


async def settled(client: httpx.AsyncClient, copies: int) -> dict[str, Any]:
    """The shadow's report once ``copies`` copies were compared, failed or dropped."""
    deadline_s = time.monotonic() + SETTLE_S
    while True:
        report = await shadow(client)
        if report["compared"] + report["failed"] + report["dropped"] >= copies:
            return report
        assert time.monotonic() < deadline_s, report
        await asyncio.sleep(0.05)


def logits_of(root: Path, version: str, batch: np.ndarray) -> np.ndarray:
    module = ModelStore(root).load("digits", version).module
    with torch.no_grad():
        return np.asarray(module(torch.from_numpy(batch)).numpy())


async def test_a_shadow_counts_the_copies_whose_label_differs(
    client: httpx.AsyncClient, repository: Path
) -> None:
    worse = add_digits_variant(repository, class_bias={3: 4.0})
    batch = images(30)
    expected = logits_of(repository, DIGITS.version, batch)
    disagreeing = int((expected.argmax(1) != logits_of(repository, worse, batch).argmax(1)).sum())
    assert 0 < disagreeing < 30  # the variant differs on some of these images, not all

    started = await client.put(
        "/admin/models/digits/shadow", headers=AUTH, json={"version": worse, "percent": 100}
    )
    assert started.status_code == 200, started.text
    assert started.json()["version"] == worse
    for image, logits in zip(batch, expected, strict=True):
        answer = await predict(client, image)
        assert answer["version"] == DIGITS.version
        np.testing.assert_allclose(answer["predictions"][0], logits, atol=1e-5)

    report = await settled(client, 30)
    assert (report["compared"], report["disagreed"]) == (30, disagreeing)
    assert report["disagreement"] == pytest.approx(disagreeing / 30)
    assert report["served_version"] == DIGITS.version
    assert {entry["candidate_version"] for entry in report["disagreements"]} == {worse}
    assert report["disagreements"][0]["detail"].startswith("logits row 0: class_scores")

    stopped = await client.delete("/admin/models/digits/shadow", headers=AUTH)
    assert stopped.status_code == 200
    assert stopped.json()["compared"] == 30
    gone = await client.get("/admin/models/digits/shadow", headers=AUTH)
    assert gone.status_code == 404


async def test_a_raising_candidate_fails_only_its_copies(
    client: httpx.AsyncClient, repository: Path
) -> None:
    raising = add_digits_variant(repository, architecture="tests.torch_models:RaisingDigits")
    started = await client.put(
        "/admin/models/digits/shadow", headers=AUTH, json={"version": raising, "percent": 100}
    )
    assert started.status_code == 200, started.text
    constant = [np.full((8, 8), value / 20, dtype=np.float32) for value in range(20)]
    expected = logits_of(repository, DIGITS.version, np.stack(constant))
    answers = await asyncio.gather(*(predict(client, image) for image in constant))
    for answer, logits in zip(answers, expected, strict=True):
        assert answer["version"] == DIGITS.version
        np.testing.assert_allclose(answer["predictions"][0], logits, atol=1e-5)
    report = await settled(client, 20)
    assert report["failed"] + report["dropped"] == 20
    assert report["compared"] == 0


async def test_a_slow_candidate_does_not_delay_served_requests(
    client: httpx.AsyncClient, repository: Path
) -> None:
    """The candidate sleeps in every forward (many times a served batch); served latency
    with the shadow copying every request stays near its latency without, measured in
    interleaved rounds; the copies the candidate cannot keep up with are dropped."""
    slow = add_digits_variant(repository, architecture="tests.torch_models:SleepingDigits")
    batch = images(16, seed=1)

    async def one_round(percent: int) -> list[float]:
        changed = await client.put(
            "/admin/models/digits/shadow", headers=AUTH, json={"version": slow, "percent": percent}
        )
        assert changed.status_code == 200, changed.text
        latencies: list[float] = []

        async def client_loop(offset: int) -> None:
            for index in range(offset, len(batch), 4):
                started_s = time.perf_counter()
                answer = await predict(client, batch[index])
                latencies.append(time.perf_counter() - started_s)
                assert answer["version"] == DIGITS.version

        await asyncio.gather(*(client_loop(offset) for offset in range(4)))
        return latencies

    without: list[float] = []
    with_shadow: list[float] = []
    for _ in range(3):
        without += await one_round(0)
        with_shadow += await one_round(100)
    ratio = statistics.median(with_shadow) / statistics.median(without)
    report = await shadow(client)
    assert report["chosen"] == 48
    # The candidate's forward alone takes longer than a served request's whole round trip:
    # had served requests waited for it, the median would have grown several times.
    assert ratio < 2.0, (ratio, statistics.median(without), report)


async def test_refused_shadows_say_why(client: httpx.AsyncClient, repository: Path) -> None:
    put = "/admin/models/digits/shadow"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"version": DIGITS.version, "percent": 10}, 409, "is the version served"),
        ({"version": "0" * 12, "percent": 10}, 404, "has no version"),
        ({"version": DIGITS.version, "percent": 101}, 422, "percent"),
    ]
    for body, status, message in cases:
        response = await client.put(put, headers=AUTH, json=body)
        assert response.status_code == status, response.text
        assert message in response.text
    assert (await client.put(put, json={"version": "x", "percent": 1})).status_code == 401
    unknown = await client.get("/admin/models/nothing/shadow", headers=AUTH)
    assert unknown.status_code == 404


async def test_a_rollout_plan_is_recorded_read_back_and_counted(client: httpx.AsyncClient) -> None:
    route = "/admin/models/digits/rollout"
    assert (await client.get(route, headers=AUTH)).status_code == 404
    plan: dict[str, Any] = {
        "model": "digits",
        "from_version": DIGITS.version,
        "to_version": "0123456789ab",
        "steps": [10, 50, 100],
        "step": 1,
        "started_at": 1.0,
        "step_started_at": 2.0,
        "decisions": [
            {"percent": 10, "verdict": "promote", "reason": "fine", "at": 2.0},
        ],
    }
    recorded = await client.put(route, headers=AUTH, json=plan)
    assert recorded.status_code == 200, recorded.text
    assert (await client.get(route, headers=AUTH)).json() == recorded.json()
    rolled_back = {
        **plan,
        "state": "rolled_back",
        "decisions": [
            *plan["decisions"],
            {"percent": 50, "verdict": "rollback", "check": "agreement", "reason": "no", "at": 3.0},
        ],
    }
    assert (await client.put(route, headers=AUTH, json=rolled_back)).status_code == 200
    assert (await client.put(route, headers=AUTH, json=rolled_back)).status_code == 200  # again
    metrics = (await client.get("/metrics")).text
    assert 'batchserve_rollout_percent{model="digits",version="0123456789ab"} 0.0' in metrics
    for verdict, check in (("promote", "none"), ("rollback", "agreement")):
        labels = f'check="{check}",model="digits",verdict="{verdict}"'
        assert f"batchserve_rollout_decisions_total{{{labels}}} 1.0" in metrics

    refused = [
        ({**plan, "steps": [10, 50]}, "end at 100"),
        ({**plan, "model": "other"}, "not 'digits'"),
        ({**plan, "to_version": DIGITS.version}, "to itself"),
    ]
    for body, message in refused:
        answer = await client.put(route, headers=AUTH, json=body)
        assert answer.status_code == 422, answer.text
        assert message in answer.text
