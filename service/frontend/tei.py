"""Hugging Face Text Embeddings Inference's ``POST /embed`` and ``POST /rerank``: TEI's
clients (LangChain's ``HuggingFaceEndpointEmbeddings``, LlamaIndex's TEI embeddings, plain
HTTP) work unchanged against models served here.

TEI serves one model; batchserve may serve several, so ``/embed`` answers with the first
embedding model served and ``/rerank`` with the first reranker, and ``/models/{name}/embed``
and ``/models/{name}/rerank`` name one (404 when it is not served or not of that kind).

``/embed``: ``inputs`` (a text, a list of texts, token ids or a list of them; at most
``max_client_batch_size``), ``normalize`` (true: each vector made unit length, as TEI does;
false: the model's own rows, as ``SentenceTransformer.encode`` gives them), ``prompt_name``
(a prompt of the version put before each text; without one, none: TEI never applies the
folder's ``default_prompt_name``), ``dimensions`` (the first that many, before normalizing).
The answer: one vector per input.

``/rerank``: ``query``, ``texts``, ``raw_scores`` (the logits rather than the folder's
activation), ``return_text``; no prompt (TEI puts none before a pair). The answer: one
``{index, score}`` (and ``text``) per text, highest score first.

Both take ``truncate`` and ``truncation_direction`` as TEI does: an input longer than the
model's length is cut when ``truncate`` is true (from the ``Right``, its first tokens kept,
or the ``Left``), refused with 422 when it is false, and cut as the version says (option
``truncate``, true unless packaged otherwise: TEI's ``--auto-truncate``) when it is absent.

Errors come as TEI sends them, ``{"error": message, "error_type": kind}`` with TEI's names
(``Empty``, ``Validation``, ``Overloaded``, ``Unhealthy``, ``Backend``): 400 ``Empty`` for no
input, 413 for too many inputs, 422 for an invalid body or an input too long not to cut, 429
overloaded, 503 unhealthy, and the service's own statuses otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import numpy as np
import pydantic
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from service.errors import BadRequestError, InvalidInputError, ServiceError
from service.frontend.handlers.embedding import EmbeddingHandler
from service.frontend.handlers.reranking import RerankHandler
from service.frontend.handlers.text import Cut, TextHandler
from service.frontend.inference import DirectRoute, Serve, answer_inference
from service.frontend.inference_routes import (
    MODEL_EMBED_PATH,
    MODEL_RERANK_PATH,
    TEI_EMBED_PATH,
    TEI_RERANK_PATH,
    of_protocol,
)
from service.frontend.openai.embeddings import Inputs, embedding_inputs, shortened
from service.frontend.responses import JSON, json_answer, json_response
from service.frontend.retrieval import Arrived, BodyT, validation_problems
from service.frontend.state import FrontendState
from service.tensors import NamedArrays
from service.types import Array


def _capitalised(value: object) -> object:
    """TEI's spelling of a direction given in lower case (TEI takes either)."""
    if isinstance(value, str) and value in ("right", "left"):
        return value.capitalize()
    return value


Direction = Annotated[Literal["Right", "Left"], BeforeValidator(_capitalised)]
"""The end a long input is cut from: ``Right`` keeps its first tokens, ``Left`` its last. The
schema names TEI's spelling only (two enum values differing in case break generated clients);
``right`` and ``left`` are taken too, as TEI takes them."""


class EmbedRequest(BaseModel):
    """TEI's ``/embed`` body."""

    model_config = ConfigDict(extra="forbid")

    inputs: Inputs
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, ge=1)


class RerankRequest(BaseModel):
    """TEI's ``/rerank`` body."""

    model_config = ConfigDict(extra="forbid")

    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class EmptyInputsError(BadRequestError):
    """No input to embed or rank: TEI answers 400 with the error type ``Empty``."""

    code = "empty_inputs"


def error_type(error: ServiceError) -> str:
    """TEI's ``error_type`` for ``error``, as TEI writes it (its enum's variant names)."""
    if isinstance(error, EmptyInputsError):
        return "Empty"
    status_code = error.status_code
    if status_code == 429:
        return "Overloaded"
    if status_code == 503:
        return "Unhealthy"
    if status_code >= 500:
        return "Backend"
    return "Validation"


def tei_error_response(error: ServiceError, request_id: str) -> Response:
    """``error`` as TEI answers one, with its status and headers."""
    headers = dict(error.headers)
    if error.closes_connection:
        headers["Connection"] = "close"
    content = {"error": error.message, "error_type": error_type(error)}
    return json_response(content, status_code=error.status_code, headers=headers)


Respond = Callable[[Arrived, str | None], Awaitable[Response]]


def _answered(request: Request, respond: Respond, name: str | None) -> Serve:
    async def serve(frontend: FrontendState, request_id: str) -> Response:
        arrived = Arrived.of(frontend, request.scope, request.receive, request_id)
        return await respond(arrived, name)

    return serve


async def embed(request: Request, name: str | None = None) -> Response:
    """One vector per input, as TEI's ``/embed`` answers (errors in its shape)."""
    return await answer_inference(request, _answered(request, _embed, name), tei_error_response)


