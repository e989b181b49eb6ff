"""The OpenAPI document states the served model's contract, and /docs works offline."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from jsonschema import Draft202012Validator
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

from service.bridge.interface import ModelInfo
from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.frontend.docs import ASSETS
from service.frontend.handlers.base import Handler
from service.frontend.openapi import model_openapi
from service.manifest import HandlerSpec, Manifest, TensorSpec
from service.packaging.package import Packager
from service.server.single import create_app
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan

TOKEN = "openapi-test-admin-token"


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {"device": "cpu", "max_wait_ms": 2.0}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    application = create_app(settings(max_instances_per_request=64))
    async with lifespan(application):
        await application.state.loading
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def request_schema(document: dict[str, Any], media_type: str = "application/json") -> Any:
    return document["paths"]["/predict"]["post"]["requestBody"]["content"][media_type]["schema"]


def answer_schema(document: dict[str, Any]) -> Any:
    answers = document["paths"]["/predict"]["post"]["responses"]["200"]["content"]
    return answers["application/json"]["schema"]


def is_valid(schema: Any, value: Any) -> bool:
    Draft202012Validator.check_schema(schema)
    return bool(Draft202012Validator(schema).is_valid(value))


async def test_the_predict_schema_states_the_digits_input_and_output(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    instances = request_schema(document)["properties"]["instances"]
    assert (instances["minItems"], instances["maxItems"]) == (1, 64)
    rows = instances["items"]
    assert (rows["type"], rows["minItems"], rows["maxItems"]) == ("array", 8, 8)
    pixels = rows["items"]
    assert (pixels["minItems"], pixels["maxItems"]) == (8, 8)
    assert pixels["items"] == {"type": "number", "minimum": 0.0, "maximum": 1.0}
    assert rows["x-batchserve-tensor"]["dtype"] == "float32"
    prediction = answer_schema(document)["properties"]["predictions"]["items"]
    assert (prediction["minItems"], prediction["maxItems"]) == (10, 10)
    assert prediction["items"]["type"] == "number"
    assert document["x-batchserve-model"] == {"name": "digits", "version": DIGITS.version}
    assert f"digits@{DIGITS.version}" in document["info"]["description"]


async def test_a_body_the_schema_accepts_is_answered_as_the_schema_says(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    instances = np.random.default_rng(0).random((3, 8, 8), dtype=np.float32).tolist()
    body = {"instances": instances}
    assert is_valid(request_schema(document), body)
    narrow = {"instances": [[[0.5] * 7] * 8]}
    assert not is_valid(request_schema(document), narrow)
    assert not is_valid(request_schema(document), {"instances": [[[1.5] * 8] * 8]})

    response = await client.post("/predict", content=orjson.dumps(body))
    assert response.status_code == 200
    assert is_valid(answer_schema(document), response.json())
    assert (await client.post("/predict", content=orjson.dumps(narrow))).status_code == 422


async def test_the_example_in_the_document_is_accepted(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    content = document["paths"]["/predict"]["post"]["requestBody"]["content"]["application/json"]
    assert is_valid(content["schema"], content["example"])
    response = await client.post("/predict", content=orjson.dumps(content["example"]))
    assert response.status_code == 200


async def test_the_document_is_fastapis_own_while_no_model_is_loaded() -> None:
    app = create_app(settings())  # not started: nothing is loading yet
    document = app.openapi()
    assert "x-batchserve-model" not in document
    assert request_schema(document)["title"] == "PredictRequest"


async def test_the_document_is_built_once_a_version_and_again_after_a_switch(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    retrained = add_digits_version(root, 0.5)
    app = create_app(
        settings(model_repository=root, model_version=DIGITS.version, admin_token=TOKEN)
    )
    async with lifespan(app):
        await app.state.loading
        first = app.openapi()
        assert app.openapi() is first
        assert first["x-batchserve-model"]["version"] == DIGITS.version
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            loaded = await http.post(
                f"/admin/models/digits/versions/{retrained}/load",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert loaded.status_code == 200, loaded.text
            document = (await http.get("/openapi.json")).json()
        assert document["x-batchserve-model"]["version"] == retrained
        assert app.openapi() is not first


async def test_a_version_with_a_handler_is_described_by_the_handler(tmp_path: Path) -> None:
    root = tmp_path / "models"
    handled = Packager(root).package(
        name="digits",
        artifact=BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact,
        format=DIGITS.format,
        architecture=DIGITS.architecture,
        inputs=DIGITS.inputs,
        outputs=DIGITS.outputs,
        handler=HandlerSpec(import_path="service.frontend.handlers.base:Handler"),
    )
    app = create_app(settings(model_repository=root))
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            document = (await http.get("/openapi.json")).json()
    operation = document["paths"]["/predict"]["post"]
    assert document["x-batchserve-model"]["version"] == handled.version
    assert operation["x-batchserve-handler"]["handler"] == "Handler"
    assert set(operation["requestBody"]["content"]) == set(Handler.media_types)
    assert operation["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"


async def test_docs_load_every_asset_from_the_app_itself(client: httpx.AsyncClient) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "cdn" not in page.text.lower()
    assert "http" not in page.text.lower(), "the page names another host"
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*["']([^"']+)["']""", page.text)
    assets = [url for url in urls if url != "/openapi.json"]
    assert sorted(url.rsplit("/", 1)[1] for url in assets) == sorted(ASSETS)
    for url in assets:
        response = await client.get(url)
        assert response.status_code == 200, url
        assert response.headers["content-type"].split(";")[0] == ASSETS[url.rsplit("/", 1)[1]]
        assert response.content


