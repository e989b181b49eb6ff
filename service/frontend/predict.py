"""``POST /predict``: read the body, validate it, queue it on an engine, answer its rows.

``serve_prediction`` answers ``/predict`` and the model routes (``routes.py`` registers them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar
from urllib.parse import parse_qsl

from starlette.responses import Response
from starlette.types import Receive, Scope

from service.bridge.interface import ModelInfo
from service.errors import (
    BadRequestError,
    HandlerError,
    InvalidInputError,
    NotAcceptableError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServiceError,
    VersionSwitchedError,
)
from service.frontend import per_token, request_spans
from service.frontend.bodies import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    NPZ_MEDIA_TYPE,
    answer_media_type,
    body_media_type,
    encode_npy,
    encode_npz,
)
from service.frontend.handlers.base import Handler, HandlerRequest
from service.frontend.preprocessing import cheap_to_parse, off_the_loop
from service.frontend.requests import ClientDisconnectedError, Deadline, HeldRequest
from service.frontend.responses import json_answer
from service.frontend.routing import Routing
from service.frontend.state import FrontendState
from service.tensors import NamedArrays
from service.types import PRIORITIES, Priority

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PredictHeaders:
    """The request headers ``/predict`` reads, found in one pass over the raw list."""

    content_type: str | None = None
    accept: str | None = None
    content_length: str | None = None
    priority: str | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> PredictHeaders:
        """Refuses (400) a header that must appear once but appears again: which copy would
        win is a guess, and a proxy may have read the other one."""
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name not in _PREDICT_HEADERS:
                continue
            text = value.decode("latin-1")
            if name not in found:
                found[name] = text
            elif name == b"accept":  # a list: repeated, it is one longer list
                found[name] += ", " + text
            else:
                raise BadRequestError(f"the {name.decode()} header is repeated; send it once")
        return cls(
            found.get(b"content-type"),
            found.get(b"accept"),
            found.get(b"content-length"),
            found.get(b"x-priority"),
        )

    def batch_priority(self) -> Priority:
        """``X-Priority: high`` is served before normal traffic when both wait."""
        if self.priority is None:
            return "normal"
        priority = self.priority.strip().lower()
        if priority not in PRIORITIES:
            raise InvalidInputError(
                f"X-Priority must be 'high' or 'normal', got {self.priority[:32]!r}"
            )
        return priority


_PREDICT_HEADERS = frozenset(
    {b"content-type", b"accept", b"content-length", b"x-priority", b"x-request-id"}
)


#: What a 413 for a body too large says of the limit: which setting sets it.
_BODY_LIMIT = (
    "at most {:,} bytes are accepted (the server's max_body_bytes, set by "
    "BATCHSERVE_MAX_BODY_BYTES or --max-body-bytes)"
)


async def read_body(
    receive: Receive, declared_length: str | None, max_bytes: int, deadline_s: float
) -> bytes:
    """The request body, refusing more than ``max_bytes`` before reading it whole, and a body
    still arriving at ``deadline_s`` (``time.monotonic()``): a slow client holds a connection
    no longer than any request may take."""
    if declared_length is not None:
        if not declared_length.isdigit():
            raise BadRequestError(f"invalid Content-Length {declared_length[:32]!r}")
        if int(declared_length) > max_bytes:
            raise PayloadTooLargeError(
                f"the body is {int(declared_length):,} bytes; {_BODY_LIMIT.format(max_bytes)}"
            )
    chunks: list[bytes] = []
    received = 0
    more_body = True
    try:
        with CutAt(deadline_s):
            while more_body:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnectedError
                chunk: bytes = message.get("body", b"")
                received += len(chunk)
                if received > max_bytes:
                    raise PayloadTooLargeError(
                        f"the body is over {max_bytes:,} bytes; {_BODY_LIMIT.format(max_bytes)}"
                    )
                chunks.append(chunk)
                more_body = message.get("more_body", False)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the body was not received within the request's deadline ({received} bytes came)"
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class CutAt:
    """``asyncio.timeout_at`` for ``deadline_s`` (``time.monotonic()``), as a plain context
    manager: the task is cancelled at the deadline, and that cancellation comes out of the
    block as ``TimeoutError``; any other goes on. Every request reads its body under one,
    and ``asyncio.timeout``'s asynchronous entry and exit cost several times the timer."""

    __slots__ = ("_cancelling", "_cut", "_task", "_timer")

    def __init__(self, deadline_s: float) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._task = task
        self._cut = False
        self._cancelling = task.cancelling()
        self._timer = loop.call_at(loop.time() + deadline_s - time.monotonic(), self._cut_now)

    def _cut_now(self) -> None:
        self._cut = True
        self._task.cancel()

    def __enter__(self) -> CutAt:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> None:
        self._timer.cancel()
        if (
            self._cut
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from error


async def serve_prediction(
    frontend: FrontendState,
    headers: PredictHeaders,
    receive: Receive,
    request_id: str,
    query_string: bytes = b"",
    model_name: str | None = None,
    model_version: str | None = None,
    routing: Routing | None = None,
) -> Response:
    """Validate the body, queue its instances for the next batch, answer one row each.

    ``model_name`` (the first model served when None) at ``model_version`` (when None: the
    one its traffic split gives ``routing``, else its primary) answers it.

    The request is validated against the version served once its body has arrived, so a
    version switched while a slow body was uploading costs nothing; the answer names the
    version that computed it. A version's handler (or a large tensor body) turns the body
    into tensors in the handler threads, waited for until the deadline at most (504); a small
    tensor body is parsed on the event loop, and the output rows become the answer there.
    """
    deadline = Deadline.start(frontend.settings)
    # Refused at once, before reading a body nobody can serve.
    first_model = frontend.admitting_model(
        model_name, model_version, headers.batch_priority(), deadline.at_s, routing
    )
    media_type = body_media_type(
        headers.content_type, frontend.handler_for(first_model).media_types
    )
    body = await read_body(
        receive, headers.content_length, frontend.settings.max_body_bytes, deadline.at_s
    )
    request_spans.event("body_read", {"bytes": len(body)})
    answer = partial(
        _serve_body,
        frontend,
        headers,
        receive,
        request_id,
        query_string,
        body,
        deadline,
        (first_model, media_type),
        routing,
    )
    try:
        return await answer(model_name, model_version)
    except VersionSwitchedError:
        # Prepared for a version switched away from meanwhile: prepared again, once, for the
        # version served now (which would have tokenized or answered it otherwise).
        return await answer(model_name, model_version)


async def _serve_body(
    frontend: FrontendState,
    headers: PredictHeaders,
    receive: Receive,
    request_id: str,
    query_string: bytes,
    body: bytes,
    deadline: Deadline,
    checked: tuple[ModelInfo, str],
    routing: Routing | None,
    model_name: str | None,
    model_version: str | None,
) -> Response:
    """``serve_prediction`` once the body has arrived: prepare it for the version served
    now, queue it, answer it. ``checked``: the model the body's media type was checked
    against before it arrived, and that media type."""
    first_model, media_type = checked
    with HeldRequest(frontend, deadline, request_id) as held:
        model = frontend.serving_model(model_name, model_version, routing)
        handler = frontend.handler_for(model)
        if model is not first_model:  # switched while the body arrived: its handler decides
            media_type = body_media_type(headers.content_type, handler.media_types)
        query = _query(query_string, handler)
        answer_type = _answer_type(headers.accept, model, handler)
        inline = type(handler) is Handler and cheap_to_parse(body)
        # The base handler's small body needs no request object (its preprocess reads the
        # body and media type only); a handler's own steps, or a thread, get one.
        handler_request = (
            None if inline else _handler_request(body, media_type, headers, query, deadline.at_s)
        )
        with request_spans.child("parse"):
            if handler_request is None:
                instances = handled(handler.context.layout.parse, body, media_type)
            else:
                instances = await off_the_loop(
                    frontend.handler_pool,
                    deadline.at_s,
                    handled,
                    handler.preprocess,
                    handler_request,
                )
        result = await held.infer(model, instances, headers.batch_priority(), receive)
    name, version = model.manifest.name, result.version
    response_headers = {"X-Model-Version": f"{name}@{version}"}
    if answer_type == NPY_MEDIA_TYPE:
        only = result.outputs[result.outputs.names[0]]
        return Response(encode_npy(only), media_type=NPY_MEDIA_TYPE, headers=response_headers)
    if answer_type == NPZ_MEDIA_TYPE:
        return Response(
            encode_npz(result.outputs), media_type=NPZ_MEDIA_TYPE, headers=response_headers
        )
    result = per_token.at_own_lengths(result, instances, model.manifest)
    outputs = result.outputs
    if type(handler) is Handler and type(outputs) is NamedArrays and len(outputs.names) == 1:
        # On the event loop, the whole array at once: orjson writes it far faster than a list
        # of rows.
        predictions: object = outputs[outputs.names[0]]
    else:  # softmax and top-k of a few rows cost less than a thread hop
        if handler_request is None:
            handler_request = _handler_request(body, media_type, headers, query, deadline.at_s)
        predictions = handled(handler.postprocess, outputs, handler_request)
    return json_answer(
        {"model": name, "version": version, "predictions": predictions},
        (b"x-model-version", response_headers["X-Model-Version"].encode("latin-1")),
    )


def _query(query_string: bytes, handler: Handler) -> dict[str, str]:
    """The query parameters, each one the handler reads; any other is a mistake (422)."""
    if not query_string:
        return {}
    query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
    unknown = sorted(set(query) - handler.query_parameters)
    if unknown:
        accepted = sorted(handler.query_parameters) or "none"
        raise InvalidInputError(
            f"unknown query parameter(s) {unknown}; this model reads {accepted}"
        )
    return query


def _answer_type(accept: str | None, model: ModelInfo, handler: Handler) -> str:
    """JSON, or the tensors as ``.npy`` (one output) or ``.npz`` when ``Accept`` prefers them
    and the version has no handler of its own (a handler answers JSON)."""
    answer = answer_media_type(accept)
    if answer == JSON_MEDIA_TYPE or model.manifest.handler is not None:
        return JSON_MEDIA_TYPE
    outputs = [spec.name for spec in model.manifest.outputs]
    if answer == NPY_MEDIA_TYPE and len(outputs) > 1:
        raise NotAcceptableError(
            f"this model has {len(outputs)} outputs {outputs}: ask for {NPZ_MEDIA_TYPE} (one "
            f"array per output) or {JSON_MEDIA_TYPE}"
        )
    return answer


def _handler_request(
    body: bytes, media_type: str, headers: PredictHeaders, query: dict[str, str], deadline_s: float
) -> HandlerRequest:
    return HandlerRequest(
        body=body,
        media_type=media_type,
        content_type=headers.content_type or JSON_MEDIA_TYPE,
        query=query,
        deadline_s=deadline_s,
    )


def handled(step: Callable[..., T], *args: object) -> T:
    """The handler's result; what it raises other than a ``ServiceError`` (a client's
    mistake) is logged and answered 500, for this request alone."""
    try:
        return step(*args)
    except ServiceError:
        raise
    except Exception as error:
        logger.error("handler_failed", exc_info=error)
        raise HandlerError(
            f"the model's handler failed on this request ({type(error).__name__}: {error})"
        ) from error
