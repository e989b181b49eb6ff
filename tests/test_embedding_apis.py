"""OpenAI's ``/v1/embeddings`` through the ``openai`` SDK, and TEI's ``/embed`` and ``/rerank``
through plain HTTP as TEI documents them, against sentence-transformers folders served in
one process: every answer equals ``SentenceTransformer.encode`` / ``CrossEncoder.predict``
on the same folder (1e-5), and every refusal comes in the API's own error shape."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio

from service.config import Settings
from service.server.cli import main
from service.server.single import create_app
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.hf_folders import save_cross_encoder, save_sentence_transformer, save_text_model

pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

pytestmark = [
    # One server for the module's tests: its event loop is the module's.
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

PARITY = 1e-5
TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "the quick brown fox jumps over the lazy dog and Ada Lovelace wrote the first program",
    "a",
]
FITTING = [TEXTS[0], TEXTS[1], TEXTS[3]]
"""The texts within the 12 tokens ``unit`` reads (``TEXTS[2]`` holds 18)."""
QUERY = "where is Paris"
PROMPTS = {"query": "query: ", "passage": "a dull story: "}
MAX_CLIENT_BATCH_SIZE = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``unit``: mean pooling then Normalize, with prompts; ``prompted``: the same with a
    default prompt, and the model's whole length; ``raw``: CLS pooling, no Normalize, no
    prompt; ``reranker``: a cross-encoder. Packaged into ``repository``."""
    root = tmp_path_factory.mktemp("apis")
    bert = save_text_model(root / "bert", "feature-extraction", initializer_range=0.3)
    folders = {
        "unit": save_sentence_transformer(
            root / "unit", bert, then=("normalize",), max_seq_length=12, prompts=PROMPTS
        ),
        "prompted": save_sentence_transformer(
            root / "prompted",
            bert,
            then=("normalize",),
            prompts=PROMPTS,
            default_prompt_name="query",
        ),
        "raw": save_sentence_transformer(root / "raw", bert, pooling="cls"),
        "reranker": save_cross_encoder(root / "reranker", bert, max_length=12),
    }
    for name, folder in folders.items():
        command = ["package", "--repository", str(root / "repository"), "--name", name]
        assert main([*command, "--hf", str(folder)]) == 0
    folders["repository"] = root / "repository"
    return folders


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(folders: dict[str, Path]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        Settings(
            model_repository=folders["repository"],
            models=("reranker", "unit", "raw", "prompted"),  # /embed finds "unit", not the first
            device="cpu",
            max_wait_ms=20.0,
            warmup_batch_sizes=(1,),
            max_client_batch_size=MAX_CLIENT_BATCH_SIZE,
            request_timeout_ms=60_000.0,
        )
    )
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


@pytest.fixture(scope="module")
def encoders(folders: dict[str, Path]) -> dict[str, Any]:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    return {
        "unit": SentenceTransformer(str(folders["unit"]), device="cpu"),
        "raw": SentenceTransformer(str(folders["raw"]), device="cpu"),
        "prompted": SentenceTransformer(str(folders["prompted"]), device="cpu"),
        "reranker": CrossEncoder(str(folders["reranker"]), device="cpu"),
    }


def sdk(client: httpx.AsyncClient) -> Any:
    """The ``openai`` SDK as an application uses it, over the served app."""
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", http_client=client, max_retries=0
    )


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
async def test_the_openai_sdk_gets_what_encode_gives(
    client: httpx.AsyncClient, encoders: dict[str, Any], encoding_format: str | None
) -> None:
    """Floats; base64 asked for (little-endian float32, decoded here as OpenAI documents);
    and the SDK's default (it asks for base64 and decodes it itself). Usage counts the
    tokens the model read."""
    openai_client = sdk(client)
    options = {} if encoding_format is None else {"encoding_format": encoding_format}
    answer = await openai_client.embeddings.create(model="unit", input=FITTING, **options)
    got = np.array([decoded(item.embedding) for item in answer.data])
    np.testing.assert_allclose(got, encoders["unit"].encode(FITTING), atol=PARITY)
    assert [item.index for item in answer.data] == list(range(len(FITTING)))
    assert answer.model == "unit"
    tokens = sum(len(ids) for ids in encoders["unit"].tokenizer(FITTING)["input_ids"])
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    one = await openai_client.embeddings.create(model="raw", input=TEXTS[0], **options)
    np.testing.assert_allclose(
        decoded(one.data[0].embedding), encoders["raw"].encode(TEXTS[0]), atol=PARITY
    )


