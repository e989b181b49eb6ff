"""Random and hostile ``/predict`` bodies through the real app: never a 5xx, always a JSON error.

Hypothesis throws arbitrary JSON, nested lists of random depth and mixed types, raw bytes,
forged ``.npy`` headers and random content types at the real app (digits, and textenc for the
integer, variable-length path) in-process. Every answer must be 200 or a 4xx carrying the JSON
error with the request id, and a valid body must still get 200 after each one. Runs are
derandomized (the same examples every time) and bounded in count.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.config import Settings
from service.server.single import create_app
from tests.apps import frontend_of, registry_of
from tests.fixtures import lifespan, predict_scope, sample_total

NPY = "application/x-npy"
JSON = "application/json"
#: Enough examples to cover every branch of the strategies below, few enough for seconds.
FUZZ_SETTINGS = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    # One app serves every example on purpose: it must keep serving after each of them.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VALID_DIGITS = json.dumps({"instances": [[[0.5] * 8] * 8]}).encode()
VALID_TOKENS = json.dumps({"instances": [[5, 17, 999], [1]]}).encode()


@contextlib.asynccontextmanager
async def serving(**overrides: Any) -> AsyncIterator[FastAPI]:
    app = create_app(Settings(device="cpu", max_wait_ms=1.0, **overrides))
    async with lifespan(app):
        await app.state.loading
        assert frontend_of(app).ready
        yield app


def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def digits_app() -> AsyncIterator[FastAPI]:
    async with serving(model_name="digits") as app:
        yield app


@pytest.fixture
async def digits(digits_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(digits_app) as http:
        yield http


@pytest.fixture
async def textenc() -> AsyncIterator[httpx.AsyncClient]:
    async with serving(model_name="textenc", torch_threads=1) as app, client_of(app) as http:
        yield http


# ------------------------------------------------------------------------------ strategies

#: Every kind of JSON scalar, with ints beyond 64 bits and floats beyond float32 (and NaN and
#: infinities, which ``json.dumps`` writes as the non-standard literals NaN and Infinity).
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-1000, max_value=1000),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    st.floats(),
    st.floats(min_value=0.0, max_value=1.0),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=40,
)


@st.composite
def nested_lists(draw: st.DrawFn) -> Any:
    """A regular nested list of random depth (up to 80, past numpy's 64 dimensions)."""
    value: Any = draw(st.lists(scalars, min_size=0, max_size=8))
    copies = 1
    for _ in range(draw(st.integers(min_value=0, max_value=80))):
        width = draw(st.integers(min_value=1, max_value=2 if copies < 64 else 1))
        copies *= width
        value = [value] * width
    return value


@st.composite
def near_valid_digits(draw: st.DrawFn) -> Any:
    """Mostly well-formed 8x8 images; some cells swapped for other kinds of values."""
    count = draw(st.integers(min_value=1, max_value=3))
    images = [[[0.25] * 8 for _ in range(8)] for _ in range(count)]
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        image = draw(st.integers(min_value=0, max_value=count - 1))
        row, column = draw(st.integers(0, 7)), draw(st.integers(0, 7))
        images[image][row][column] = draw(json_values)
    return images


def dumps(document: Any) -> bytes:
    # The stdlib encoder writes ints of any size and NaN/Infinity literals; orjson refuses both.
    return json.dumps(document).encode()


@st.composite
def forged_npy(draw: st.DrawFn) -> bytes:
    """A ``.npy`` header of any dtype and shape (huge ones too), then some bytes of data."""
    dtype = draw(st.sampled_from(["<f4", ">f4", "<f8", "<i8", "|u1", "|b1", "|O", "<c8", "<U3"]))
    shape = tuple(
        draw(
            st.lists(
                st.integers(min_value=0, max_value=10) | st.integers(min_value=0, max_value=10**12),
                max_size=4,
            )
        )
    )
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": dtype, "fortran_order": draw(st.booleans()), "shape": shape}
    )
    return header.getvalue() + draw(st.binary(max_size=600))


