"""``POST /v2/models/{name}[/versions/{version}]/infer``: the V2 REST inference request.

JSON as the protocol defines it (``id`` echoed, ``parameters``, ``outputs`` selection, nested
or flat row-major ``data``), and the binary tensor extension: a body whose first
``Inference-Header-Content-Length`` bytes are the JSON header and whose rest holds each input
with a ``binary_data_size``, in order; outputs asked with ``binary_data`` (or all, with
``binary_data_output``) come back the same way. It is queued on the same engine as
``/predict``, so both share batches.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response
from starlette.types import Receive

from service.bridge.interface import InferenceResult, ModelInfo
from service.errors import (
    BadRequestError,
    InvalidInputError,
    ServiceError,
)
from service.frontend import request_spans
from service.frontend.oip.datatypes import to_bf16, wire_dtype
from service.frontend.oip.parameters import (
    TIMEOUT_PARAMETER,
    batch_priority,
    flag,
    timeout_s,
)
from service.frontend.oip.tensors import (
    InferInput,
    InferOptions,
    OutputTensor,
    RequestedOutput,
    answer_outputs,
    check_requested_outputs,
    to_request,
)
from service.frontend.predict import read_body
from service.frontend.requests import Deadline, HeldRequest
from service.frontend.responses import json_response
from service.frontend.routing import Routing
from service.frontend.state import FrontendState
from service.types import Priority

HEADER_LENGTH = "inference-header-content-length"
JSON = "application/json"
BINARY = "application/octet-stream"


def error_response(error: ServiceError) -> Response:
    """The protocol's error body, ``{"error": "..."}``; invalid input is its 400."""
    status = 400 if isinstance(error, InvalidInputError) else error.status_code
    return json_response({"error": error.message}, status, error.headers)


async def serve_v2_inference(
    frontend: FrontendState,
    headers: dict[str, str],
    receive: Receive,
    request_id: str,
    name: str,
    version: str | None,
    routing: Routing | None = None,
) -> Response:
    """Validate, queue on the engine, and answer one V2 inference request (when it names no
    version, with the version its model's traffic split gives ``routing``)."""
    deadline = Deadline.start(frontend.settings)
    frontend.admitting_model(name, version, routing=routing)
    body = await read_body(
        receive, headers.get("content-length"), frontend.settings.max_body_bytes, deadline.at_s
    )
    request_spans.event("body_read", {"bytes": len(body)})
    model = frontend.serving_model(name, version, routing)
    with request_spans.child("parse"):
        document, binary = split_body(body, headers.get(HEADER_LENGTH))
        inputs, options, request_key = parse_request(document, binary)
    result, answered = await run_inference(
        frontend,
        model,
        inputs,
        options,
        deadline=deadline.sooner(timeout_s(options.parameters), TIMEOUT_PARAMETER),
        priority=batch_priority(options.parameters, headers.get("x-priority")),
        request_id=request_id,
        receive=receive,
    )
    return encode_response(
        {
            "model_name": model.manifest.name,
            "model_version": result.version,
            **({"id": request_key} if request_key is not None else {}),
        },
        answered,
        {"X-Model-Version": f"{model.manifest.name}@{result.version}"},
    )


async def run_inference(
    frontend: FrontendState,
    model: ModelInfo,
    inputs: list[InferInput],
    options: InferOptions,
    *,
    deadline: Deadline,
    priority: Priority,
    request_id: str,
    receive: Receive | None = None,
) -> tuple[InferenceResult, list[OutputTensor]]:
    """Validate a V2 request's tensors against ``model``, queue them on the engine (REST and
    gRPC alike), and the outputs to answer. ``receive``: the HTTP request's, to stop waiting
    when its client leaves."""
    check_requested_outputs(model.manifest, options.outputs)
    layout = frontend.layout_for(model)
    with HeldRequest(frontend, deadline, request_id) as held:
        with request_spans.child("to_tensors"):
            instances = to_request(model.manifest, layout, inputs)
        deadline.check("it was being parsed")  # 504, not a refusal for "-3 ms left"
        result = await held.infer(model, instances, priority, receive)
    return result, answer_outputs(model.manifest, result.outputs, options)


