"""The V2 REST bodies, for the OpenAPI document (requests are parsed from raw bytes in
``rest.py``; these models describe them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Datatype = str


class V2Error(BaseModel):
    error: str = Field(description="What was wrong, in words.")


class V2Tensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    datatype: Datatype = Field(description="BOOL, UINT8, INT8...INT64, FP16, FP32, FP64, BF16.")
    shape: list[int] = Field(description="Batch first; no -1 in a request.")
    parameters: dict[str, Any] | None = Field(
        default=None, description="`binary_data_size`: the tensor is in the binary data."
    )
    data: list[Any] | None = Field(
        default=None, description="Row-major values, flat or nested; absent for binary data."
    )


class V2RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = Field(
        default=None,
        description="`binary_data`: answer it as binary data; `classification`: the top k "
        "labels instead of the tensor.",
    )


class V2InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, description="Echoed in the answer.")
    parameters: dict[str, Any] | None = Field(
        default=None,
        description="`binary_data_output`, `priority` (1: served first), `timeout` (µs).",
    )
    inputs: list[V2Tensor] = Field(min_length=1)
    outputs: list[V2RequestedOutput] | None = None


class V2InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[V2Tensor]


class V2ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class V2TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for the batch and variable sizes.")


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2Readiness(BaseModel):
    ready: bool
    name: str | None = None
    error: str | None = None


class V2Liveness(BaseModel):
    live: bool


class V2RepositoryEntry(BaseModel):
    name: str
    version: str
    state: str
    reason: str


class V2Loaded(BaseModel):
    name: str
    version: str


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": V2Error} for status in statuses}


def inlined_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` put in place: a request body written into
    ``openapi_extra`` cannot refer to definitions the document does not have."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            reference = node.get("$ref", "")
            if reference.startswith("#/$defs/"):
                return inline(definitions[reference.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    inlined: dict[str, Any] = inline(schema)
    return inlined