async def test_only_the_pages_assets_are_served_and_redoc_is_gone(
    client: httpx.AsyncClient,
) -> None:
    for path in ("/docs-assets/index.html", "/docs-assets/..%2Fpyproject.toml", "/redoc"):
        assert (await client.get(path)).status_code == 404, path
    document = (await client.get("/openapi.json")).json()
    assert not any(path.startswith(("/docs", "/redoc")) for path in document["paths"])


async def test_the_bundled_swagger_ui_reads_the_documents_openapi_version(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    swagger_ui = re.search(r"swagger-ui-(\d+)\.", Path(swagger_ui_path).name)
    assert swagger_ui is not None
    if document["openapi"].startswith("3.1"):
        assert int(swagger_ui[1]) >= 5


def tensor(name: str, dtype: str, shape: tuple[int, ...], **fields: Any) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=shape, **fields)


def manifest(
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    handler: HandlerSpec | None = None,
) -> Manifest:
    """A hand-built version: the document is built from its manifest alone."""
    return Manifest.create(
        name="sentiment",
        format="torchscript",
        artifact="model.torchscript.pt",
        files={"model.torchscript.pt": "0" * 64},
        inputs=inputs,
        outputs=outputs,
        handler=handler,
        created_at=datetime.now(UTC),
    )


def served(version: Manifest, length_edges: tuple[int, ...] = ()) -> ModelInfo:
    return ModelInfo(
        manifest=version, device="cpu", precision="float32", compiled=False,
        length_edges=length_edges,
    )  # fmt: skip


BASE = create_app(settings()).openapi()
SENTIMENT = manifest(
    inputs=(
        tensor("input_ids", "int64", (-1, -1), max_length=16, min_value=1, max_value=999),
        tensor("attention_mask", "int64", (-1, -1), max_length=16),
    ),
    outputs=(
        tensor("logits", "float32", (-1, 2), labels=("negative", "positive")),
        tensor("label", "int64", (-1,)),
    ),
)


def test_several_inputs_and_outputs_are_objects_keyed_by_name() -> None:
    document = model_openapi(BASE, served(SENTIMENT), max_instances=8)
    instance = request_schema(document)["properties"]["instances"]["items"]
    assert instance["type"] == "object"
    assert instance["required"] == ["input_ids", "attention_mask"]
    ids = instance["properties"]["input_ids"]
    assert (ids["type"], ids["minItems"], ids["maxItems"]) == ("array", 1, 16)
    assert ids["x-batchserve-tensor"]["shape"] == [-1, -1]
    assert "int64" in ids["description"]
    mask = instance["properties"]["attention_mask"]["items"]
    assert mask == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}

    row = answer_schema(document)["properties"]["predictions"]["items"]
    assert row["required"] == ["logits", "label"]
    logits = row["properties"]["logits"]
    assert logits["x-labels"] == ["negative", "positive"]
    assert "negative, positive" in logits["description"]
    assert (logits["minItems"], logits["maxItems"]) == (2, 2)
    assert row["properties"]["label"]["type"] == "integer"  # one scalar per row

    operation = document["paths"]["/predict"]["post"]
    content = operation["requestBody"]["content"]
    assert set(content) == {"application/json", "application/x-npz"}
    assert content["application/x-npz"]["schema"]["format"] == "binary"
    assert set(operation["responses"]["200"]["content"]) == {
        "application/json",
        "application/x-npz",
    }


