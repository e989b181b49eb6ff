"""The demo handlers served end to end: raw text and uploaded images in, labels out.

Each answer is compared with what a client gets by preprocessing on its side and sending the
tensors to the same weights without a handler (``sentiment_tensors``, ``digits``).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw
from safetensors.torch import save_file
from tokenizers import Tokenizer

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.image import ImageHandler
from service.frontend.inputs import InputLayout
from service.manifest import Architecture, HandlerSpec, TensorSpec
from service.packaging.package import Packager
from service.server.single import create_app
from tests.apps import engine_of, registry_of
from tests.fixtures import lifespan, sample_total
from tests.processes import serve_with_engines, wait_until_serving
from tests.torch_models import CharSum

STORE = ModelStore(BUNDLED_MODEL_REPOSITORY)
SENTIMENT = STORE.resolve("sentiment")
DIGITS_PNG = STORE.resolve("digits_png")
REVIEWS = [
    "I loved this film, it was wonderful",
    "a dull and boring waste of time",
    "great acting and a moving story",
    "terrible",
]


@asynccontextmanager
async def serving(
    name: str, repository: Path = BUNDLED_MODEL_REPOSITORY
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        Settings(model_repository=repository, model_name=name, device="cpu", max_wait_ms=50.0)
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def softmax(logits: list[float]) -> np.ndarray:
    values = np.exp(np.asarray(logits) - max(logits))
    return values / values.sum()


async def test_raw_text_is_answered_as_the_client_tokenizing_itself_would_be() -> None:
    tokenizer = Tokenizer.from_file(
        str(STORE.version_folder("sentiment", SENTIMENT.version) / "tokenizer.json")
    )
    encodings = [tokenizer.encode(review) for review in REVIEWS]
    instances = [
        {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}
        for encoding in encodings
    ]
    async with serving("sentiment_tensors") as tensors:
        by_client = await tensors.post("/predict", json={"instances": instances})
    assert by_client.status_code == 200, by_client.text
    expected = by_client.json()["predictions"]
    assert {"logits", "embedding"} == set(expected[0])

    async with serving("sentiment") as text:
        # Concurrent requests of one review each share batches, and each gets its own answer.
        answers = await asyncio.gather(
            *(text.post("/predict?top_k=2", json={"instances": [review]}) for review in REVIEWS)
        )
        batches = sample_total(
            registry_of(text.app),  # type: ignore[attr-defined]
            "batchserve_batch_size_rows_count",
        )
        plain = await text.post(
            "/predict", content=REVIEWS[0].encode(), headers={"Content-Type": "text/plain"}
        )
    assert batches < len(REVIEWS)  # the handlers' tensors were batched together
    for answer, prediction in zip(answers, expected, strict=True):
        assert answer.status_code == 200, answer.text
        (top,) = answer.json()["predictions"]
        probabilities = softmax(prediction["logits"])
        order = np.argsort(-probabilities)
        assert [entry["label"] for entry in top] == [["negative", "positive"][i] for i in order]
        np.testing.assert_allclose(
            [entry["score"] for entry in top], probabilities[order], rtol=0, atol=1e-5
        )
    assert plain.status_code == 200
    assert plain.json()["predictions"][0][0]["label"] == "positive"
    assert answers[0].json()["predictions"][0][0]["label"] == "positive"
    assert answers[1].json()["predictions"][0][0]["label"] == "negative"


def drawn_digit(digit: str = "7", size: int = 64) -> Image.Image:
    image = Image.new("L", (size, size), 255)
    ImageDraw.Draw(image).text((size // 3, size // 5), digit, fill=0, font_size=size // 2)
    return image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def multipart(files: list[bytes], boundary: str = "batchserve-test") -> tuple[bytes, str]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="file{index}"; '
        f'filename="{index}.png"\r\nContent-Type: image/png\r\n\r\n'.encode()
        + data
        + b"\r\n"
        for index, data in enumerate(files)
    ]
    return b"".join(
        parts
    ) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def test_an_uploaded_png_is_answered_as_the_client_preprocessing_itself_would_be() -> None:
    images = [png(drawn_digit("7")), png(drawn_digit("3", size=100))]
    # Client side: the same preprocessing (the handler's own class, run by the client), then
    # the tensors to the digits model, whose weights digits_png shares.
    folder = STORE.version_folder("digits_png", DIGITS_PNG.version)
    assert DIGITS_PNG.handler is not None
    client_side = ImageHandler(
        HandlerContext(DIGITS_PNG, folder, InputLayout(DIGITS_PNG)), **DIGITS_PNG.handler.options
    )
    pixels = [
        client_side.preprocess(HandlerRequest(data, "image/png", "image/png"))["image"][0]
        for data in images
    ]
    async with serving("digits") as digits:
        by_client = await digits.post(
            "/predict", json={"instances": [array.tolist() for array in pixels]}
        )
    assert by_client.status_code == 200, by_client.text
    expected = [softmax(logits) for logits in by_client.json()["predictions"]]

    body, content_type = multipart(images)
    async with serving("digits_png") as server:
        as_bytes = await asyncio.gather(
            *(
                server.post("/predict?top_k=3", content=data, headers={"Content-Type": "image/png"})
                for data in images
            )
        )
        as_base64 = await server.post(
            "/predict?top_k=3",
            json={"instances": [{"b64": base64.b64encode(data).decode()} for data in images]},
        )
        as_upload = await server.post(
            "/predict?top_k=3", content=body, headers={"Content-Type": content_type}
        )
    answers = [response.json()["predictions"][0] for response in as_bytes]
    for response in (*as_bytes, as_base64, as_upload):
        assert response.status_code == 200, response.text
    for response in (as_base64, as_upload):  # the same images, batched otherwise
        for got, answer in zip(response.json()["predictions"], answers, strict=True):
            assert [entry["label"] for entry in got] == [entry["label"] for entry in answer]
            np.testing.assert_allclose(
                [entry["score"] for entry in got], [e["score"] for e in answer], atol=1e-6
            )
    for answer, probabilities in zip(answers, expected, strict=True):
        order = np.argsort(-probabilities)[:3]
        assert [entry["label"] for entry in answer] == [str(index) for index in order]
        np.testing.assert_allclose(
            [entry["score"] for entry in answer], probabilities[order], rtol=0, atol=1e-5
        )


async def test_bad_images_are_4xx_and_their_batch_mates_are_unaffected() -> None:
    good = png(drawn_digit("2"))
    huge = Image.new("L", (6000, 6000), 255)  # 36 Mpx, above the 16 Mpx limit
    async with serving("digits_png") as server:
        answers = await asyncio.gather(
            server.post("/predict", content=good, headers={"Content-Type": "image/png"}),
            server.post("/predict", content=png(huge), headers={"Content-Type": "image/png"}),
            server.post("/predict", content=good[:60], headers={"Content-Type": "image/png"}),
            server.post("/predict", content=b"GIF89a....", headers={"Content-Type": "image/png"}),
            server.post("/predict", content=good, headers={"Content-Type": "image/gif"}),
            server.post("/predict?top_k=11", content=good, headers={"Content-Type": "image/png"}),
            server.post("/predict?topk=1", content=good, headers={"Content-Type": "image/png"}),
            server.post("/predict", content=good, headers={"Content-Type": "image/png"}),
        )
    statuses = [answer.status_code for answer in answers]
    assert statuses == [200, 413, 422, 422, 415, 422, 422, 200], [a.text for a in answers]
    assert answers[0].json() == answers[-1].json()
    assert "pixels" in answers[1].json()["error"]["message"]
    assert "unknown query parameter(s) ['topk']" in answers[6].json()["error"]["message"]


FAILING_HANDLER = '''
from service.frontend.handlers.text import TextHandler


class FailsOnBoom(TextHandler):
    """The text handler, except that it breaks on the word "boom" (an operator's bug)."""

    def preprocess(self, request):
        if b"boom" in request.body:
            raise RuntimeError("the operator's code has a bug")
        return super().preprocess(request)
'''


async def test_a_bundled_handler_that_fails_answers_500_for_that_request_alone(
    tmp_path: Path,
) -> None:
    module = tmp_path / "failing.py"
    module.write_text(FAILING_HANDLER)
    folder = STORE.version_folder("sentiment", SENTIMENT.version)
    manifest = Packager(tmp_path / "repository").package(
        name="fragile",
        artifact=folder / SENTIMENT.artifact,
        format=SENTIMENT.format,
        architecture=SENTIMENT.architecture,
        inputs=SENTIMENT.inputs,
        outputs=SENTIMENT.outputs,
        handler=HandlerSpec(import_path="failing:FailsOnBoom"),
        files=[folder / "tokenizer.json", module],
    )
    assert "failing.py" in manifest.files
    async with serving("fragile", tmp_path / "repository") as server:
        answers = await asyncio.gather(
            server.post("/predict", json={"instances": ["a lovely film"]}),
            server.post("/predict", json={"instances": ["boom"]}),
            server.post("/predict", json={"instances": [7]}),
            server.post("/predict", json={"instances": ["a lovely film"]}),
        )
    assert [answer.status_code for answer in answers] == [200, 500, 422, 200]
    error = answers[1].json()["error"]
    assert error["code"] == "handler_failed"
    assert "RuntimeError: the operator's code has a bug" in error["message"]
    assert answers[0].json() == answers[3].json()


async def test_a_handler_file_changed_on_disk_is_refused(tmp_path: Path) -> None:
    folder = STORE.version_folder("sentiment", SENTIMENT.version)
    repository = tmp_path / "repository"
    version = (
        Packager(repository)
        .package(
            name="sentiment",
            artifact=folder / SENTIMENT.artifact,
            format=SENTIMENT.format,
            architecture=SENTIMENT.architecture,
            inputs=SENTIMENT.inputs,
            outputs=SENTIMENT.outputs,
            handler=SENTIMENT.handler,
            files=[folder / "tokenizer.json"],
        )
        .version
    )
    tokenizer = repository / "sentiment" / version / "tokenizer.json"
    async with serving("sentiment", repository) as server:
        tokenizer.write_text(tokenizer.read_text().replace('"[UNK]"', '"[UNKNOWN]"'))
        answer = await server.post("/predict", json={"instances": ["fine"]})
    assert answer.status_code == 500
    assert "'tokenizer.json' has sha256" in answer.json()["error"]["message"]


@pytest.mark.parametrize("name", ["sentiment", "sentiment_tensors", "digits_png"])
def test_the_demo_versions_verify(name: str) -> None:
    manifest = STORE.resolve(name)
    STORE.verify(manifest)
    assert manifest.version == manifest.content_digest()[:12]


async def test_the_openapi_schema_describes_the_handlers_contract() -> None:
    async with serving("sentiment") as server:
        schema = (await server.get("/openapi.json")).json()
    predict = schema["paths"]["/predict"]["post"]
    content = predict["requestBody"]["content"]
    assert content["application/json"]["schema"]["properties"]["instances"]["items"] == {
        "type": "string",
        "description": "A text to classify.",
    }
    assert "text/plain" in content
    row = predict["responses"]["200"]["content"]["application/json"]["schema"]
    labels = row["properties"]["predictions"]["items"]["items"]["properties"]["label"]
    assert labels["enum"] == ["negative", "positive"]


async def test_two_front_ends_run_the_text_handler_for_one_engine(tmp_path: Path) -> None:
    """Handlers run in the forked gunicorn front ends (tokenizers after the fork), the engine
    batches the tensors of both; every caller gets its own review's answer."""
    reviews = [REVIEWS[index % len(REVIEWS)] + f" {'!' * (index % 3)}" for index in range(24)]
    with serve_with_engines(tmp_path, 2, BATCHSERVE_MODEL_NAME="sentiment") as server:
        wait_until_serving(server, 2)
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0, limits=limits) as http:
            answers = await asyncio.gather(
                *(http.post("/predict", json={"instances": [review]}) for review in reviews)
            )
            together = await http.post("/predict", json={"instances": reviews})
    assert [answer.status_code for answer in answers] == [200] * len(reviews)
    alone = [answer.json()["predictions"][0][0] for answer in answers]
    for own, batched in zip(alone, together.json()["predictions"], strict=True):
        assert own["label"] == batched[0]["label"]
        assert abs(own["score"] - batched[0]["score"]) < 1e-5


async def test_the_handler_of_your_own_in_the_docs_works_as_written(tmp_path: Path) -> None:
    """The example of docs/models.md, packaged as a bundled module in front of a model that
    sums character codes."""
    docs = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    code = docs.split("```python\n", 1)[1].split("```", 1)[0]
    module = tmp_path / "myhandler.py"
    module.write_text(code)
    weights = tmp_path / "weights.safetensors"
    save_file(dict(CharSum().state_dict()), str(weights))
    Packager(tmp_path / "repository").package(
        name="chars",
        artifact=weights,
        format="safetensors",
        architecture=Architecture(import_path="tests.torch_models:CharSum"),
        inputs=(
            TensorSpec(name="chars", dtype="int64", shape=(-1, -1), max_length=64, max_value=255),
        ),
        outputs=(TensorSpec(name="total", dtype="float32", shape=(-1,)),),
        handler=HandlerSpec(import_path="myhandler:Uppercase"),
        files=[module],
    )
    async with serving("chars", tmp_path / "repository") as server:
        answer = await server.post(
            "/predict", content=b"AB", headers={"Content-Type": "text/plain"}
        )
        empty = await server.post("/predict", content=b"", headers={"Content-Type": "text/plain"})
        json_body = await server.post("/predict", json={"instances": ["AB"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["predictions"] == [65.0 + 66.0]
    assert empty.status_code == 422
    assert empty.json()["error"]["message"] == "send some text"
    assert json_body.status_code == 415
