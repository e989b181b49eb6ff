"""Several models in one engine: each answers only its own requests, none starves another,
and the device memory budget refuses a model that does not fit without disturbing the others.

Real models through the real app (in-process), and through a real server with front-end and
engine processes.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import save_file

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.memory import MIB
from service.engine.model_store import ModelStore
from service.manifest import Architecture, TensorSpec
from service.metrics import resident_memory_bytes
from service.packaging.package import Packager
from service.server.single import create_app
from tests.apps import engine_of, registry_of
from tests.fixtures import lifespan, sample_total, wait_until
from tests.processes import serve_with_engines, wait_until_serving
from tests.torch_models import (
    FEATURES,
    FORWARD_ORDER,
    HANG_ENTERED,
    HANG_RELEASE,
    HANG_VALUE,
)

TOKEN = "multi-model-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Features of the wide models: a 4096 x 4096 float32 weight is 64 MiB.
WIDE_FEATURES = 4096
WIDE_BYTES = WIDE_FEATURES * WIDE_FEATURES * 4


def package_affine(repository: Path, name: str, features: int, architecture: str) -> str:
    """``name``: ``architecture`` (an ``AffineModel``-like module) over ``features`` values,
    with its weights in the artifact."""
    module_path, class_name = architecture.split(":")
    module = getattr(__import__(module_path, fromlist=[class_name]), class_name)
    kwargs = {"features": features} if features != FEATURES else {}
    model = module(**kwargs)
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "model.safetensors"
        save_file(model.state_dict(), str(weights))
        return (
            Packager(repository)
            .package(
                name=name,
                artifact=weights,
                format="safetensors",
                architecture=Architecture(import_path=architecture, kwargs=kwargs),
                inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, features)),),
                outputs=(TensorSpec(name="y", dtype="float32", shape=(-1, features)),),
            )
            .version
        )


async def serving(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            http.app = app  # type: ignore[attr-defined]
            yield http


def references() -> dict[str, torch.nn.Module]:
    """Each bundled model loaded alone, to compute what every request must be answered."""
    store = ModelStore(BUNDLED_MODEL_REPOSITORY)
    return {name: store.load(name).module.eval() for name in ("digits", "textenc")}


def expected(models: dict[str, torch.nn.Module], name: str, instances: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        output: torch.Tensor = models[name](torch.from_numpy(instances))
    return output.numpy()


def mixed_requests(count: int) -> list[tuple[str, str, np.ndarray]]:
    """(model, path, instances): digits on /predict and on its own route, textenc token ids
    of varied lengths on its route, interleaved."""
    rng = np.random.default_rng(7)
    requests = []
    for index in range(count):
        if index % 3 == 0:
            path = "/predict" if index % 2 else "/models/digits/predict"
            digits = rng.uniform(0, 1, size=(int(rng.integers(1, 4)), 8, 8)).astype(np.float32)
            requests.append(("digits", path, digits))
        else:
            length = int(rng.integers(1, 40))
            tokens = rng.integers(1, 1000, size=(int(rng.integers(1, 3)), length))
            requests.append(("textenc", "/models/textenc/predict", tokens.astype(np.int64)))
    return requests


async def check_mixed_load(http: httpx.AsyncClient, count: int) -> dict[str, int]:
    """Send ``count`` interleaved requests at once; every answer is its own model's, for its
    own rows. Returns the rows sent to each model."""
    models = references()
    requests = mixed_requests(count)
    answers = await asyncio.gather(
        *(http.post(path, json={"instances": rows.tolist()}) for _, path, rows in requests)
    )
    rows_sent = {"digits": 0, "textenc": 0}
    for (name, _, rows), answer in zip(requests, answers, strict=True):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == name
        assert answer.headers["x-model-version"] == f"{name}@{body['version']}"
        got = np.asarray(body["predictions"], dtype=np.float32)
        want = np.concatenate([expected(models, name, row[None]) for row in rows])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        rows_sent[name] += len(rows)
    return rows_sent


async def test_two_models_under_interleaved_concurrent_load_answer_only_their_own_rows() -> None:
    settings = Settings(models=("digits", "textenc"), device="cpu", max_wait_ms=20)
    async for http in serving(settings):
        rows_sent = await check_mixed_load(http, 48)
        registry = registry_of(http.app)  # type: ignore[attr-defined]
        for name, rows in rows_sent.items():
            # Every row ran in a batch of its own model; and the batches were shared.
            batched = {"model": name}
            assert sample_total(registry, "batchserve_batch_size_rows_sum", batched) == rows
            assert sample_total(registry, "batchserve_batch_size_rows_count", batched) < rows
        listed = (await http.get("/models")).json()
        assert [model["name"] for model in listed["models"]] == ["digits", "textenc"]
        assert listed["loaded"]["name"] == "digits"  # the first answers /predict
        assert all(model["memory_bytes"] > 0 for model in listed["models"])
        ready = (await http.get("/readyz")).json()
        assert [label.split("@")[0] for label in ready["models"]] == ["digits", "textenc"]


async def test_the_openapi_document_has_a_predict_route_per_model_with_its_bodies() -> None:
    async for http in serving(Settings(models=("digits", "textenc"), device="cpu")):
        document = (await http.get("/openapi.json")).json()
        paths = document["paths"]
        assert "/models/{name}/predict" not in paths
        versions = {
            model["name"]: model["version"]
            for model in (await http.get("/models")).json()["models"]
        }
        for name, version in versions.items():
            assert f"/models/{name}/predict" in paths
            assert f"/models/{name}/versions/{version}/predict" in paths

        # digits: 8 rows of 8 numbers, as /predict; textenc: token ids, 1 to 512 of them.
        digits = instance_schema(paths, "/models/digits/predict")
        assert digits == instance_schema(paths, "/predict")
        tokens = instance_schema(paths, "/models/textenc/predict")
        assert tokens["x-batchserve-tensor"]["name"] == "token_ids"
        assert tokens["maxItems"] == 512


def instance_schema(paths: dict[str, Any], path: str) -> dict[str, Any]:
    """The JSON schema of one instance of ``POST path``."""
    body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema: dict[str, Any] = body["properties"]["instances"]["items"]
    return schema


async def test_the_open_inference_protocol_reaches_each_model_by_its_name() -> None:
    settings = Settings(models=("digits", "textenc"), device="cpu", admin_token=TOKEN)
    async for http in serving(settings):
        tokens = np.array([[5, 17, 99]], dtype=np.int64)
        document = {
            "inputs": [
                {"name": "token_ids", "datatype": "INT64", "shape": [1, 3], "data": [5, 17, 99]}
            ]
        }
        answer = await http.post("/v2/models/textenc/infer", json=document)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_name"] == "textenc"
        (output,) = answer.json()["outputs"]
        want = expected(references(), "textenc", tokens)
        np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), want, atol=1e-4)
        for name in ("digits", "textenc"):
            assert (await http.get(f"/v2/models/{name}/ready")).status_code == 200
        index = (await http.post("/v2/repository/index", headers=AUTH)).json()
        ready = sorted(entry["name"] for entry in index if entry["state"] == "READY")
        assert ready == ["digits", "textenc"]


async def test_a_model_that_is_not_served_or_a_version_that_is_not_is_404() -> None:
    async for http in serving(Settings(models=("digits",), device="cpu")):
        one = {"instances": np.zeros((1, 8, 8)).tolist()}
        unknown = await http.post("/models/textenc/predict", json=one)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == (
            "unknown model 'textenc': this server serves 'digits'"
        )
        other_version = await http.post("/models/digits/versions/abcdefabcdef/predict", json=one)
        assert other_version.status_code == 404
        assert "version 'abcdefabcdef' is not served" in other_version.json()["error"]["message"]
        version = (await http.post("/predict", json=one)).json()["version"]
        pinned = await http.post(f"/models/digits/versions/{version}/predict", json=one)
        assert pinned.status_code == 200


async def test_a_flooded_model_does_not_starve_another(tmp_path: Path) -> None:
    """``slow`` holds the device thread (a batch that blocks until released) with ten more
    single-row batches queued behind it; ``quick``'s request, sent after all of them, is
    answered after one more batch of ``slow``'s at most: the device goes to the waiting model
    with the least device time, so a model waits behind at most the batch that is running."""
    repository = tmp_path / "repository"
    package_affine(repository, "slow", FEATURES, "tests.torch_models:RecordedHangsOnValue")
    package_affine(repository, "quick", FEATURES, "tests.torch_models:RecordedAffine")
    settings = Settings(
        model_repository=repository,
        models=("slow", "quick"),
        device="cpu",
        max_batch_size=1,
        warmup_batch_sizes=(1,),
    )
    HANG_RELEASE.clear()
    HANG_ENTERED.clear()
    try:
        async for http in serving(settings):
            answered: list[str] = []

            send = functools.partial(start_answering, http, answered)
            FORWARD_ORDER.clear()  # the warm-up's forwards
            hanging = send("/models/slow/predict", HANG_VALUE, "hang")
            await wait_until(HANG_ENTERED.is_set)  # its batch is on the device thread, blocked
            flood = [send("/models/slow/predict", 1.0, f"slow-{index}") for index in range(10)]
            quick = send("/models/quick/predict", 1.0, "quick")
            all_queued = {"slow": 10, "quick": 1}
            await wait_until(functools.partial(queued, http.app, all_queued))  # type: ignore[attr-defined]
            assert answered == []
            HANG_RELEASE.set()
            await asyncio.gather(hanging, quick, *flood)
            assert answered[0] == "hang"
            # The device's order (the clients may resume in another under load): the hung
            # batch, at most one more of slow's, then quick's.
            assert FORWARD_ORDER.index("quick") <= 2, FORWARD_ORDER
    finally:
        HANG_RELEASE.set()


def queued(app: FastAPI, depths: dict[str, int]) -> bool:
    """Whether each model's batcher queue holds its number of requests in ``depths``."""
    models = engine_of(app).state.models
    return all(models[name].batcher.queue_depth == depth for name, depth in depths.items())


