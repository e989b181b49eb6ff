"""The Open Inference Protocol (V2) over REST: the real ``tritonclient[http]`` against live
servers on 127.0.0.1, and each protocol error; answers equal ``/predict``'s."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc_client
import tritonclient.http as triton_http
from fastapi import FastAPI
from tritonclient.utils import InferenceServerException

from service.config import Settings
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of
from tests.fixtures import lifespan
from tests.processes import (
    BATCHSERVE,
    Running,
    answers,
    batchserve_environment,
    free_port,
    scraped,
    wait_for,
)
from tests.processes import running as running_process


@pytest.fixture(scope="module")
def digits_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    yield from _server(tmp_path_factory.mktemp("digits"), "digits")


@pytest.fixture(scope="module")
def textenc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    yield from _server(tmp_path_factory.mktemp("textenc"), "textenc")


@pytest.fixture(scope="module")
def pairs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    yield from _server(tmp_path_factory.mktemp("pairs"), "sentiment_tensors")


def _server(folder: Path, model: str) -> Iterator[Running]:
    port = free_port()
    env = batchserve_environment(
        port, BATCHSERVE_MODEL_NAME=model, BATCHSERVE_GRPC_PORT=str(free_port())
    )
    url = f"http://127.0.0.1:{port}"
    with running_process([str(BATCHSERVE), "serve"], url, folder / "server.log", env) as server:
        wait_for(lambda: answers(url + "/readyz"), "ready", server)
        server.grpc = "127.0.0.1:" + env["BATCHSERVE_GRPC_PORT"]  # type: ignore[attr-defined]
        yield server


def triton_grpc(server: Running) -> triton_grpc_client.InferenceServerClient:
    return triton_grpc_client.InferenceServerClient(server.grpc)  # type: ignore[attr-defined]


def triton(server: Running) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(server.url.removeprefix("http://"))


def predicted(server: Running, instances: list[object]) -> np.ndarray:
    response = httpx.post(server.url + "/predict", json={"instances": instances}, timeout=30)
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["predictions"], dtype=np.float32)


def test_tritonclient_http_health_metadata_and_digits_in_json_and_binary(
    digits_server: Running,
) -> None:
    client = triton(digits_server)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert not client.is_model_ready("nothing")
    assert set(client.get_server_metadata()["extensions"]) >= {"binary_tensor_data"}
    metadata = client.get_model_metadata("digits")
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 8, 8]}]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]

    images = np.random.default_rng(0).random((3, 8, 8), dtype=np.float32)
    expected = predicted(digits_server, images.tolist())
    for binary_in in (False, True):
        for binary_out in (False, True):
            tensor = triton_http.InferInput("image", [3, 8, 8], "FP32")
            tensor.set_data_from_numpy(images, binary_data=binary_in)
            output = triton_http.InferRequestedOutput("logits", binary_data=binary_out)
            result = client.infer("digits", [tensor], outputs=[output], request_id="r-1")
            logits = result.as_numpy("logits")
            assert logits.dtype == np.float32
            np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
            assert result.get_response()["id"] == "r-1"
    # No outputs named: tritonclient asks for every output as binary data.
    tensor = triton_http.InferInput("image", [3, 8, 8], "FP32")
    tensor.set_data_from_numpy(images)
    np.testing.assert_allclose(
        client.infer("digits", [tensor]).as_numpy("logits"), expected, rtol=0, atol=1e-5
    )


def test_tritonclient_http_variable_length_int64(textenc_server: Running) -> None:
    client = triton(textenc_server)
    rng = np.random.default_rng(1)
    for length in (3, 17):
        ids = rng.integers(1, 1000, size=(2, length), dtype=np.int64)
        tensor = triton_http.InferInput("token_ids", [2, length], "INT64")
        tensor.set_data_from_numpy(ids, binary_data=length == 17)
        result = client.infer("textenc", [tensor])
        np.testing.assert_allclose(
            result.as_numpy("embedding"), predicted(textenc_server, ids.tolist()), atol=1e-5
        )


def test_tritonclient_classification_answers_labels(digits_server: Running) -> None:
    client = triton(digits_server)
    images = np.random.default_rng(2).random((2, 8, 8), dtype=np.float32)
    tensor = triton_http.InferInput("image", [2, 8, 8], "FP32")
    tensor.set_data_from_numpy(images)
    output = triton_http.InferRequestedOutput("logits", class_count=3)
    labels = client.infer("digits", [tensor], outputs=[output]).as_numpy("logits")
    expected = predicted(digits_server, images.tolist())
    for row, entries in zip(expected, labels, strict=True):
        decoded = [entry.decode() if isinstance(entry, bytes) else entry for entry in entries]
        indices = [int(entry.split(":")[1]) for entry in decoded]
        assert indices == list(np.argsort(-row)[:3])
        assert [entry.split(":")[2] for entry in decoded] == [str(index) for index in indices]


def test_tritonclient_errors_name_what_was_wrong(digits_server: Running) -> None:
    client = triton(digits_server)
    images = np.zeros((1, 8, 8), dtype=np.float64)
    tensor = triton_http.InferInput("image", [1, 8, 8], "FP64")
    tensor.set_data_from_numpy(images)
    with pytest.raises(InferenceServerException, match="has datatype 'FP64'; the model takes FP32"):
        client.infer("digits", [tensor])
    with pytest.raises(InferenceServerException, match="unknown model 'nothing'"):
        client.infer("nothing", [tensor])
    with pytest.raises(InferenceServerException, match="version '1' is not served"):
        client.infer("digits", [tensor], model_version="1")


def v2(path: str = "digits") -> str:
    return f"/v2/models/{path}/infer"


def image_input(values: object, shape: list[int], datatype: str = "FP32") -> dict[str, object]:
    return {"name": "image", "datatype": datatype, "shape": shape, "data": values}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{", 400, "the inference request is not valid JSON"),
        ({"inputs": []}, 400, "'inputs' must be a non-empty list of tensors"),
        (
            {"inputs": [image_input([0.0] * 63, [1, 8, 8])]},
            400,
            "input 'image': shape [1, 8, 8] holds 64 values, the data has 63",
        ),
        (
            {"inputs": [image_input([0.0] * 64, [1, 8, 8], "INT64")]},
            400,
            "input 'image' has datatype 'INT64'; the model takes FP32 (float32)",
        ),
        (
            {"inputs": [image_input([0.0] * 64, [1, 8, 8], "BYTES")]},
            400,
            "input 'image' has datatype BYTES; the model takes FP32 (float32)",
        ),
        (
            {"inputs": [{**image_input([0.0] * 64, [1, 8, 8]), "name": "pixels"}]},
            400,
            "digits takes the inputs ['image']; unknown ['pixels']; missing ['image']",
        ),
        (
            {"inputs": [image_input([0.0] * 64, [1, 64])]},
            400,
            "expected instances of shape (N, 8, 8), got (1, 64)",
        ),
        (
            {"inputs": [image_input([2.0] * 64, [1, 8, 8])]},
            400,
            "values must lie in [0, 1]",
        ),
        (
            {
                "inputs": [image_input([0.0] * 64, [1, 8, 8])],
                "outputs": [{"name": "probabilities"}],
            },
            400,
            "digits has the outputs ['logits']; unknown ['probabilities']",
        ),
        (
            {"inputs": [image_input([0.0] * 64, [1, 8, 8])], "extra": 1},
            400,
            "unknown field(s) ['extra'] in the inference request",
        ),
    ],
)
async def test_each_protocol_error_is_answered_with_its_status_and_words(
    client: httpx.AsyncClient, body: object, status: int, message: str
) -> None:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    response = await client.post(v2(), content=content)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


async def test_binary_data_that_does_not_match_its_header_is_a_400(
    client: httpx.AsyncClient,
) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 8, 8],
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    )
    data = np.zeros(64, dtype="<f4").tobytes()
    ok = await client.post(
        v2(),
        content=header + data,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert ok.status_code == 200, ok.text
    for length, content, message in (
        ("abc", header + data, "is not a length within the body"),
        (str(len(header) + 10_000), header + data, "is not a length within the body"),
        (str(len(header)), header + data[:-4], "binary_data_size 256, but only 252 bytes"),
        (str(len(header)), header + data + b"xx", "2 bytes of binary data follow"),
        (str(len(header) - 1), header + data, "not valid JSON"),
    ):
        response = await client.post(
            v2(), content=content, headers={"Inference-Header-Content-Length": length}
        )
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]


async def test_unknown_model_and_version_are_404_and_an_oversized_body_413(
    digits: FastAPI, client: httpx.AsyncClient
) -> None:
    body = {"inputs": [image_input([0.0] * 64, [1, 8, 8])]}
    assert (await client.post(v2("other"), json=body)).status_code == 404
    assert (await client.post(v2("digits/versions/000000000000"), json=body)).status_code == 404
    version = (await client.get("/v2/models/digits")).json()["versions"][-1]
    assert (await client.post(v2(f"digits/versions/{version}"), json=body)).status_code == 200
    too_large = await client.post(v2(), content=b"x" * (2 << 20))
    assert too_large.status_code == 413
    assert "error" in too_large.json()


async def test_v2_and_predict_requests_share_batches(
    digits: FastAPI, client: httpx.AsyncClient
) -> None:
    """Rows sent by V2 hold 0.25, rows sent to /predict 0.75: some batch holds both."""
    run = engine_of(digits).served.batcher._run  # type: ignore[union-attr]
    batches: list[set[float]] = []
    original = run._run_batch

    def recording(payloads: list[NamedArrays]) -> object:
        batches.append({float(payload["image"].flat[0]) for payload in payloads})
        return original(payloads)

    run._run_batch = recording  # type: ignore[assignment]
    v2_body = {"inputs": [image_input([0.25] * 64, [1, 8, 8])]}
    predict_body = {"instances": [[[0.75] * 8] * 8]}
    answers_ = await asyncio.gather(
        *(client.post(v2(), json=v2_body) for _ in range(8)),
        *(client.post("/predict", json=predict_body) for _ in range(8)),
    )
    assert all(answer.status_code == 200 for answer in answers_)
    assert any(batch == {0.25, 0.75} for batch in batches), batches


@pytest.fixture
async def digits() -> AsyncIterator[FastAPI]:
    app = create_app(Settings(device="cpu", max_wait_ms=50.0, max_body_bytes=1 << 20))
    async with lifespan(app):
        await app.state.loading
        yield app


@pytest.fixture
async def client(digits: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=digits)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def test_binary_bytes_outputs_are_length_prefixed() -> None:
    from service.frontend.oip.rest import binary_of
    from service.frontend.oip.tensors import OutputTensor

    output = OutputTensor("labels", "BYTES", (1, 2), np.array([["a", "bc"]], dtype=object))
    assert binary_of(output) == struct.pack("<I", 1) + b"a" + struct.pack("<I", 2) + b"bc"


def test_tritonclient_grpc_health_metadata_and_digits(digits_server: Running) -> None:
    client = triton_grpc(digits_server)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert not client.is_model_ready("nothing")
    assert "binary_tensor_data" in client.get_server_metadata().extensions
    metadata = client.get_model_metadata("digits", as_json=True)
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": ["-1", "8", "8"]}]
    images = np.random.default_rng(3).random((4, 8, 8), dtype=np.float32)
    tensor = triton_grpc_client.InferInput("image", [4, 8, 8], "FP32")
    tensor.set_data_from_numpy(images)
    result = client.infer("digits", [tensor], request_id="g-1")
    np.testing.assert_allclose(
        result.as_numpy("logits"), predicted(digits_server, images.tolist()), atol=1e-5
    )
    assert result.get_response().id == "g-1"
    labelled = client.infer(
        "digits", [tensor], outputs=[triton_grpc_client.InferRequestedOutput("logits", 2)]
    ).as_numpy("logits")
    assert labelled.shape == (4, 2)


def test_tritonclient_grpc_variable_length_int64(textenc_server: Running) -> None:
    client = triton_grpc(textenc_server)
    ids = np.random.default_rng(4).integers(1, 1000, size=(3, 9), dtype=np.int64)
    tensor = triton_grpc_client.InferInput("token_ids", [3, 9], "INT64")
    tensor.set_data_from_numpy(ids)
    np.testing.assert_allclose(
        client.infer("textenc", [tensor]).as_numpy("embedding"),
        predicted(textenc_server, ids.tolist()),
        atol=1e-5,
    )


def test_grpc_errors_and_deadlines_are_grpc_statuses(textenc_server: Running) -> None:
    client = triton_grpc(textenc_server)
    ids = np.ones((1, 4), dtype=np.int32)
    tensor = triton_grpc_client.InferInput("token_ids", [1, 4], "INT32")
    tensor.set_data_from_numpy(ids)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("textenc", [tensor])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "the model takes INT64" in refused.value.message()
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("nothing", [tensor])
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    # 64 rows of 512 tokens take far longer than 20 ms on this CPU: the call's deadline is the
    # request's, so the batcher answers it as late (or the client gives up first).
    long = np.ones((64, 512), dtype=np.int64)
    tensor = triton_grpc_client.InferInput("token_ids", [64, 512], "INT64")
    tensor.set_data_from_numpy(long)
    with pytest.raises(InferenceServerException) as late:
        client.infer("textenc", [tensor], client_timeout=0.02)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert client.is_server_ready()  # and it still serves


@pytest.mark.parametrize("timeout_us", [0, -5])
def test_a_bad_v2_timeout_is_refused_alike_over_rest_and_grpc(
    digits_server: Running, timeout_us: int
) -> None:
    """Issue 35, item 7: 0 was "a positive number" and -5 "a non-negative integer" over REST,
    and gRPC did not read the parameter at all: one rule and one message for both."""
    message = f"'timeout' must be a whole number of microseconds from 1 up, got {timeout_us}"
    images = np.zeros((1, 8, 8), dtype=np.float32)
    rest = httpx.post(
        digits_server.url + "/v2/models/digits/infer",
        json={
            "inputs": [
                {"name": "image", "datatype": "FP32", "shape": [1, 8, 8], "data": [0.0] * 64}
            ],
            "parameters": {"timeout": timeout_us},
        },
        timeout=30,
    )
    assert rest.status_code == 400, rest.text
    assert rest.json() == {"error": message}
    tensor = triton_grpc_client.InferInput("image", [1, 8, 8], "FP32")
    tensor.set_data_from_numpy(images)
    with pytest.raises(InferenceServerException) as refused:
        triton_grpc(digits_server).infer("digits", [tensor], timeout=timeout_us)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert refused.value.message() == message


def test_the_v2_timeout_shortens_the_deadline_over_grpc_as_over_rest(
    digits_server: Running,
) -> None:
    images = np.zeros((1, 8, 8), dtype=np.float32)
    for module, client in (
        (triton_http, triton(digits_server)),
        (triton_grpc_client, triton_grpc(digits_server)),
    ):
        tensor = module.InferInput("image", [1, 8, 8], "FP32")
        tensor.set_data_from_numpy(images)
        with pytest.raises(InferenceServerException) as late:
            client.infer("digits", [tensor], timeout=1)
        assert "within 1 µs (the request's 'timeout' parameter)" in late.value.message()
        tensor = module.InferInput("image", [1, 8, 8], "FP32")
        tensor.set_data_from_numpy(images)
        assert client.infer("digits", [tensor], timeout=30_000_000).as_numpy("logits").shape == (
            1,
            10,
        )


def test_two_inputs_and_two_outputs_through_rest_and_grpc_equal_predict(
    pairs_server: Running,
) -> None:
    rng = np.random.default_rng(5)
    ids = rng.integers(1, 300, size=(2, 6), dtype=np.int64)
    mask = np.ones_like(ids)
    answer = httpx.post(
        pairs_server.url + "/predict",
        json={"instances": [{"input_ids": row.tolist(), "attention_mask": [1] * 6} for row in ids]},
        timeout=30,
    ).json()["predictions"]
    for module, client in (
        (triton_http, triton(pairs_server)),
        (triton_grpc_client, triton_grpc(pairs_server)),
    ):
        inputs = [module.InferInput("input_ids", [2, 6], "INT64"), module.InferInput(
            "attention_mask", [2, 6], "INT64")]  # fmt: skip
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(mask)
        result = client.infer("sentiment_tensors", inputs)
        for name in ("logits", "embedding"):
            np.testing.assert_allclose(
                result.as_numpy(name), [row[name] for row in answer], atol=1e-5
            )


_DESCRIBE_OURS = """
import json
from service.frontend.oip.proto import grpc_predict_v2_pb2 as ours