def decoded(embedding: list[float] | str) -> Any:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return embedding


async def test_dimensions_truncate_and_renormalize_as_truncate_dim(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """A model ending in Normalize answers unit vectors at any ``dimensions`` (as ``encode``
    with ``truncate_dim`` and ``normalize_embeddings``); another its rows cut (as
    ``truncate_dim``); more dimensions than the model's are refused, 400."""
    openai_client = sdk(client)
    for name, normalize in (("unit", True), ("raw", False)):
        answer = await openai_client.embeddings.create(model=name, input=FITTING, dimensions=5)
        want = encoders[name].encode(FITTING, truncate_dim=5, normalize_embeddings=normalize)
        np.testing.assert_allclose([d.embedding for d in answer.data], want, atol=PARITY)
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client.embeddings.create(model="unit", input=TEXTS, dimensions=17)
    assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
    assert "more than this model's 16" in refused.value.body["message"]  # type: ignore[index]


async def test_token_ids_are_embedded_as_given(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """A list of token ids, or a list of lists, is the texts those ids are (no prompt, no
    special token added): the tokenizer's ids of a text embed as the text."""
    ids = encoders["raw"].tokenizer(TEXTS)["input_ids"]
    answer = await sdk(client).embeddings.create(model="raw", input=ids)
    want = encoders["raw"].encode(TEXTS)
    np.testing.assert_allclose([d.embedding for d in answer.data], want, atol=PARITY)
    one = await sdk(client).embeddings.create(model="raw", input=ids[1])
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=PARITY)
    assert one.usage.prompt_tokens == len(ids[1])


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "said"),
    [
        ({"model": "nope", "input": "a"}, 404, "model_not_found", None, "unknown model 'nope'"),
        ({"model": "reranker", "input": "a"}, 404, "model_not_found", None, "not an embedding"),
        ({"model": "unit", "input": []}, 400, "invalid_input", "input", "input is empty"),
        ({"model": "unit", "input": "a", "temperature": 1}, 400, "invalid_input",
         "temperature", "unknown field 'temperature'"),
        ({"model": "unit", "input": [1.5]}, 400, "invalid_input", "input", "none of the types"),
        ({"input": "a"}, 400, "invalid_input", "model", "Field required"),
        ({"model": "unit", "input": "a", "encoding_format": "int8"}, 400, "invalid_input",
         "encoding_format", "'float' or 'base64'"),
        ({"model": "raw", "input": [[10**9]]}, 400, "invalid_input", "input", "vocabulary"),
        ({"model": "unit", "input": TEXTS}, 400, "invalid_input", "input",
         "input 2 is 18 tokens long, more than the 12 this model reads"),
        ({"model": "unit", "input": [list(range(1, 14))]}, 400, "invalid_input", "input",
         "input 0 is 13 tokens long"),
        ({"model": "unit", "input": ["a"] * (MAX_CLIENT_BATCH_SIZE + 1)}, 413,
         "payload_too_large", None, "max_client_batch_size"),
    ],
)  # fmt: skip
async def test_openai_refusals_come_in_openais_shape(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, code: str,
    param: str | None, said: str,
) -> None:  # fmt: skip
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param)
    assert said in error["message"]


async def test_the_sdk_raises_its_own_errors(client: httpx.AsyncClient) -> None:
    with pytest.raises(openai.NotFoundError):
        await sdk(client).embeddings.create(model="nope", input="a")


