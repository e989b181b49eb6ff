"""The request path that OpenAI's ``/v1/embeddings`` (``openai/embeddings.py``) and TEI's
``/embed`` and ``/rerank`` (``tei.py``) share: a JSON body read within the limits every
inference route has (``max_body_bytes``, the request's deadline, ``X-Priority``), validated
by a pydantic model, the model chosen by its handler's kind (an ``EmbeddingHandler`` or a
``RerankHandler``), the handler's inputs built in a handler thread, and the rows computed
by an engine like any ``/predict`` request: the same batcher, the same refusals.

Each route parses its own body and shapes its own answer and errors; what it asks of the
handler is its engine-side contract (``text_inputs``/``id_inputs``, ``pair_inputs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import pydantic
from starlette.types import Receive, Scope

from service.bridge.interface import InferenceResult, ModelInfo
from service.errors import (
    BadRequestError,
    HandlerError,
    ModelNotFoundError,
    UnsupportedMediaTypeError,
    VersionSwitchedError,
)
from service.frontend.bodies import JSON_MEDIA_TYPE
from service.frontend.handlers.base import Handler
from service.frontend.predict import PredictHeaders, handled, read_body
from service.frontend.preprocessing import off_the_loop
from service.frontend.requests import Deadline, HeldRequest
from service.frontend.routing import routing_of
from service.frontend.state import FrontendState
from service.tensors import NamedArrays
from service.types import Priority

HandlerT = TypeVar("HandlerT", bound=Handler)
BodyT = TypeVar("BodyT", bound=pydantic.BaseModel)


@dataclass(frozen=True, slots=True)
class Arrived:
    """A request of these routes once its headers are read: when it must be answered, and
    at which priority."""

    frontend: FrontendState
    scope: Scope
    receive: Receive
    request_id: str
    deadline: Deadline
    headers: PredictHeaders
    priority: Priority

    @classmethod
    def of(
        cls, frontend: FrontendState, scope: Scope, receive: Receive, request_id: str
    ) -> Arrived:
        """Refuses a repeated header (400), an ``X-Priority`` other than ``high`` or
        ``normal`` (422) and a body that is not JSON (415), before the body is read."""
        headers = PredictHeaders.from_scope(scope)
        media_type = (headers.content_type or JSON_MEDIA_TYPE).partition(";")[0].strip()
        if media_type.lower() != JSON_MEDIA_TYPE:
            raise UnsupportedMediaTypeError(
                f"send the body as {JSON_MEDIA_TYPE}, got {headers.content_type[:64]!r}"
                if headers.content_type
                else f"send the body as {JSON_MEDIA_TYPE}"
            )
        deadline = Deadline.start(frontend.settings)
        return cls(
            frontend, scope, receive, request_id, deadline, headers, headers.batch_priority()
        )

    async def body(self, model: type[BodyT]) -> BodyT:
        """The body, read within ``max_body_bytes`` and the deadline, as ``model``: 400 for
        JSON that does not parse; ``pydantic.ValidationError`` for one that does not fit."""
        return model.model_validate(await self.document(), strict=True)

    async def document(self) -> Any:
        """The body, read within ``max_body_bytes`` and the deadline, parsed: 400 for JSON
        that does not parse."""
        body = await read_body(
            self.receive,
            self.headers.content_length,
            self.frontend.settings.max_body_bytes,
            self.deadline.at_s,
        )
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise BadRequestError(f"the body is not valid JSON: {error}") from None

    def model(self, kind: type[HandlerT], what: str, name: str | None) -> ModelInfo:
        """The model ``name`` (the first served whose handler is a ``kind`` when None),
        refused before its body is computed when its engine would refuse any request now
        (429): 404 when it is not served or its handler is not a ``kind`` (``what``: what
        such a model is called)."""
        frontend = self.frontend
        status = frontend.engine.status()
        if not status.ready or status.model is None:
            raise status.refusal()
        kinds = [m.manifest.name for m in status.models if _is(frontend, m, kind)]
        if name is None:
            if not kinds:
                raise ModelNotFoundError(f"this server serves no {what}")
            name = kinds[0]
        routing = routing_of(self.scope)
        model = frontend.admitting_model(name, None, self.priority, self.deadline.at_s, routing)
        if not _is(frontend, model, kind):
            raise ModelNotFoundError(
                f"{name!r} is not {what}; the {what}s served: {kinds or 'none'}"
            )
        return model

    async def computed(
        self, model: ModelInfo, kind: type[HandlerT], prepare: Callable[[HandlerT], NamedArrays]
    ) -> tuple[HandlerT, NamedArrays, InferenceResult]:
        """``prepare``'s inputs (built by the version's handler in a handler thread) computed
        by an engine: the handler, the inputs and the result. A request prepared for a
        version switched away from meanwhile is prepared again, once, for the one served."""
        name = model.manifest.name
        try:
            return await self._computed(model, kind, prepare)
        except VersionSwitchedError:
            again = self.frontend.serving_model(name, None, routing_of(self.scope))
            return await self._computed(again, kind, prepare)

    async def _computed(
        self, model: ModelInfo, kind: type[HandlerT], prepare: Callable[[HandlerT], NamedArrays]
    ) -> tuple[HandlerT, NamedArrays, InferenceResult]:
        frontend = self.frontend
        handler = frontend.handler_for(model)
        if not isinstance(handler, kind):  # switched to a version of another kind
            raise ModelNotFoundError(f"{model.manifest.label} no longer serves this route")
        with HeldRequest(frontend, self.deadline, self.request_id) as held:
            inputs = await off_the_loop(
                frontend.handler_pool, self.deadline.at_s, handled, prepare, handler
            )
            result = await held.infer(model, inputs, self.priority, self.receive)
        return handler, inputs, result


def _is(frontend: FrontendState, model: ModelInfo, kind: type[Handler]) -> bool:
    """Whether ``model``'s handler is a ``kind`` (False for one that cannot be built)."""
    if model.manifest.handler is None:
        return False
    try:
        return isinstance(frontend.handler_for(model), kind)
    except HandlerError:
        return False


def validation_problems(error: pydantic.ValidationError) -> tuple[str, str | None]:
    """What was wrong with a body, in one line, and the field it was wrong in (the first)."""
    problems = error.errors(include_url=False)
    described = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in problems[:5]
    )
    first = problems[0]["loc"] if problems else ()
    return described, str(first[0]) if first else None
