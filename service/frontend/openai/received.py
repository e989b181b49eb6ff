"""What completions and chat completions do first: the body read and validated, and the model
that will answer it found (404 for one that is not served or does not generate, before the
request's settings are checked, as OpenAI answers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import ValidationError
from starlette.types import Receive, Scope

from service.bridge.interface import ModelInfo
from service.frontend.generation.serving import read_request_body, request_priority, text_model_of
from service.frontend.generation.text_model import TextModel
from service.frontend.openai.errors import invalid_request
from service.frontend.openai.schemas import GenerationFields
from service.frontend.requests import Deadline
from service.frontend.routing import routing_of
from service.frontend.state import FrontendState
from service.types import Priority

RequestT = TypeVar("RequestT", bound=GenerationFields)


@dataclass(frozen=True)
class Received(Generic[RequestT]):
    request: RequestT
    model: ModelInfo
    text_model: TextModel
    deadline: Deadline
    priority: Priority


async def received(
    frontend: FrontendState, scope: Scope, receive: Receive, schema: type[RequestT]
) -> Received[RequestT]:
    """The request's body as ``schema``, and the generative model it names."""
    deadline = Deadline.start(frontend.settings)
    priority = request_priority(scope)
    body = await read_request_body(frontend, scope, receive, deadline)
    try:
        request = schema.model_validate_json(body)
    except ValidationError as error:
        raise invalid_request(error) from None
    model = frontend.serving_model(request.model, None, routing_of(scope))
    text_model = await text_model_of(frontend, model)
    request.check_unsupported()
    return Received(request, model, text_model, deadline, priority)