async def rerank(request: Request, name: str | None = None) -> Response:
    """Each text's score against the query, highest first, as TEI's ``/rerank`` answers."""
    return await answer_inference(request, _answered(request, _rerank, name), tei_error_response)


async def _read(arrived: Arrived, model: type[BodyT]) -> BodyT:
    """The body as ``model``; 422 naming what does not fit it."""
    try:
        return await arrived.body(model)
    except pydantic.ValidationError as error:
        raise InvalidInputError(validation_problems(error)[0]) from None


def cut(handler: TextHandler, truncate: bool | None, direction: Direction) -> Cut | None:
    """How TEI's ``truncate`` and ``truncation_direction`` cut a long input of ``handler``'s
    version: None where that is the version's own way."""
    if truncate is False:
        return "none"
    if truncate is None and (not handler.truncate or direction.lower() == "right"):
        return None
    return "left" if direction.lower() == "left" else "right"


async def _embed(arrived: Arrived, name: str | None) -> Response:
    model = arrived.model(EmbeddingHandler, "an embedding model", name)
    body = await _read(arrived, EmbedRequest)
    given = body.inputs
    if isinstance(given, list) and not given:
        raise EmptyInputsError("inputs is empty; send at least one text")
    if body.prompt_name is not None and not _texts(given):
        raise InvalidInputError("prompt_name goes before texts: send texts, not token ids")
    own = model.manifest.output.shape[-1]
    if body.dimensions is not None and body.dimensions > own:
        raise InvalidInputError(
            f"dimensions is {body.dimensions}, more than this model's {own}; send at most {own}"
        )

    def prepare(handler: EmbeddingHandler) -> NamedArrays:
        how = cut(handler, body.truncate, body.truncation_direction)
        return embedding_inputs(
            handler, given, body.prompt_name, arrived.deadline.at_s, how, default_prompt=False
        )

    handler, _, result = await arrived.computed(model, EmbeddingHandler, prepare)
    rows: Array = np.asarray(result.outputs[handler.output], dtype=np.float32)
    rows = shortened(rows, body.dimensions, body.normalize)
    return json_answer(rows, _version_header(model.manifest.name, result.version))


async def _rerank(arrived: Arrived, name: str | None) -> Response:
    model = arrived.model(RerankHandler, "a reranker", name)
    body = await _read(arrived, RerankRequest)
    if not body.texts:
        raise EmptyInputsError("texts is empty; send at least one text")

    def prepare(handler: RerankHandler) -> NamedArrays:
        how = cut(handler, body.truncate, body.truncation_direction)
        deadline_s = arrived.deadline.at_s
        return handler.pair_inputs(
            body.query, body.texts, None, deadline_s, cut=how, default_prompt=False
        )

    handler, _, result = await arrived.computed(model, RerankHandler, prepare)
    scores = handler.pair_scores(result.outputs[handler.output], body.raw_scores)
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    ranks: list[dict[str, Any]] = [{"index": index, "score": scores[index]} for index in order]
    if body.return_text:
        for rank in ranks:
            rank["text"] = body.texts[rank["index"]]
    return json_answer(ranks, _version_header(model.manifest.name, result.version))


def _texts(given: Inputs) -> bool:
    """Whether ``inputs`` holds texts rather than token ids."""
    return isinstance(given, str) or all(isinstance(item, str) for item in given)


def _version_header(name: str, version: str) -> tuple[bytes, bytes]:
    return (b"x-model-version", f"{name}@{version}".encode("latin-1"))


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": "TEI's error shape", "content": {JSON: {"schema": _ERROR_SCHEMA}}}
    for status in (400, 404, 408, 413, 415, 422, 429, 500, 503, 504)
}
_EMBED_ANSWER = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
_RERANK_ANSWER = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["index", "score"],
        "properties": {
            "index": {"type": "integer"},
            "score": {"type": "number"},
            "text": {"type": "string"},
        },
    },
}


def add_tei_routes(router: APIRouter) -> None:
    """Register ``/embed``, ``/rerank`` and their ``/models/{name}/...`` routes
    (``inference_routes``) with ``router``: the app's own."""
    routes = (
        (TEI_EMBED_PATH, embed, EmbedRequest, _EMBED_ANSWER, "One vector per input."),
        (MODEL_EMBED_PATH, embed, EmbedRequest, _EMBED_ANSWER, "One vector per input."),
        (TEI_RERANK_PATH, rerank, RerankRequest, _RERANK_ANSWER, "Ranks, best first."),
        (MODEL_RERANK_PATH, rerank, RerankRequest, _RERANK_ANSWER, "Ranks, best first."),
    )
    summaries = {route.path: route.summary for route in of_protocol("tei")}
    for path, endpoint, request_model, answer, description in routes:
        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            summary=summaries[path],
            route_class_override=DirectRoute,
            responses={
                200: {"description": description, "content": {JSON: {"schema": answer}}},
                **_ERRORS,
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": request_model.model_json_schema()}},
                }
            },
        )