def fields(message):
    return {
        "fields": {f.name: [f.number, f.type, f.is_repeated] for f in message.fields},
        "nested": {n.name: fields(n) for n in message.nested_types},
    }

service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
print(json.dumps({
    "package": ours.DESCRIPTOR.package,
    "methods": {m.name: m.input_type.full_name for m in service.methods},
    "messages": {n: fields(m) for n, m in ours.DESCRIPTOR.message_types_by_name.items()},
}))
"""


def test_our_proto_is_the_protocols_as_tritonclient_knows_it() -> None:
    """Every method, message and field we define has the name, number and type of
    tritonclient's (a superset of the V2 protocol's), so its calls reach ours unchanged. Ours
    is described in another process: one process cannot hold both (the same symbols)."""
    from tritonclient.grpc import service_pb2 as theirs

    described = subprocess.run(
        [sys.executable, "-c", _DESCRIBE_OURS], capture_output=True, text=True, check=True
    )
    ours = orjson.loads(described.stdout)
    assert ours["package"] == theirs.DESCRIPTOR.package == "inference"
    their_service = theirs.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method, input_type in ours["methods"].items():
        assert their_service.methods_by_name[method].input_type.full_name == input_type

    def same(message: dict[str, Any], their_message: Any, where: str) -> None:
        for name, (number, kind, repeated) in message["fields"].items():
            their_field = their_message.fields_by_name[name]
            assert [number, kind, repeated] == [
                their_field.number, their_field.type, their_field.is_repeated
            ], f"{where}.{name}"  # fmt: skip
        for name, nested in message["nested"].items():
            same(nested, their_message.nested_types_by_name[name], f"{where}.{name}")

    assert len(ours["messages"]) == 14  # 12 requests and responses, a parameter, contents
    for name, message in ours["messages"].items():
        same(message, theirs.DESCRIPTOR.message_types_by_name[name], name)


def test_a_cancelled_grpc_call_leaves_the_queue_uncomputed(textenc_server: Running) -> None:
    """While one large request holds the device, a second call is cancelled by its client:
    the engine drops it, counted as cancelled, and never computes it."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def request(rows: int, length: int) -> service_pb2.ModelInferRequest:
        call = service_pb2.ModelInferRequest(model_name="textenc")
        call.inputs.add(name="token_ids", datatype="INT64", shape=[rows, length])
        call.raw_input_contents.append(np.ones((rows, length), dtype="<i8").tobytes())
        return call

    before = scraped(
        textenc_server.url, "batchserve_dropped_requests_total", {"reason": "cancelled"}
    )
    with grpc.insecure_channel(textenc_server.grpc) as channel:  # type: ignore[attr-defined]
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        busy = stub.ModelInfer.future(request(32, 512), timeout=60)
        wait_for(
            lambda: scraped(textenc_server.url, "batchserve_in_flight_requests") >= 1,
            "the large request in flight",
            textenc_server,
        )
        # In the large request's bucket: behind all its chunks (``max_batch_ms`` lets another
        # bucket's request run between them).
        cancelled = stub.ModelInfer.future(request(1, 512), timeout=60)
        # Queued behind the large request: in one process a call is queued in the same step of
        # the event loop that counts it in flight, so two in flight means it is in the queue.
        wait_for(
            lambda: scraped(textenc_server.url, "batchserve_in_flight_requests") >= 2,
            "the second call queued",
            textenc_server,
        )
        assert cancelled.cancel()
        busy.result()
    wait_for(
        lambda: (
            scraped(
                textenc_server.url, "batchserve_dropped_requests_total", {"reason": "cancelled"}
            )
            == before + 1
        ),
        "the cancelled call dropped",
        textenc_server,
        timeout_s=10,
    )
