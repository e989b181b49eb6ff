"""What OpenAI's streams and answers share: the usage record, an error met mid-stream, and the
stream of events itself."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson

from service.errors import ServiceError
from service.frontend.generation.choices import ChoiceUpdate, StartedChoice, merged
from service.frontend.generation.serving import Generation
from service.frontend.openai.errors import openai_error_response
from service.frontend.sse import DONE, event


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_event(error: ServiceError) -> bytes:
    """An error after the stream began (its status is sent already): one event holding the
    error in OpenAI's shape, as vLLM sends it; the stream then ends as usual."""
    document: dict[str, Any] = orjson.loads(openai_error_response(error).body)
    return event(document)


async def stream_events(
    generation: Generation,
    choices: Sequence[StartedChoice],
    chunk: Callable[[ChoiceUpdate, bool], dict[str, Any]],
    usage_head: dict[str, Any] | None,
) -> AsyncIterator[bytes]:
    """The stream's events: ``chunk`` of each update (told whether it is its choice's first),
    an error met on the way, the usage when ``usage_head`` is given (the chunk's head), and
    ``[DONE]``. The client's leaving cancels it (and the sequences)."""
    completion_tokens = 0
    begun: set[int] = set()
    try:
        try:
            async for update in merged(choices):
                completion_tokens += update.token_count
                first = update.index not in begun
                begun.add(update.index)
                yield event(chunk(update, first))
        except ServiceError as error:
            yield error_event(error)
        if usage_head is not None:
            usage = usage_of(generation.prompt_tokens, completion_tokens)
            yield event({**usage_head, "choices": [], "usage": usage})
        yield DONE
    finally:
        generation.log_usage(completion_tokens, stream=True)