def test_token_ids_accept_the_padding_value_but_nothing_else_out_of_range() -> None:
    document = model_openapi(BASE, served(SENTIMENT), max_instances=8)
    schema = request_schema(document)

    def body(ids: list[int]) -> dict[str, Any]:
        return {"instances": [{"input_ids": ids, "attention_mask": [1] * len(ids)}]}

    assert is_valid(schema, body([5, 999, 0]))
    assert not is_valid(schema, body([5, 1000]))
    assert not is_valid(schema, body([5, -1]))
    assert not is_valid(schema, body([]))
    assert not is_valid(schema, body([5] * 17))
    assert not is_valid(schema, {"instances": [{"input_ids": [5]}]})
    assert not is_valid(schema, {"instances": [body([5])["instances"][0]] * 9})


def test_the_length_buckets_bound_a_variable_axis_without_max_length() -> None:
    version = manifest(
        inputs=(tensor("tokens", "int32", (-1, -1)),), outputs=(tensor("score", "float16", (-1,)),)
    )
    document = model_openapi(BASE, served(version, length_edges=(8, 32)), max_instances=8)
    tokens = request_schema(document)["properties"]["instances"]["items"]
    assert (tokens["minItems"], tokens["maxItems"]) == (1, 32)
    assert tokens["items"] == {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
    assert answer_schema(document)["properties"]["predictions"]["items"]["type"] == "number"


def test_a_scalar_input_is_a_bare_value_and_floats_stay_finite_in_their_dtype() -> None:
    version = manifest(
        inputs=(tensor("x", "float16", (-1,)),), outputs=(tensor("flag", "bool", (-1, 3)),)
    )
    document = model_openapi(BASE, served(version), max_instances=8)
    schema = request_schema(document)
    assert schema["properties"]["instances"]["items"]["type"] == "number"
    assert is_valid(schema, {"instances": [1.5, -65504]})
    assert not is_valid(schema, {"instances": [70000.0]})
    assert not is_valid(schema, {"instances": [[1.5]]})
    row = answer_schema(document)["properties"]["predictions"]["items"]
    assert row["items"]["type"] == "boolean"
    assert set(document["paths"]["/predict"]["post"]["requestBody"]["content"]) == {
        "application/json",
        "application/x-npy",
        "application/x-npz",
    }


TEXT_HANDLER = HandlerSpec(import_path="service.frontend.handlers.text:TextHandler")


def test_a_handler_describes_its_own_bodies() -> None:
    version = manifest(
        inputs=SENTIMENT.inputs,
        outputs=SENTIMENT.outputs,
        handler=TEXT_HANDLER,
    )
    text = {"type": "string", "minLength": 1}
    label = {"type": "object", "properties": {"label": {"enum": ["negative", "positive"]}}}
    described = model_openapi(
        BASE,
        served(version),
        max_instances=8,
        handler_description={"handler": "TextHandler", "request": {"text/plain": text},
                             "response": label},
    )  # fmt: skip
    assert described["paths"]["/predict"]["post"]["requestBody"]["content"] == {
        "text/plain": {"schema": text}
    }
    assert answer_schema(described)["properties"]["predictions"]["items"] == label

    media_types = ["application/json", "text/plain", "image/png"]
    loose = model_openapi(
        BASE,
        served(version),
        max_instances=8,
        handler_description={"handler": "TextHandler", "media_types": media_types},
    )
    operation = loose["paths"]["/predict"]["post"]
    content = operation["requestBody"]["content"]
    assert [content[kind]["schema"]["type"] for kind in media_types] == [
        "object",
        "string",
        "string",
    ]
    assert content["image/png"]["schema"]["format"] == "binary"
    assert operation["x-batchserve-handler"]["import_path"] == TEXT_HANDLER.import_path


def test_the_base_document_is_left_unchanged() -> None:
    before = orjson.dumps(BASE)
    model_openapi(BASE, served(SENTIMENT), max_instances=8)
    assert orjson.dumps(BASE) == before