def start_answering(
    http: httpx.AsyncClient, answered: list[str], path: str, value: float, label: str
) -> asyncio.Task[None]:
    """Post one row of ``value`` to ``path``; ``label`` joins ``answered`` once answered."""

    async def answer() -> None:
        response = await http.post(path, json={"instances": [[value] * FEATURES]})
        assert response.status_code == 200, response.text
        answered.append(label)

    return asyncio.create_task(answer())


@pytest.fixture
def wide_repository(tmp_path: Path) -> Path:
    """digits, and two models of 64 MiB of weights each."""
    repository = tmp_path / "repository"
    shutil.copytree(BUNDLED_MODEL_REPOSITORY / "digits", repository / "digits")
    for name in ("wide_a", "wide_b"):
        package_affine(repository, name, WIDE_FEATURES, "tests.torch_models:AffineModel")
    return repository


async def test_a_load_over_the_memory_budget_is_refused_and_the_others_serve_on(
    wide_repository: Path,
) -> None:
    """digits and wide_a fit in 110 MiB; wide_b (64 MiB more) does not: 409 naming what is
    loaded and how much each takes, and requests to both served models go on meanwhile."""
    settings = Settings(
        model_repository=wide_repository,
        models=("digits", "wide_a"),
        device="cpu",
        admin_token=TOKEN,
        device_memory_budget_mb=110,
    )
    async for http in serving(settings):
        listed = {model["name"]: model for model in (await http.get("/models")).json()["models"]}
        assert 0.9 * WIDE_BYTES < listed["wide_a"]["memory_bytes"] < 1.5 * WIDE_BYTES
        digit = {"instances": np.zeros((1, 8, 8)).tolist()}
        wide = {"instances": np.ones((1, WIDE_FEATURES)).tolist()}
        answers = await asyncio.gather(
            http.post("/admin/models/wide_b/versions/latest/load", headers=AUTH),
            *(http.post("/predict", json=digit) for _ in range(8)),
            *(http.post("/models/wide_a/predict", json=wide) for _ in range(8)),
        )
        refused, served = answers[0], answers[1:]
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]["message"]
        assert message.startswith("wide_b@")
        assert "digits@" in message
        assert "wide_a@" in message
        assert "MiB" in message
        assert "BATCHSERVE_DEVICE_MEMORY_BUDGET_MB" in message
        assert [answer.status_code for answer in served] == [200] * 16
        assert np.allclose(served[-1].json()["predictions"], 3.0)  # 2x + 1
        listed_after = (await http.get("/models")).json()["models"]
        assert [model["name"] for model in listed_after] == ["digits", "wide_a"]