def split_body(body: bytes, header_length: str | None) -> tuple[Any, bytes]:
    """The JSON document and the binary data after it."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        # isdigit alone takes "²", which int() refuses.
        length = int(header_length) if header_length.isascii() and header_length.isdigit() else -1
        if not 0 <= length <= len(body):
            raise BadRequestError(
                f"Inference-Header-Content-Length {header_length[:32]!r} is not a length "
                f"within the body's {len(body)} bytes"
            )
        json_part, binary = body[:length], body[length:]
    try:
        return orjson.loads(json_part), binary
    except orjson.JSONDecodeError as error:
        raise BadRequestError(f"the inference request is not valid JSON: {error}") from None


def parse_request(
    document: Any, binary: bytes
) -> tuple[list[InferInput], InferOptions, str | None]:
    """The inputs, the options and the ``id`` of a V2 JSON request (with its binary data)."""
    if not isinstance(document, dict):
        raise BadRequestError("the inference request must be a JSON object")
    unknown = sorted(set(document) - {"id", "parameters", "inputs", "outputs"})
    if unknown:
        raise BadRequestError(f"unknown field(s) {unknown} in the inference request")
    request_key = document.get("id")
    if request_key is not None and not isinstance(request_key, str):
        raise BadRequestError("'id' must be a string")
    parameters = _parameters(document.get("parameters"), "the request")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequestError("'inputs' must be a non-empty list of tensors")
    inputs = []
    offset = 0
    for index, entry in enumerate(raw_inputs):
        tensor, size = _input(entry, index)
        if size is not None:
            if offset + size > len(binary):
                raise BadRequestError(
                    f"input {tensor.name!r} declares binary_data_size {size}, but only "
                    f"{len(binary) - offset} bytes of binary data are left"
                )
            tensor = InferInput(
                tensor.name, tensor.datatype, tensor.shape, raw=binary[offset : offset + size]
            )
            offset += size
        inputs.append(tensor)
    if offset != len(binary):
        raise BadRequestError(
            f"{len(binary) - offset} bytes of binary data follow the inputs' declared sizes"
        )
    binary_outputs = flag(parameters, "binary_data_output", "the request")
    outputs = tuple(_output(entry, binary_outputs) for entry in document.get("outputs") or [])
    return inputs, InferOptions(outputs, binary_outputs, parameters), request_key


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequestError(f"'parameters' of {where} must be an object")
    return value


def _input(entry: Any, index: int) -> tuple[InferInput, int | None]:
    if not isinstance(entry, dict):
        raise BadRequestError(f"input {index} must be an object")
    name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise BadRequestError(f"input {index} needs a 'name' and a 'datatype' (strings)")
    if not isinstance(shape, list) or not all(
        isinstance(size, int) and not isinstance(size, bool) for size in shape
    ):
        raise BadRequestError(f"input {name!r}: 'shape' must be a list of integers")
    parameters = _parameters(entry.get("parameters"), f"input {name!r}")
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadRequestError(f"input {name!r}: binary_data_size must be a byte count")
        if "data" in entry:
            raise BadRequestError(f"input {name!r} has both 'data' and binary_data_size")
        return InferInput(name, datatype, tuple(shape)), size
    if "data" not in entry:
        raise BadRequestError(f"input {name!r} has neither 'data' nor binary_data_size")
    return InferInput(name, datatype, tuple(shape), data=entry["data"]), None


def _output(entry: Any, binary_outputs: bool) -> RequestedOutput:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise BadRequestError("each requested output must be an object with a 'name'")
    parameters = _parameters(entry.get("parameters"), f"output {entry['name']!r}")
    classification = parameters.get("classification", 0)
    if not isinstance(classification, int) or isinstance(classification, bool):
        raise BadRequestError(f"output {entry['name']!r}: classification must be an integer")
    binary = flag(parameters, "binary_data", f"output {entry['name']!r}", binary_outputs)
    return RequestedOutput(entry["name"], binary, classification)


def encode_response(
    head: dict[str, Any], outputs: list[OutputTensor], headers: dict[str, str]
) -> Response:
    """JSON, or the JSON header then the binary outputs (binary tensor extension)."""
    entries = []
    chunks = []
    for output in outputs:
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if output.binary:
            data = binary_of(output)
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = json_data(output)
        entries.append(entry)
    document = orjson.dumps({**head, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return Response(document, media_type=JSON, headers=headers)
    headers = {**headers, "Inference-Header-Content-Length": str(len(document))}
    return Response(b"".join([document, *chunks]), media_type=BINARY, headers=headers)


def json_data(output: OutputTensor) -> Any:
    """Flat row-major values (strings for BYTES)."""
    if output.datatype == "BYTES":
        return [str(value) for value in output.array.reshape(-1)]
    return output.array.reshape(-1)


def binary_of(output: OutputTensor) -> bytes:
    """The output's bytes as the binary extension lays them out (little-endian; BYTES as
    4-byte lengths and UTF-8)."""
    if output.datatype == "BYTES":
        parts = []
        for value in output.array.reshape(-1):
            encoded = str(value).encode()
            parts.append(struct.pack("<I", len(encoded)) + encoded)
        return b"".join(parts)
    if output.datatype == "BF16":
        return to_bf16(output.array).tobytes()
    return np.ascontiguousarray(output.array, dtype=wire_dtype(output.datatype)).tobytes()
