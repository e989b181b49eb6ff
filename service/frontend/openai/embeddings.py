"""OpenAI's ``POST /v1/embeddings``: the ``openai`` SDK (and LangChain's or LlamaIndex's
OpenAI embeddings) work unchanged against an embedding model served here.

The body is OpenAI's: ``input`` (a string, a list of strings, a list of token ids or a list
of lists of token ids; at most ``max_client_batch_size``), ``model`` (a served embedding
model's name; 404 otherwise), ``encoding_format`` (``float``, or ``base64``: each vector's
little-endian float32 bytes, what the SDK asks for by default and decodes), ``dimensions``
(the first that many of each vector, made unit length again when the model's are: as
sentence-transformers' ``truncate_dim`` with ``normalize_embeddings`` for a model that ends
in ``Normalize``; 400 above the model's own), ``user`` (accepted, unused). Texts go through
the version's handler as on ``/predict`` (its default prompt); token ids are taken as given.
An input longer than the model reads is refused (400, ``param`` ``input``), as OpenAI
documents ("the input must not exceed the max input tokens for the model"), never cut.
``usage.prompt_tokens`` counts the tokens the model read. Errors come in OpenAI's shape
(``openai/errors.py``).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, cast

import numpy as np
import pydantic
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from service.errors import InvalidInputError, InvalidParameterError
from service.frontend.handlers.embedding import EmbeddingHandler
from service.frontend.handlers.text import Cut
from service.frontend.inference import DirectRoute, answer_inference
from service.frontend.inference_routes import of_protocol
from service.frontend.openai.errors import ERROR_SCHEMA, invalid_request, openai_error_response
from service.frontend.responses import JSON, json_answer
from service.frontend.retrieval import Arrived
from service.frontend.state import FrontendState
from service.tensors import NamedArrays
from service.types import Array

EMBEDDING_MODEL = "an embedding model"


_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
"""A token id (an index into the model's vocabulary: checked against it when served)."""


def _at_least_one(items: dict[str, Any]) -> dict[str, Any]:
    """The schema of a non-empty list of ``items``: an empty one is refused with its own message
    (``embedding_inputs``), not by the model's validation."""
    return {"type": "array", "items": items, "minItems": 1}


Inputs = (
    str
    | Annotated[list[str], WithJsonSchema(_at_least_one({"type": "string"}))]
    | Annotated[list[int], WithJsonSchema(_at_least_one(_TOKEN_ID))]
    | Annotated[list[list[int]], WithJsonSchema(_at_least_one(_at_least_one(_TOKEN_ID)))]
)
"""Texts or token ids, as OpenAI's ``input`` and TEI's ``inputs`` hold them."""


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request."""

    model_config = ConfigDict(extra="forbid")

    input: Inputs
    """The texts, or their token ids."""
    model: str
    """A served embedding model's name."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    """Keep each vector's first ``dimensions`` (renormalised when the model's are unit)."""
    user: str | None = None
    """Accepted and unused."""


_RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer"},
                    "embedding": {
                        "anyOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string", "description": "little-endian float32, base64"},
                        ]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "properties": {
                "prompt_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            },
        },
    },
}


def shortened(rows: Array, dimensions: int | None, normalize: bool) -> Array:
    """``rows`` (float32, one vector each) cut to their first ``dimensions`` (all when None),
    each then scaled to unit length when ``normalize`` (a zero vector stays zero)."""
    if dimensions is not None:
        rows = rows[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows = rows / np.where(norms == 0, 1, norms)
    return np.ascontiguousarray(rows, dtype=np.float32)


def check_dimensions(dimensions: int | None, own: int, param: str = "dimensions") -> None:
    """400 for more dimensions than the model's ``own``."""
    if dimensions is not None and dimensions > own:
        raise InvalidParameterError(
            param, f"dimensions is {dimensions}, more than this model's {own}; send at most {own}"
        )


def encoded(row: Array, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: numbers, or its little-endian float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()  # type: ignore[no-any-return]


def embedding_inputs(
    handler: EmbeddingHandler,
    given: Inputs,
    prompt_name: str | None,
    deadline_s: float,
    cut: Cut | None,
    *,
    default_prompt: bool = True,
) -> NamedArrays:
    """The model's inputs for a text, texts, a row of token ids or rows of them (not empty),
    cut as ``cut`` says (None: as the version truncates)."""
    if isinstance(given, str):
        given = [given]
    if all(isinstance(item, str) for item in given):
        texts = cast(list[str], given)
        return handler.text_inputs(
            texts, prompt_name, deadline_s, cut=cut, default_prompt=default_prompt
        )
    if all(isinstance(item, int) for item in given):
        return handler.id_inputs([cast(list[int], given)], cut)
    return handler.id_inputs(cast(list[list[int]], given), cut)


async def embeddings(request: Request) -> Response:
    """One embedding per input, as OpenAI's ``/v1/embeddings`` answers (errors in its shape)."""

    async def serve(frontend: FrontendState, request_id: str) -> Response:
        return await _embeddings(Arrived.of(frontend, request.scope, request.receive, request_id))

    return await answer_inference(request, serve, openai_error_response)


async def _embeddings(arrived: Arrived) -> Response:
    document = await arrived.document()
    named = document.get("model") if isinstance(document, dict) else None
    # A model that is not served, or does not embed, is 404 before all else (as OpenAI).
    model = (
        arrived.model(EmbeddingHandler, EMBEDDING_MODEL, named) if isinstance(named, str) else None
    )
    try:
        body = EmbeddingsRequest.model_validate(document, strict=True)
    except pydantic.ValidationError as error:
        raise invalid_request(error) from None
    if isinstance(body.input, list) and not body.input:
        raise InvalidParameterError("input", "input is empty; send at least one text")
    if model is None:
        model = arrived.model(EmbeddingHandler, EMBEDDING_MODEL, body.model)
    check_dimensions(body.dimensions, model.manifest.output.shape[-1])

    def prepare(handler: EmbeddingHandler) -> NamedArrays:
        # OpenAI refuses an input longer than the model reads (400), it never cuts one.
        try:
            return embedding_inputs(handler, body.input, None, arrived.deadline.at_s, "none")
        except InvalidInputError as error:
            raise InvalidParameterError("input", error.message) from None

    handler, inputs, result = await arrived.computed(model, EmbeddingHandler, prepare)
    rows: Array = np.asarray(result.outputs[handler.output], dtype=np.float32)
    rows = shortened(rows, body.dimensions, handler.normalized and body.dimensions is not None)
    tokens = sum(handler.token_counts(inputs))
    name = model.manifest.name
    return json_answer(
        {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": index,
                    "embedding": encoded(row, body.encoding_format),
                }
                for index, row in enumerate(rows)
            ],
            "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        (b"x-model-version", f"{name}@{result.version}".encode("latin-1")),
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": "OpenAI's error shape", "content": {JSON: {"schema": ERROR_SCHEMA}}}
    for status in (400, 404, 408, 413, 415, 429, 500, 503, 504)
}


def add_embeddings_routes(router: APIRouter) -> None:
    """Register ``/v1/embeddings`` (``inference_routes``) with ``router``: the app's own."""
    for route in of_protocol("openai"):
        router.add_api_route(
            route.path,
            embeddings,
            methods=["POST"],
            summary=route.summary,
            route_class_override=DirectRoute,
            responses={
                200: {
                    "description": "One embedding per input.",
                    "content": {JSON: {"schema": _RESPONSE_SCHEMA}},
                },
                **_ERRORS,
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": EmbeddingsRequest.model_json_schema()}},
                }
            },
        )