@st.composite
def mangled_npy(draw: st.DrawFn) -> bytes:
    """A valid ``.npy`` header with a slice of it replaced by Python-ish punctuation: what
    numpy's header parser (Python's tokenizer) makes of unclosed brackets and strings."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((1, 8, 8), dtype=np.float32), allow_pickle=False)
    data = buffer.getvalue()
    start = draw(st.integers(min_value=10, max_value=70))
    end = draw(st.integers(min_value=start, max_value=80))
    junk = draw(st.text(alphabet="(){}[]'\",:# 0123456789abcdef\\", max_size=12))
    return data[:start] + junk.encode() + data[end:]


@st.composite
def real_npy(draw: st.DrawFn) -> bytes:
    dtype = draw(st.sampled_from(["<f4", ">f4", "<f8", "<i8", "|u1", "|b1"]))
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=9), max_size=4)))
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    data = draw(st.binary(min_size=size, max_size=size))  # any bit patterns: NaN, infinities
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    data = buffer.getvalue()
    cut = draw(st.integers(min_value=0, max_value=len(data)))
    return data if draw(st.booleans()) else data[:cut]


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid body with a slice cut out or bytes overwritten."""
    data = bytearray(valid)
    start = draw(st.integers(min_value=0, max_value=len(data)))
    end = draw(st.integers(min_value=start, max_value=len(data)))
    replacement = draw(st.binary(max_size=8) | st.sampled_from([b"NaN", b"-Infinity", b"1e999"]))
    data[start:end] = replacement
    return bytes(data)


header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
).map(str.strip)
json_types = st.sampled_from([JSON, "application/json; charset=utf-8", "APPLICATION/JSON"])
npy_types = st.sampled_from([NPY, "application/octet-stream", "Application/X-NPY; q=1"])
content_types = st.one_of(
    st.none(),
    json_types,
    npy_types,
    st.sampled_from(
        [
            "text/plain",
            "text/csv",
            "application/xml",
            "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded",
            "",
            ";",
            "application/json, text/plain",
        ]
    ),
    header_text,
)
#: Raw bytes, some starting like a .npy file (any format version) or a zip (.npz) archive.
raw_bytes = st.builds(
    bytes.__add__,
    st.sampled_from(
        [
            b"",
            b"\x93NUMPY",
            b"\x93NUMPY\x01\x00",
            b"\x93NUMPY\x02\x00",
            b"\x93NUMPY\x03\x00",
            b"PK\x03\x04",
            b"PK\x05\x06",
            b"{",
            b'{"instances": ',
        ]
    ),
    st.binary(max_size=512),
)


def requests(
    valid: bytes, instances: st.SearchStrategy[Any]
) -> st.SearchStrategy[tuple[bytes, str | None]]:
    """(body, content type): each kind of body mostly with its own type, sometimes any type."""
    json_bodies = st.one_of(
        json_values.map(dumps),
        st.builds(lambda value: {"instances": value}, json_values).map(dumps),
        st.builds(lambda value: {"instances": value}, nested_lists()).map(dumps),
        st.builds(lambda value: {"instances": value}, instances).map(dumps),
        st.builds(
            lambda value, extra: {"instances": value, **extra},
            instances,
            st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=2),
        ).map(dumps),
        mutated(valid),
    )
    npy_bodies = st.one_of(forged_npy(), mangled_npy(), real_npy(), raw_bytes)
    return st.one_of(
        st.tuples(json_bodies, json_types | st.none()),
        st.tuples(npy_bodies, npy_types),
        st.tuples(json_bodies | npy_bodies, content_types),
    )


accepts = st.one_of(st.none(), st.sampled_from([JSON, NPY, "*/*", f"{NPY}, {JSON}"]), header_text)


# ------------------------------------------------------------------------------ checks


