"""A model's traffic split: the choice of a version by weight (sticky by a routing key), the
window of each version's recent answers, and the admin API through the app."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.errors import InvalidInputError
from service.frontend.state import FrontendState
from service.server.single import create_app
from service.traffic_split import (
    BUCKETS,
    bucket_of,
    checked_weights,
    primary_of,
    version_for,
)
from service.traffic_window import TrafficWindow, VersionStats
from tests.apps import frontend_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan

TOKEN = "traffic-split-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ONE_DIGIT = {"instances": [[[(row * 8 + col) / 64 for col in range(8)] for row in range(8)]]}


# ----------------------------------------------------------------- the choice, pure


def test_keys_meet_versions_by_weight_and_always_the_same_one() -> None:
    weights = {"aaaaaaaaaaaa": 95, "bbbbbbbbbbbb": 5}
    rng = random.Random(40)
    keys = [f"user-{rng.getrandbits(64):x}" for _ in range(5_000)]
    chosen = {key: version_for(weights, bucket_of("digits", key)) for key in keys}
    shares = Counter(chosen.values())
    for version, weight in weights.items():
        assert abs(100 * shares[version] / len(keys) - weight) <= 2, shares
    assert all(version_for(weights, bucket_of("digits", key)) == chosen[key] for key in keys)


def test_requests_without_a_key_meet_versions_by_weight() -> None:
    weights = {"aaaaaaaaaaaa": 70, "bbbbbbbbbbbb": 0, "cccccccccccc": 30}
    rng = random.Random(7)
    shares = Counter(version_for(weights, rng.randrange(BUCKETS)) for _ in range(5_000))
    assert shares["bbbbbbbbbbbb"] == 0
    assert abs(100 * shares["aaaaaaaaaaaa"] / 5_000 - 70) <= 2, shares


def test_every_bucket_meets_the_version_whose_share_holds_it() -> None:
    weights = {"a": 1, "b": 0, "c": 99}
    assert version_for(weights, 0) == "a"
    assert version_for(weights, 99) == "a"
    assert version_for(weights, 100) == "c"
    assert version_for(weights, BUCKETS - 1) == "c"
    assert version_for({"a": 100}, BUCKETS - 1) == "a"


def test_a_key_is_hashed_with_its_model() -> None:
    assert bucket_of("digits", "k") == bucket_of("digits", "k")
    assert 0 <= bucket_of("digits", "k") < BUCKETS
    spread = {bucket_of(model, "k") for model in ("a", "b", "c", "d", "e")}
    assert len(spread) > 1


def test_the_primary_is_the_version_with_most_weight() -> None:
    assert primary_of({"a": 5, "b": 95}) == "b"
    assert primary_of({"a": 50, "b": 50}, current="b") == "b"
    assert primary_of({"a": 50, "b": 50}, current="c") == "a"


@pytest.mark.parametrize(
    ("weights", "quoted"),
    [
        ({}, "at least one"),
        ({"a": 60, "b": 30}, "got 90"),
        ({"a": 101, "b": -1}, "got 101"),
        ({"a": 99.5, "b": 0.5}, "got 99.5"),
        ({"a": True}, "got True"),
    ],
)
def test_bad_weights_are_refused_quoting_them(weights: dict[str, object], quoted: str) -> None:
    with pytest.raises(InvalidInputError, match=quoted):
        checked_weights(weights)


# ----------------------------------------------------------------- the window, pure


def test_the_window_counts_each_versions_recent_answers() -> None:
    window = TrafficWindow(window_s=10.0, max_answers=1_000)
    for index in range(100):
        window.record("m", "v1", 100.0 + index * 0.01, (index + 1) / 1000, 200)
    window.record("m", "v2", 105.0, 0.5, 500)
    window.record("other", "v1", 105.0, 0.5, 200)
    stats = window.stats("m", 105.0)
    assert stats["v1"] == VersionStats(requests=100, errors=0, p50_ms=50.0, p99_ms=99.0)
    assert stats["v2"] == VersionStats(requests=1, errors=1, p50_ms=500.0, p99_ms=500.0)
    assert stats["v2"].to_json()["error_rate"] == 1.0
    # Over 10 s later the answers of v1 (100-101 s) have left the window; v2's (105 s) not yet.
    later = window.stats("m", 111.5)
    assert set(later) == {"v2"}
    assert window.stats("m", 200.0) == {}


def test_the_window_keeps_at_most_its_bound() -> None:
    window = TrafficWindow(window_s=60.0, max_answers=10)
    for index in range(25):
        window.record("m", "v", 1.0, float(index), 200)
    stats = window.stats("m", 1.0)["v"]
    assert stats.requests == 10
    assert stats.p50_ms == 19_000.0  # the newest ten: 15..24 s


# ----------------------------------------------------------------- through the app


Served = tuple[httpx.AsyncClient, str, str, FrontendState]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    settings = Settings(
        model_repository=root, model_version=DIGITS.version, device="cpu", admin_token=TOKEN
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, DIGITS.version, retrained, frontend_of(app)


async def test_requests_meet_the_version_their_key_and_the_weights_give(served: Served) -> None:
    http, original, retrained, _ = served
    alone = {}
    for version in (original, retrained):
        path = f"/models/digits/versions/{version}/predict"
        named = await http.post(path, json=ONE_DIGIT)
        assert named.status_code == (200 if version == original else 404)
    weights = {original: 70, retrained: 30}
    put = await http.put("/admin/models/digits/traffic", json={"weights": weights}, headers=AUTH)
    assert put.status_code == 200, put.text
    assert put.json()["weights"] == weights
    for version in (original, retrained):
        path = f"/models/digits/versions/{version}/predict"
        alone[version] = (await http.post(path, json=ONE_DIGIT)).json()["predictions"]
    assert alone[original] != alone[retrained]
    # A request naming a version meets it, the primary too, whatever the weights.
    for version in (original, retrained) * 20:
        path = f"/models/digits/versions/{version}/predict"
        named = await http.post(path, json=ONE_DIGIT)
        assert named.headers["x-model-version"] == f"digits@{version}"
        assert named.json()["predictions"] == alone[version]

    keys = [f"user-{index}" for index in range(40)]
    for key in keys * 5:
        answer = await http.post("/predict", json=ONE_DIGIT, headers={"x-routing-key": key})
        assert answer.status_code == 200
        version = answer.json()["version"]
        assert version == version_for(weights, bucket_of("digits", key)), key
        assert answer.headers["x-model-version"] == f"digits@{version}"
        assert answer.json()["predictions"] == alone[version]
    v2 = await http.post(
        "/v2/models/digits/infer",
        json={
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 8, 8],
                    "datatype": "FP32",
                    "data": ONE_DIGIT["instances"],
                }
            ]
        },
        headers={"x-routing-key": keys[0]},
    )
    assert v2.json()["model_version"] == version_for(weights, bucket_of("digits", keys[0]))

    unkeyed: Counter[str] = Counter()
    for _ in range(100):
        answer = await http.post("/predict", json=ONE_DIGIT)
        unkeyed[answer.json()["version"]] += 1
        assert answer.json()["predictions"] == alone[answer.json()["version"]]
    assert unkeyed[original] > 0, unkeyed
    assert unkeyed[retrained] > 0, unkeyed

    read = (await http.get("/admin/models/digits/traffic", headers=AUTH)).json()
    assert read["weights"] == weights
    counted = sum(read["versions"][version]["requests"] for version in weights)
    assert counted >= 40 * 5 + 100 + 1
    assert read["versions"][retrained]["errors"] == 0
    assert read["versions"][retrained]["p99_ms"] >= read["versions"][retrained]["p50_ms"] > 0
    metrics = (await http.get("/metrics")).text
    series = f'model="digits",status="200",version="{retrained}"'
    assert f"batchserve_model_requests_total{{{series}}}" in metrics

    # {v: 100} serves one version again and unloads the other.
    alone_again = {"weights": {original: 100}}
    back = await http.put("/admin/models/digits/traffic", json=alone_again, headers=AUTH)
    assert back.status_code == 200, back.text
    assert back.json()["weights"] == {original: 100}
    for key in keys[:10]:
        answer = await http.post("/predict", json=ONE_DIGIT, headers={"x-routing-key": key})
        assert answer.json()["version"] == original
    gone = await http.post(f"/models/digits/versions/{retrained}/predict", json=ONE_DIGIT)
    assert gone.status_code == 404


async def test_refused_splits_say_why(served: Served) -> None:
    http, original, retrained, frontend = served
    tampered = add_digits_version(frontend.repository.root, 1.0)
    artifact = frontend.repository.root / "digits" / tampered / "model.safetensors"
    artifact.write_bytes(artifact.read_bytes()[:-4] + b"\0\0\0\0")
    url = "/admin/models/digits/traffic"

    async def put(body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
        return await http.put(url, json=body, headers=headers)

    no_token = await put({"weights": {original: 100}}, {})
    assert no_token.status_code == 401
    unknown = await put({"weights": {original: 90, "abcdefabcdef": 10}})
    assert unknown.status_code == 404
    assert "abcdefabcdef" in unknown.json()["error"]["message"]
    not_100 = await put({"weights": {original: 90, retrained: 20}})
    assert not_100.status_code == 422
    assert "got 110" in not_100.json()["error"]["message"]
    over = await put({"weights": {original: 101}})
    assert over.status_code == 422
    not_int = await put({"weights": {original: "100"}})
    assert not_int.status_code == 422
    assert "is a number, got '100'" in not_int.json()["error"]["message"]
    latest = await put({"weights": {"latest": 100}})
    assert latest.status_code == 404
    assert "by id" in latest.json()["error"]["message"]
    empty = await put({"weights": {}})
    assert empty.status_code == 422
    not_served = await http.put(
        "/admin/models/nothere/traffic", json={"weights": {original: 100}}, headers=AUTH
    )
    assert not_served.status_code == 404
    # All or none: the retrained version loaded for this split is discarded with it.
    refused = await put({"weights": {original: 50, retrained: 25, tampered: 25}})
    assert refused.status_code == 422, refused.text
    assert "still serving digits" in refused.json()["error"]["message"]
    named = await http.post(f"/models/digits/versions/{retrained}/predict", json=ONE_DIGIT)
    assert named.status_code == 404
    # A route per method at one path: a 405 names them all.
    options = await http.request("OPTIONS", url, headers=AUTH)
    assert options.status_code == 405
    assert set(options.headers["allow"].split(", ")) == {"GET", "PUT"}
    # Nothing refused changed what is served.
    read = (await http.get(url, headers=AUTH)).json()
    assert read["weights"] == {original: 100}
    assert (await http.get(url)).status_code == 401