async def test_tei_embed_answers_as_tei_documents(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """``/embed`` answers with the first embedding model served (not the reranker before
    it): unit vectors by default (``normalize``), a prompt by name, ``dimensions``; the
    model's own rows with ``normalize: false``; ``/models/{name}/embed`` names one."""
    unit, raw = encoders["unit"], encoders["raw"]
    answer = await client.post("/embed", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json(), unit.encode(TEXTS), atol=PARITY)
    one = await client.post("/embed", json={"inputs": TEXTS[0], "prompt_name": "query"})
    np.testing.assert_allclose(
        one.json(), unit.encode([TEXTS[0]], prompt_name="query"), atol=PARITY
    )
    named = await client.post("/models/raw/embed", json={"inputs": TEXTS, "normalize": False})
    np.testing.assert_allclose(named.json(), raw.encode(TEXTS), atol=PARITY)
    unit_rows = await client.post("/models/raw/embed", json={"inputs": TEXTS, "dimensions": 4})
    want = raw.encode(TEXTS, truncate_dim=4, normalize_embeddings=True)
    np.testing.assert_allclose(unit_rows.json(), want, atol=PARITY)


async def test_tei_rerank_ranks_as_cross_encoder_predict(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """Scores equal ``CrossEncoder.predict`` (raw: the logits), highest first, with the texts
    when asked."""
    import torch

    pairs = [(QUERY, text) for text in TEXTS]
    want = encoders["reranker"].predict(pairs)
    assert np.ptp(want) > 100 * PARITY, "the scores differ from text to text"
    answer = await client.post(
        "/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True}
    )
    assert answer.status_code == 200, answer.text
    ranks = answer.json()
    assert [rank["index"] for rank in ranks] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in ranks], np.sort(want)[::-1], atol=PARITY)
    assert [rank["text"] for rank in ranks] == [TEXTS[rank["index"]] for rank in ranks]
    raw = await client.post(
        "/models/reranker/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True}
    )
    logits = encoders["reranker"].predict(pairs, activation_fn=torch.nn.Identity())
    by_index = {rank["index"]: rank["score"] for rank in raw.json()}
    np.testing.assert_allclose([by_index[i] for i in range(len(TEXTS))], logits, atol=PARITY)
    assert all("text" not in rank for rank in raw.json())


async def test_tei_truncate_cuts_from_the_side_asked(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """``truncate: true`` cuts a long input at the model's length from the ``Right`` (as
    ``encode``, and as when ``truncate`` is absent: the version truncates) or the ``Left``
    (as ``encode`` with the tokenizer's ``truncation_side`` left); the texts that fit are
    the same either way. ``/rerank`` cuts its pairs the same way."""
    unit = encoders["unit"]
    right = unit.encode(TEXTS)
    for body in ({"truncate": True}, {"truncate": True, "truncation_direction": "right"}, {}):
        answer = await client.post("/embed", json={"inputs": TEXTS, **body})
        np.testing.assert_allclose(answer.json(), right, atol=PARITY)
    reranker = encoders["reranker"]
    pairs = [(QUERY, text) for text in TEXTS]
    with left_side(unit), left_side(reranker):
        left = unit.encode(TEXTS)
        left_scores = reranker.predict(pairs)
    assert not np.allclose(left[2], right[2], atol=1e-3), "the long text is cut elsewhere"
    for direction in ("Left", "left"):
        body = {"inputs": TEXTS, "truncate": True, "truncation_direction": direction}
        answer = await client.post("/embed", json=body)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json(), left, atol=PARITY)
    body = {"query": QUERY, "texts": TEXTS, "truncate": True, "truncation_direction": "Left"}
    ranks = (await client.post("/rerank", json=body)).json()
    by_index = {rank["index"]: rank["score"] for rank in ranks}
    np.testing.assert_allclose([by_index[i] for i in range(len(TEXTS))], left_scores, atol=1e-5)


@contextlib.contextmanager
def left_side(model: Any) -> Iterator[None]:
    """``model``'s tokenizer cutting long texts from the left while in the block."""
    model.tokenizer.truncation_side = "left"
    try:
        yield
    finally:
        model.tokenizer.truncation_side = "right"


