"""The response cache in a serving app (the bundled digits model, in process): identical
requests cost one forward whatever their encoding or protocol, and no answer is ever that of a
version other than the one it names while versions switch every 0.3 s."""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from service.bridge.interface import InferenceResult
from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.frontend.requests import Deadline, HeldRequest
from service.frontend.response_cache import ResponseCache
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of, frontend_of, registry_of
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan, sample_total

IDENTICAL = 64
#: Distinct inputs of the switching test, and how many answers its cache holds: fewer, so
#: answers are evicted and computed again while versions switch.
DISTINCT_INPUTS = 48
KEPT_ANSWERS = 32
SWITCH_EVERY_S = 0.3
REQUESTS = 10_000
CLIENTS = 16
#: The switching test stops here if its requests are not all answered by then.
TIME_CAP_S = 15.0


@pytest.fixture
def repository(tmp_path: Path) -> tuple[Path, str]:
    """The bundled digits, and a version of it that differs in one weight file."""
    root = tmp_path / "models"
    copy_bundled_digits(root)
    return root, add_digits_version(root, 0.5)


ADMIN_TOKEN = "response-cache-token-0123456789"


@contextlib.asynccontextmanager
async def served(root: Path) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    settings = Settings(
        model_repository=root,
        model_version=DIGITS.version,
        device="cpu",
        warmup_batch_sizes=(1, 4, 16),
        response_cache_mb=1,
        response_cache_models=("digits",),
        admin_token=ADMIN_TOKEN,
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield app, client


def digit(seed: int) -> np.ndarray:
    """An 8x8 image of sixteenths (exact in JSON), one per seed."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 17, size=(8, 8)) / 16).astype(np.float32)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def forwards(app: FastAPI) -> float:
    return sample_total(registry_of(app), "batchserve_batch_size_rows_count")


async def test_identical_requests_cost_one_forward_in_every_encoding_and_protocol(
    repository: tuple[Path, str],
) -> None:
    root, _ = repository
    image = digit(7)
    async with served(root) as (app, client):
        before = forwards(app)
        answers = await asyncio.gather(
            *(
                client.post("/predict", json={"instances": [image.tolist()]})
                for _ in range(IDENTICAL)
            )
        )
        assert [answer.status_code for answer in answers] == [200] * IDENTICAL
        predictions = {str(answer.json()["predictions"]) for answer in answers}
        assert len(predictions) == 1
        assert forwards(app) - before == 1
        registry = registry_of(app)
        hits = sample_total(registry, "batchserve_response_cache_hits_total", {"model": "digits"})
        assert hits == IDENTICAL - 1

        as_npy = await client.post(
            "/predict",
            content=npy(image[None]),
            headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
        )
        assert as_npy.status_code == 200, as_npy.text
        v2 = await client.post(
            "/v2/models/digits/infer",
            json={
                "inputs": [
                    {
                        "name": "image",
                        "shape": [1, 8, 8],
                        "datatype": "FP32",
                        "data": image.ravel().tolist(),
                    }
                ]
            },
        )
        assert v2.status_code == 200, v2.text
        assert forwards(app) - before == 1
        logits = np.asarray(answers[0].json()["predictions"], dtype=np.float32)
        np.testing.assert_array_equal(np.load(io.BytesIO(as_npy.content)), logits)
        np.testing.assert_array_equal(
            np.asarray(v2.json()["outputs"][0]["data"], dtype=np.float32), logits.ravel()
        )


async def test_each_version_of_a_traffic_split_is_answered_from_the_cache_with_its_own_answer(
    repository: tuple[Path, str],
) -> None:
    root, retrained = repository
    weights = {DIGITS.version: 50, retrained: 50}
    body = {"instances": [digit(3).tolist()]}
    async with served(root) as (app, client):
        split = await client.put(
            "/admin/models/digits/traffic",
            json={"weights": weights},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert split.status_code == 200, split.text
        alone = {}
        for version in weights:
            named = await client.post(f"/models/digits/versions/{version}/predict", json=body)
            alone[version] = named.json()["predictions"]
        assert alone[DIGITS.version] != alone[retrained]
        before = forwards(app)
        met: Counter[str] = Counter()
        for index in range(40):
            keyed = await client.post("/predict", json=body, headers={"x-routing-key": f"u{index}"})
            version = keyed.json()["version"]
            met[version] += 1
            assert keyed.json()["predictions"] == alone[version]
        assert set(met) == set(weights), met
        # Both versions' answers were kept when each was named: the primary's and the one
        # loaded beside it are answered without a forward.
        assert forwards(app) == before


async def test_no_answer_is_another_versions_while_versions_switch_every_300_ms(
    repository: tuple[Path, str],
) -> None:
    """Requests take the one request path every entry point takes (``HeldRequest.infer``,
    after their parse): HTTP would allow a tenth of the requests in the time. Each answer is
    compared with what the version it names gives for that input alone, and each request
    validated against a version is never answered by one served before it."""
    root, retrained = repository
    images = [NamedArrays.of(image=digit(seed)[None]) for seed in range(DISTINCT_INPUTS)]
    async with served(root) as (app, _):
        engine = engine_of(app)
        frontend = frontend_of(app)

        async def infer(index: int) -> tuple[str, InferenceResult]:
            """The version ``images[index]`` was validated against, and its answer."""
            model = frontend.serving_model("digits")
            deadline = Deadline.start(frontend.settings)
            with HeldRequest(frontend, deadline, f"r{index}") as held:
                return model.manifest.version, await held.infer(model, images[index], "normal")

        # Alone, one request at a time, nothing cached: what each version gives.
        frontend.response_cache = None
        expected: dict[str, list[np.ndarray]] = {}
        for version in (retrained, DIGITS.version):
            await engine.switch("digits", version)
            answered = [(await infer(index))[1] for index in range(DISTINCT_INPUTS)]
            assert {result.version for result in answered} == {version}
            expected[version] = [np.array(result.outputs["logits"]) for result in answered]
        # Fewer answers kept than inputs: answers are evicted and computed again meanwhile.
        entry_bytes = 512 + 8 * 8 * 4 + len("image") + 10 * 4
        frontend.response_cache = ResponseCache(
            KEPT_ANSWERS * entry_bytes, frozenset({"digits"}), frontend.metrics
        )
        order = [retrained, DIGITS.version]

        stop = asyncio.Event()
        switch_times_s: list[float] = []
        # Counts each switch's start and end: odd while one is under way.
        switch_epoch = 0
        answered = 0
        stale: list[tuple[str, str, int]] = []
        versions_seen: set[str] = set()

        async def switching() -> None:
            nonlocal switch_epoch
            while not stop.is_set():
                started_s = time.monotonic()
                switch_epoch += 1
                await engine.switch("digits", order[len(switch_times_s) % 2])
                switch_epoch += 1
                switch_times_s.append(time.monotonic() - started_s)
                left_s = SWITCH_EVERY_S - (time.monotonic() - started_s)
                with contextlib.suppress(TimeoutError):  # the workload's rhythm
                    await asyncio.wait_for(stop.wait(), max(0.0, left_s))

        async def asking(seed: int) -> None:
            nonlocal answered
            rng = random.Random(seed)
            while answered < REQUESTS and not stop.is_set():
                index = rng.randrange(DISTINCT_INPUTS)
                epoch = switch_epoch
                validated, result = await infer(index)
                answered += 1
                named = result.version
                versions_seen.add(named)
                wrong = not np.allclose(result.outputs["logits"], expected[named][index], atol=1e-4)
                # With no switch under way from its validation to its answer, only the version
                # it was validated against may answer it.
                other = named != validated and epoch == switch_epoch and epoch % 2 == 0
                if wrong or other:
                    stale.append((validated, named, index))

        started_s = time.monotonic()
        switcher = asyncio.create_task(switching())
        clients = [asyncio.create_task(asking(seed)) for seed in range(CLIENTS)]
        _, pending = await asyncio.wait(clients, timeout=TIME_CAP_S)
        stop.set()
        await asyncio.gather(*pending, switcher)
        elapsed_s = time.monotonic() - started_s

        registry = registry_of(app)
        hits = sample_total(registry, "batchserve_response_cache_hits_total")
        evictions = sample_total(registry, "batchserve_response_cache_evictions_total")
        print(  # the figures, with -s
            f"{answered} answers in {elapsed_s:.1f} s, {len(switch_times_s)} switches "
            f"(each {min(switch_times_s):.2f} to {max(switch_times_s):.2f} s), {hits:.0f} hits, "
            f"{evictions:.0f} evictions"
        )
    assert stale == []
    assert versions_seen == {retrained, DIGITS.version}
    assert answered >= 500
    assert len(switch_times_s) >= 3
    assert hits > 0
    assert evictions > 0


async def test_a_handlers_text_is_keyed_as_tokenized_and_answered_with_each_requests_top_k() -> (
    None
):
    """The bundled sentiment model: its handler tokenizes the text; the key is the token ids,
    and each request's ``top_k`` shapes its own answer from the one forward."""
    review = "great acting and a moving story"
    settings = Settings(
        model_repository=BUNDLED_MODEL_REPOSITORY,
        model_name="sentiment",
        device="cpu",
        warmup_batch_sizes=(1,),
        response_cache_mb=1,
        response_cache_models=("sentiment",),
    )
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            before = forwards(app)
            two = await client.post("/predict?top_k=2", json={"instances": [review]})
            one = await client.post(
                "/predict", content=review.encode(), headers={"Content-Type": "text/plain"}
            )
            other = await client.post("/predict", json={"instances": ["terrible"]})
            assert forwards(app) - before == 2
    assert [answer.status_code for answer in (two, one, other)] == [200] * 3
    (top_two,) = two.json()["predictions"]
    (top_one,) = one.json()["predictions"]
    assert [entry["label"] for entry in top_two] == ["positive", "negative"]
    assert top_one == top_two[:1]
    assert other.json()["predictions"][0][0]["label"] == "negative"
