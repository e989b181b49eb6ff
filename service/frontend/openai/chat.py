"""``POST /v1/chat/completions``: OpenAI's chat completion, whole or streamed.

The messages are rendered into one prompt with the version's chat template, the assistant's
turn opened (``chat_template.render_chat``), and tokenized without the tokenizer's special
tokens (the template wrote them), as ``transformers``' ``apply_chat_template`` does. A
version without a chat template is refused (400: use ``/v1/completions``). With ``stream``,
each event is a ``chat.completion.chunk``; a choice's first carries ``role: assistant``.
``logprobs: true`` (and ``top_logprobs: k``) gives OpenAI's chat shape (``content``: token,
logprob, bytes, top_logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope

from service.errors import InvalidParameterError
from service.frontend.generation.chat_template import render_chat
from service.frontend.generation.choices import ChoiceUpdate, StartedChoice, TokenLogprob
from service.frontend.generation.serving import (
    ChoiceResult,
    Generation,
    collect,
    counted_while_streaming,
    off_loop,
)
from service.frontend.generation.text_model import TextModel
from service.frontend.openai.received import received
from service.frontend.openai.schemas import ChatCompletionRequest, ChatMessage
from service.frontend.openai.streaming import stream_events, usage_of
from service.frontend.responses import json_response
from service.frontend.sse import event_stream
from service.frontend.state import FrontendState

#: The most characters of a chat's messages together.
MAX_CHAT_CHARS = 1_000_000


async def serve_chat_completion(
    frontend: FrontendState, scope: Scope, receive: Receive, request_id: str
) -> Response:
    arrived = await received(frontend, scope, receive, ChatCompletionRequest)
    request, model, text_model = arrived.request, arrived.model, arrived.text_model
    deadline, priority = arrived.deadline, arrived.priority
    prompt = await off_loop(frontend, lambda: chat_prompt(text_model, request.messages))
    top = request.top_logprobs or 0
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    settings = request.sampling(max_tokens, top if request.logprobs else None)
    generation = Generation(model, text_model, [prompt], settings, request_id)
    choices = await generation.start(
        frontend, deadline=deadline, priority=priority, receive=receive
    )
    answer = ChatAnswer(generation, request, f"chatcmpl-{request_id}")
    headers = {"X-Model-Version": f"{model.manifest.name}@{generation.version}"}
    if request.stream:
        return event_stream(counted_while_streaming(frontend, answer.events(choices)), headers)
    results = await collect(choices, receive)
    generation.log_usage(sum(result.token_count for result in results), stream=False)
    return json_response(answer.whole(results), headers=headers)


def chat_prompt(text_model: TextModel, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
    """The chat rendered with the version's template and tokenized."""
    if text_model.chat_template is None:
        raise InvalidParameterError(
            "messages",
            f"{text_model.manifest.name} has no chat template (tokenizer_config.json's "
            "chat_template): send its prompts to /v1/completions",
        )
    rendered = [message.for_template() for message in messages]
    if sum(len(message["content"]) for message in rendered) > MAX_CHAT_CHARS:
        raise InvalidParameterError(
            "messages", f"the messages hold more than {MAX_CHAT_CHARS} characters together"
        )
    text = render_chat(text_model.chat_template, rendered, text_model.special_tokens)
    ids = tuple(text_model.encode(text, add_special_tokens=False))
    if not ids:
        raise InvalidParameterError("messages", "the chat renders to no tokens")
    return ids


class ChatAnswer:
    """The answer's JSON: whole, or as stream chunks."""

    def __init__(
        self, generation: Generation, request: ChatCompletionRequest, answer_id: str
    ) -> None:
        self.generation = generation
        self.request = request
        self.id = answer_id
        self.created = int(time.time())
        self.model = generation.model.manifest.name

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{self.model}@{self.generation.version}",
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.generation.text_model.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {
            "content": [
                {
                    **self._token(entry.token_id, entry.logprob),
                    "top_logprobs": [self._token(token, value) for token, value in entry.top],
                }
                for entry in entries
            ]
        }

    def whole(self, results: list[ChoiceResult]) -> dict[str, Any]:
        completion_tokens = sum(result.token_count for result in results)
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": result.index,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": self._logprobs(result.logprobs),
                    "finish_reason": result.finish_reason,
                }
                for result in results
            ],
            "usage": usage_of(self.generation.prompt_tokens, completion_tokens),
        }

    def _chunk(self, update: ChoiceUpdate, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if update.text or first:
            delta["content"] = update.text
        return {
            **self._head("chat.completion.chunk"),
            "choices": [
                {
                    "index": update.index,
                    "delta": delta,
                    "logprobs": self._logprobs(update.logprobs),
                    "finish_reason": update.finish_reason,
                }
            ],
        }

    def events(self, choices: Sequence[StartedChoice]) -> AsyncIterator[bytes]:
        """The stream's events (``streaming.stream_events``)."""
        usage_head = self._head("chat.completion.chunk") if self.request.include_usage else None
        return stream_events(self.generation, choices, self._chunk, usage_head)