async def test_tei_embed_applies_no_default_prompt(
    client: httpx.AsyncClient, encoders: dict[str, Any]
) -> None:
    """TEI reads a folder's prompts but not its ``default_prompt_name``: ``/embed`` puts a
    prompt before the texts only when ``prompt_name`` names one. ``/v1/embeddings`` and
    ``/predict`` apply the default, as ``encode`` does."""
    prompted = encoders["prompted"]
    with_default = prompted.encode(FITTING)
    prompted.default_prompt_name = None
    try:
        without = prompted.encode(FITTING)
    finally:
        prompted.default_prompt_name = "query"
    assert not np.allclose(with_default, without, atol=1e-3), "the prompt changes the rows"
    tei = await client.post("/models/prompted/embed", json={"inputs": FITTING})
    assert tei.status_code == 200, tei.text
    np.testing.assert_allclose(tei.json(), without, atol=PARITY)
    for name in ("query", "passage"):
        body = {"inputs": FITTING, "prompt_name": name}
        named = await client.post("/models/prompted/embed", json=body)
        np.testing.assert_allclose(
            named.json(), prompted.encode(FITTING, prompt_name=name), atol=PARITY
        )
    oai = await sdk(client).embeddings.create(model="prompted", input=FITTING)
    np.testing.assert_allclose([d.embedding for d in oai.data], with_default, atol=PARITY)
    predicted = await client.post("/models/prompted/predict", json={"instances": FITTING})
    np.testing.assert_allclose(predicted.json()["predictions"], with_default, atol=PARITY)


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "said"),
    [
        ("/embed", {"inputs": ["a"] * (MAX_CLIENT_BATCH_SIZE + 1)}, 413, "Validation",
         "max_client_batch_size"),
        ("/embed", {"inputs": []}, 400, "Empty", "inputs is empty"),
        ("/embed", {"inputs": "a", "truncation_direction": "Up"}, 422, "Validation",
         "truncation_direction"),
        ("/embed", {"inputs": "a", "prompt_name": "nope"}, 422, "Validation", "prompt_name"),
        ("/embed", {"inputs": [1, 2], "prompt_name": "query"}, 422, "Validation",
         "not token ids"),
        ("/embed", {"inputs": "a", "dimensions": 17}, 422, "Validation", "dimensions"),
        ("/embed", {"text": "a"}, 422, "Validation", "inputs"),
        ("/embed", {"inputs": TEXTS, "truncate": False}, 422, "Validation",
         "input 2 is 18 tokens long, more than the 12 this model reads"),
        ("/embed", {"inputs": [list(range(1, 14))], "truncate": False}, 422, "Validation",
         "input 0 is 13 tokens long"),
        ("/rerank", {"query": QUERY, "texts": TEXTS, "truncate": False}, 422, "Validation",
         "tokens long, more than the 12 this model reads"),
        ("/rerank", {"query": QUERY, "texts": []}, 400, "Empty", "texts is empty"),
        ("/models/unit/rerank", {"query": QUERY, "texts": ["a"]}, 404, "Validation",
         "not a reranker"),
        ("/models/nope/embed", {"inputs": "a"}, 404, "Validation", "unknown model"),
    ],
)  # fmt: skip
async def test_tei_refusals_come_in_teis_shape(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int,
    error_type: str, said: str,
) -> None:  # fmt: skip
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error", "error_type"}
    assert response.json()["error_type"] == error_type
    assert said in response.json()["error"]


async def test_the_routes_are_documented_and_counted(client: httpx.AsyncClient) -> None:
    """In the OpenAPI document, and in the request metrics by their own route labels; a
    body that is not JSON is refused 415 before it is read."""
    document = (await client.get("/openapi.json")).json()
    for path in ("/v1/embeddings", "/embed", "/rerank", "/models/{name}/embed"):
        assert "post" in document["paths"][path]
    refused = await client.post("/embed", content=b"a", headers={"content-type": "text/plain"})
    assert refused.status_code == 415
    await asyncio.gather(*(client.post("/embed", json={"inputs": "a"}) for _ in range(2)))
    metrics = (await client.get("/metrics")).text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("batchserve_requests_total{")
        and 'route="/embed"' in line
        and 'status="200"' in line
    ]
    assert counted, "the /embed route's requests are counted under its own label"
    assert float(counted[0].rsplit(" ", 1)[1]) >= 2


async def test_the_limits_of_every_inference_route_apply(client: httpx.AsyncClient) -> None:
    """A priority the server does not know and a body over ``max_body_bytes`` are refused
    before anything is computed, in each API's shape."""
    bad = {"x-priority": "urgent"}
    tei = await client.post("/embed", json={"inputs": "a"}, headers=bad)
    assert (tei.status_code, tei.json()["error_type"]) == (422, "Validation")
    oai = await client.post("/v1/embeddings", json={"model": "unit", "input": "a"}, headers=bad)
    assert (oai.status_code, oai.json()["error"]["code"]) == (400, "invalid_input")
    huge = b'{"inputs": "' + b"a" * (8 * 1024 * 1024) + b'"}'
    too_large = await client.post("/embed", content=huge)
    assert too_large.status_code == 413
    assert "bytes" in too_large.json()["error"]


async def test_openais_model_list_names_the_embedding_models(client: httpx.AsyncClient) -> None:
    listed = await sdk(client).models.list()
    names = {model.id for model in listed.data}
    assert "unit" in names
    assert "reranker" not in names  # OpenAI's routes do not rank
