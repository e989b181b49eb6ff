"""What OpenAI's streams and answers share: the usage record, and an error met mid-stream."""

from __future__ import annotations

from typing import Any

import orjson

from service.errors import ServiceError
from service.frontend.openai.errors import openai_error_response
from service.frontend.sse import event


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