def assert_json_error(response: httpx.Response) -> None:
    """A 4xx answer carrying exactly ``{"error": {"code", "message", "request_id"}}``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == JSON
    document = response.json()
    assert set(document) == {"error"}
    error = document["error"]
    assert set(error) == {"code", "message", "request_id"}
    assert all(isinstance(error[key], str) and error[key] for key in error)
    assert error["request_id"] == response.headers["x-request-id"]


async def post(
    http: httpx.AsyncClient,
    body: bytes,
    content_type: str | None = JSON,
    accept: str | None = None,
) -> httpx.Response:
    headers = {}
    if content_type is not None:
        headers["content-type"] = content_type
    if accept is not None:
        headers["accept"] = accept
    return await http.post("/predict", content=body, headers=headers)


async def check_any_answer(
    http: httpx.AsyncClient, body: bytes, content_type: str | None, accept: str | None
) -> None:
    response = await post(http, body, content_type, accept)
    if response.status_code != 200:
        assert_json_error(response)
    assert "server" not in response.headers


async def check_still_serving(http: httpx.AsyncClient, valid: bytes, columns: int) -> None:
    response = await post(http, valid)
    assert response.status_code == 200, response.text
    assert all(len(row) == columns for row in response.json()["predictions"])


# ------------------------------------------------------------------------------ fuzzing


@FUZZ_SETTINGS
@given(request=requests(VALID_DIGITS, near_valid_digits()), accept=accepts)
async def test_digits_answers_any_body_with_200_or_a_json_4xx(
    digits: httpx.AsyncClient, request: tuple[bytes, str | None], accept: str | None
) -> None:
    await check_any_answer(digits, *request, accept)
    await check_still_serving(digits, VALID_DIGITS, columns=10)


token_lists = st.lists(
    st.lists(st.integers(min_value=-2, max_value=1001) | scalars, min_size=0, max_size=12),
    min_size=0,
    max_size=3,
)


@settings(FUZZ_SETTINGS, max_examples=100)
@given(request=requests(VALID_TOKENS, token_lists), accept=accepts)
async def test_textenc_answers_any_body_with_200_or_a_json_4xx(
    textenc: httpx.AsyncClient, request: tuple[bytes, str | None], accept: str | None
) -> None:
    await check_any_answer(textenc, *request, accept)
    await check_still_serving(textenc, VALID_TOKENS, columns=256)


# ------------------------------------------------------------------------------ explicit cases


def nested(depth: int, inner: Any = 0.5) -> Any:
    value = inner
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        # orjson stops at 1024 levels: 400 without recursing 10,000 deep.
        (b"[" * 10_000 + b"]" * 10_000, 400, "depth"),
        (b'{"instances": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, "depth"),
        (b'{"instances": ' + b"[" * 10_000, 400, "not valid JSON"),
        # Deep enough for numpy (more than 64 dimensions) yet under orjson's limit.
        (dumps({"instances": nested(100)}), 422, "nested lists of numbers"),
        (dumps({"instances": nested(62, [[0.5] * 8] * 8)}), 422, "expected instances of shape"),
        (b'{"instances": [[[NaN, 0, 0, 0, 0, 0, 0, 0]]]}', 400, "not valid JSON"),
        (b'{"instances": [[[Infinity]]]}', 400, "not valid JSON"),
        (b'{"instances": [[[-Infinity]]]}', 400, "not valid JSON"),
        (b'{"instances": [[[1e999]]]}', 400, "not valid JSON"),
        (dumps({"instances": [[[1e39] * 8] * 8]}), 422, "not finite"),
        # orjson reads integers beyond 64 bits as floats: 1e40 is beyond float32.
        (dumps({"instances": [[[10**40] * 8] * 8]}), 422, "not finite"),
        # Finite in float32, but outside the [0, 1] the digits manifest declares.
        (dumps({"instances": [[[2**64 - 1] * 8] * 8]}), 422, "values must lie in [0, 1]"),
        (dumps({"instances": [[["0.5"] * 8] * 8]}), 422, "only numbers"),
        (dumps({"instances": [[[0.5] * 7 + ["0.5"]] * 8]}), 422, "only numbers"),
        (dumps({"instances": [[[0.5] * 7 + [None]] * 8]}), 422, "only numbers"),
        (dumps({"instances": [[[0.5] * 7 + [True]] * 8]}), 422, "booleans"),
        (dumps({"instances": [[[0.5] * 7 + [{}]] * 8]}), 422, "only numbers"),
        (dumps({"instances": [[[0.5] * 7 + [[0.5]]] * 8]}), 422, "uneven lengths"),
        (dumps({"instances": [[[0.5] * 8] * 8], "model": "digits"}), 422, "unknown field"),
        (dumps({"Instances": [[[0.5] * 8] * 8]}), 422, "unknown field"),
        (dumps({}), 422, "missing field 'instances'"),
        (dumps({"instances": None}), 422, "must be a list"),
        (dumps({"instances": {"0": [[0.5] * 8] * 8}}), 422, "must be a list"),
        (dumps("instances"), 422, "JSON object"),
        (dumps(None), 422, "JSON object"),
        (b"", 400, "not valid JSON"),
        (b"\xff\xfe{}", 400, "not valid JSON"),
    ],
    ids=lambda value: value[:40] if isinstance(value, bytes) else str(value),
)
async def test_hostile_json_bodies_get_the_right_answer(
    digits: httpx.AsyncClient, body: bytes, status: int, fragment: str
) -> None:
    response = await post(digits, body)
    assert response.status_code == status, response.text
    if status != 200:
        assert_json_error(response)
        assert fragment in response.json()["error"]["message"]
    await check_still_serving(digits, VALID_DIGITS, columns=10)


async def test_booleans_among_token_ids_are_refused(textenc: httpx.AsyncClient) -> None:
    response = await post(textenc, dumps({"instances": [[5, True, 7]]}))
    assert response.status_code == 422
    assert "booleans" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/csv", "application/xml", "multipart/form-data; boundary=x", "image/png"],
)
async def test_wrong_content_type_is_415(digits: httpx.AsyncClient, content_type: str) -> None:
    response = await post(digits, VALID_DIGITS, content_type)
    assert response.status_code == 415
    assert_json_error(response)
    assert response.json()["error"]["code"] == "unsupported_media_type"


async def test_npy_header_declaring_a_huge_array_is_400_without_allocating_it(
    digits: httpx.AsyncClient,
) -> None:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**10, 8, 8)}
    )
    response = await post(digits, header.getvalue() + bytes(64), NPY)
    assert response.status_code == 400
    assert_json_error(response)
    assert "declares shape (10000000000, 8, 8)" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [b"PK\x03\x04", b"PK\x05\x06" + bytes(18)])
async def test_broken_or_empty_zip_is_400(digits: httpx.AsyncClient, body: bytes) -> None:
    response = await post(digits, body, NPY)
    assert response.status_code == 400
    assert_json_error(response)


async def test_huge_declared_length_is_413_before_the_body_arrives(digits_app: FastAPI) -> None:
    """Called at the ASGI level with a body that never finishes: the 413 must not wait for it."""
    rest_of_body = asyncio.Event()  # never set
    messages: list[dict[str, Any]] = []
    first_chunk_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal first_chunk_sent
        if not first_chunk_sent:
            first_chunk_sent = True
            return {"type": "http.request", "body": b'{"instances": [', "more_body": True}
        await rest_of_body.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = predict_scope(
        [(b"content-type", b"application/json"), (b"content-length", b"99999999999")]
    )
    await asyncio.wait_for(digits_app(scope, receive, send), timeout=5.0)
    assert messages[0]["type"] == "http.response.start"
    assert messages[0]["status"] == 413
    error = json.loads(messages[1]["body"])["error"]
    assert error["code"] == "payload_too_large"
    assert "99,999,999,999" in error["message"]


@pytest.mark.parametrize("length", ["-1", "1e3", "abc", " 12"])
async def test_invalid_content_length_is_400(digits: httpx.AsyncClient, length: str) -> None:
    response = await digits.post(
        "/predict", content=VALID_DIGITS, headers={"content-type": JSON, "content-length": length}
    )
    assert response.status_code == 400
    assert_json_error(response)


async def test_errors_never_leave_the_server_half_broken(
    digits_app: FastAPI, digits: httpx.AsyncClient
) -> None:
    """200 concurrent hostile requests mixed with valid ones: valid ones all answered 200."""
    hostile = [
        (b"[" * 5000, JSON),
        (dumps({"instances": [[[True] * 8] * 8]}), JSON),
        (b"\x93NUMPY\x01\x00" + bytes(200), NPY),
        (dumps({"instances": nested(100)}), JSON),
        (VALID_DIGITS, "text/plain"),
    ]
    bodies = [
        hostile[index // 2 % len(hostile)] if index % 2 else (VALID_DIGITS, JSON)
        for index in range(200)
    ]
    pending = [post(digits, body, content_type) for body, content_type in bodies]
    responses = await asyncio.gather(*pending)
    for index, response in enumerate(responses):
        if index % 2:
            assert_json_error(response)
        else:
            assert response.status_code == 200
    assert frontend_of(digits_app).ready
    registry = registry_of(digits_app)
    assert sample_total(registry, "batchserve_in_flight_requests") == 0