async def test_unloading_a_model_gives_its_memory_back(wide_repository: Path) -> None:
    """Resident memory after loading and unloading 64 MiB of weights is back within 16 MiB
    (a quarter of the model) of what it was before the load."""
    settings = Settings(
        model_repository=wide_repository, models=("digits",), device="cpu", admin_token=TOKEN
    )
    async for http in serving(settings):
        before = resident_memory_bytes()
        loaded = await http.post("/admin/models/wide_a/versions/latest/load", headers=AUTH)
        assert loaded.status_code == 200, loaded.text
        assert resident_memory_bytes() - before > 0.9 * WIDE_BYTES
        registry = registry_of(http.app)  # type: ignore[attr-defined]
        memory = sample_total(registry, "batchserve_model_memory_bytes", {"model": "wide_a"})
        assert memory > 0.9 * WIDE_BYTES
        unloaded = await http.post("/admin/models/wide_a/unload", headers=AUTH)
        assert unloaded.status_code == 200, unloaded.text
        assert resident_memory_bytes() - before < 16 * MIB
        assert sample_total(registry, "batchserve_model_memory_bytes", {"model": "wide_a"}) == 0


async def test_a_model_rolls_back_on_its_own(tmp_path: Path) -> None:
    """Switching and rolling back one model leaves the other served as it was."""
    repository = tmp_path / "repository"
    first = package_affine(repository, "affine", FEATURES, "tests.torch_models:AffineModel")
    shutil.copytree(BUNDLED_MODEL_REPOSITORY / "digits", repository / "digits")
    second = package_affine(repository, "affine", FEATURES, "tests.torch_models:RaisesOnNegative")
    settings = Settings(
        model_repository=repository,
        models=("digits", f"affine@{first}"),
        device="cpu",
        admin_token=TOKEN,
    )
    async for http in serving(settings):
        switched = await http.post(f"/admin/models/affine/versions/{second}/load", headers=AUTH)
        assert switched.status_code == 200, switched.text
        assert switched.json()["replaced"] == f"affine@{first}"
        nothing_before = await http.post("/admin/models/digits/rollback", headers=AUTH)
        assert nothing_before.status_code == 409
        rolled_back = await http.post("/admin/models/affine/rollback", headers=AUTH)
        assert rolled_back.status_code == 200, rolled_back.text
        assert rolled_back.json()["serving"]["version"] == first
        labels = (await http.get("/readyz")).json()["models"]
        assert labels[0].startswith("digits@")
        assert labels[1] == f"affine@{first}"


def test_front_ends_and_an_engine_process_serve_two_models(tmp_path: Path) -> None:
    """Two front ends, one engine process serving digits and textenc: interleaved load from
    both, the metrics by model, and an unload through the bridge."""
    with serve_with_engines(
        tmp_path, workers=2, BATCHSERVE_MODELS="digits,textenc", BATCHSERVE_ADMIN_TOKEN=TOKEN
    ) as server:
        wait_until_serving(server, workers=2)

        async def load_and_unload() -> None:
            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as http:
                await check_mixed_load(http, 60)
                metrics = (await http.get("/metrics")).text
                assert 'batchserve_batch_size_rows_count{model="textenc"}' in metrics
                unloaded = await http.post("/admin/models/textenc/unload", headers=AUTH)
                assert unloaded.status_code == 200, unloaded.text
                tokens = {"instances": [[1, 2, 3]]}
                for _ in range(4):  # whichever front end answers
                    gone = await http.post("/models/textenc/predict", json=tokens)
                    assert gone.status_code == 404, gone.text
                engines = (await http.get("/models")).json()["engines"]
                assert [label.split("@")[0] for label in engines[0]["models"]] == ["digits"]

        asyncio.run(load_and_unload())
