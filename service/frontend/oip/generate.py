"""The Open Inference Protocol's generate extension, as Triton serves it:
``POST /v2/models/{name}[/versions/{version}]/generate`` and ``.../generate_stream``.

A request is ``{"text_input": "...", "parameters": {...}}``; the parameters are the sampling
settings every generation route takes (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``frequency_penalty``,
``presence_penalty``, ``repetition_penalty``), and ``exclude_input_in_output``
(default true here: the answer holds the generated text only; false puts the prompt before
it: the parameter of Triton's vLLM backend). ``generate`` answers
``{"model_name", "model_version", "text_output", "finish_reason"}``; ``generate_stream``
sends one server-sent event of that shape per piece of text, ``text_output`` holding the new
text, the last with its ``finish_reason``. Errors are the protocol's ``{"error": "..."}``,
also as an event after the stream began.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from service.errors import InvalidParameterError, ServiceError
from service.frontend.generation.choices import StartedChoice, merged
from service.frontend.generation.sampling import SamplingSettings
from service.frontend.generation.serving import (
    Generation,
    collect,
    counted_while_streaming,
    read_request_body,
    request_priority,
    text_model_of,
    tokenized_nearby,
)
from service.frontend.inference import answer_inference
from service.frontend.oip.rest import error_response
from service.frontend.requests import Deadline
from service.frontend.responses import json_response
from service.frontend.routing import routing_of
from service.frontend.sse import event, event_stream
from service.frontend.state import FrontendState

#: The most characters of a prompt.
MAX_TEXT_INPUT_CHARS = 1_000_000

_STRICT = ConfigDict(extra="forbid", strict=True)


class GenerateParameters(BaseModel):
    model_config = _STRICT

    max_tokens: StrictInt | None = Field(
        default=None, description="New tokens at most; null: as many as the context leaves."
    )
    temperature: StrictFloat | None = Field(default=None, description="0 to 2; 0 is greedy.")
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    frequency_penalty: StrictFloat | None = Field(default=None, description="-2 to 2.")
    presence_penalty: StrictFloat | None = Field(default=None, description="-2 to 2.")
    repetition_penalty: StrictFloat | None = Field(default=None, description="Above 0.")
    exclude_input_in_output: StrictBool = True
    stream: StrictBool | None = Field(
        default=None, description="Accepted as Triton's clients send it; the route decides."
    )


class GenerateBody(BaseModel):
    """The generate extension's request body."""

    model_config = _STRICT

    text_input: StrictStr = Field(description="The prompt.")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


async def generate(request: Request, name: str, version: str | None = None) -> Response:
    """Generate text from ``text_input``; the whole text at once."""
    return await _answered(request, name, version, stream=False)


async def generate_stream(request: Request, name: str, version: str | None = None) -> Response:
    """Generate text from ``text_input``, sent as server-sent events as it comes."""
    return await _answered(request, name, version, stream=True)


async def _answered(request: Request, name: str, version: str | None, stream: bool) -> Response:
    async def serve(frontend: FrontendState, request_id: str) -> Response:
        return await serve_generate(
            frontend, request.scope, request.receive, request_id, name, version, stream=stream
        )

    return await answer_inference(request, serve, _error_answer)


def _error_answer(error: ServiceError, request_id: str) -> Response:
    return error_response(error)


async def serve_generate(
    frontend: FrontendState,
    scope: Scope,
    receive: Receive,
    request_id: str,
    name: str,
    version: str | None,
    *,
    stream: bool,
) -> Response:
    deadline = Deadline.start(frontend.settings)
    priority = request_priority(scope)
    routing = routing_of(scope)
    model = frontend.admitting_model(name, version, routing=routing)
    body = await read_request_body(frontend, scope, receive, deadline)
    try:
        request = GenerateBody.model_validate_json(body)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"] if "[" not in str(part))
        raise InvalidParameterError(where, f"{where}: {problem['msg']}") from None
    if len(request.text_input) > MAX_TEXT_INPUT_CHARS:
        raise InvalidParameterError(
            "text_input", f"text_input is over {MAX_TEXT_INPUT_CHARS} characters"
        )
    model = frontend.serving_model(name, version, routing)
    text_model = await text_model_of(frontend, model)
    text = request.text_input
    prompt = await tokenized_nearby(frontend, len(text), lambda: tuple(text_model.encode(text)))
    if not prompt:
        raise InvalidParameterError("text_input", "text_input has no tokens")
    parameters = request.parameters
    stop = [parameters.stop] if isinstance(parameters.stop, str) else parameters.stop or []
    settings = SamplingSettings(
        max_tokens=parameters.max_tokens,
        temperature=parameters.temperature,
        top_p=parameters.top_p,
        top_k=parameters.top_k,
        seed=parameters.seed,
        stop=tuple(stop),
        stop_token_ids=tuple(parameters.stop_token_ids or ()),
        ignore_eos=parameters.ignore_eos,
        frequency_penalty=parameters.frequency_penalty,
        presence_penalty=parameters.presence_penalty,
        repetition_penalty=parameters.repetition_penalty,
    )
    generation = Generation(model, text_model, [prompt], settings, request_id)
    choices = await generation.start(
        frontend, deadline=deadline, priority=priority, receive=receive
    )
    head = {"model_name": model.manifest.name, "model_version": generation.version}
    headers = {"X-Model-Version": f"{model.manifest.name}@{generation.version}"}
    prefix = "" if parameters.exclude_input_in_output else request.text_input
    if stream:
        events = _events(generation, choices, head, prefix)
        return event_stream(counted_while_streaming(frontend, events), headers)
    [result] = await collect(choices, receive)
    generation.log_usage(result.token_count, stream=False)
    answer = {**head, "text_output": prefix + result.text, "finish_reason": result.finish_reason}
    return json_response(answer, headers=headers)


async def _events(
    generation: Generation,
    choices: Sequence[StartedChoice],
    head: dict[str, str],
    prefix: str,
) -> AsyncIterator[bytes]:
    completion_tokens = 0
    try:
        async for update in merged(choices):
            completion_tokens += update.token_count
            text, prefix = prefix + update.text, ""
            yield event({**head, "text_output": text, "finish_reason": update.finish_reason})
    except ServiceError as error:
        yield event({"error": error.message})
    finally:
        generation.log_usage(completion_tokens, stream=True)
