"""``POST /v1/completions``: OpenAI's text completion, whole or streamed.

A prompt is a text (tokenized with the tokenizer's special tokens, as ``tokenizer(text)``
gives), texts, token ids, or lists of token ids; each gets ``n`` choices. With ``stream``,
each event is a ``text_completion`` chunk of the text that came for one choice, the last of
each choice with its ``finish_reason``; ``stream_options.include_usage`` adds a last chunk
with the request's usage and no choices; ``data: [DONE]`` ends the stream. ``logprobs: k``
gives OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope

from service.errors import InvalidParameterError
from service.frontend.generation.choices import ChoiceUpdate, StartedChoice, TokenLogprob
from service.frontend.generation.sampling import MAX_CHOICES
from service.frontend.generation.serving import (
    ChoiceResult,
    Generation,
    collect,
    counted_while_streaming,
    tokenized_nearby,
)
from service.frontend.generation.text_model import TextModel
from service.frontend.openai.received import received
from service.frontend.openai.schemas import CompletionRequest, Prompt
from service.frontend.openai.streaming import stream_events, usage_of
from service.frontend.responses import json_response
from service.frontend.sse import event_stream
from service.frontend.state import FrontendState

#: The most sequences one request may ask for (prompts times ``n``).
MAX_SEQUENCES = 64
#: The most characters of a request's prompts, tokenized or not (the body's size bounds the
#: rest; this bounds the tokenizing).
MAX_PROMPT_CHARS = 1_000_000


async def serve_completion(
    frontend: FrontendState, scope: Scope, receive: Receive, request_id: str
) -> Response:
    arrived = await received(frontend, scope, receive, CompletionRequest)
    request, model, text_model = arrived.request, arrived.model, arrived.text_model
    deadline, priority = arrived.deadline, arrived.priority
    characters = sum(len(item) for item in prompt_items(request.prompt))
    prompts = await tokenized_nearby(
        frontend, characters, lambda: tokenized(text_model, request.prompt)
    )
    if len(prompts) * request.n > MAX_SEQUENCES:
        raise InvalidParameterError(
            "n",
            f"{len(prompts)} prompts with n={request.n} make {len(prompts) * request.n} "
            f"sequences; at most {MAX_SEQUENCES} per request (n at most {MAX_CHOICES})",
        )
    generation = Generation(
        model,
        text_model,
        prompts,
        request.sampling(request.max_tokens, request.logprobs),
        request_id,
    )
    choices = await generation.start(
        frontend, deadline=deadline, priority=priority, receive=receive
    )
    answer = CompletionAnswer(generation, request, f"cmpl-{request_id}")
    headers = {"X-Model-Version": f"{model.manifest.name}@{generation.version}"}
    if request.stream:
        return event_stream(counted_while_streaming(frontend, answer.events(choices)), headers)
    results = await collect(choices, receive)
    generation.log_usage(sum(result.token_count for result in results), stream=False)
    return json_response(answer.whole(results), headers=headers)


def tokenized(text_model: TextModel, prompt: Prompt) -> list[tuple[int, ...]]:
    """Each prompt's ids: texts tokenized, ids checked against the vocabulary."""
    items = prompt_items(prompt)
    if sum(len(item) for item in items) > MAX_PROMPT_CHARS:
        raise InvalidParameterError(
            "prompt", f"the prompts are longer than {MAX_PROMPT_CHARS} characters or ids together"
        )
    prompts: list[tuple[int, ...]] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            ids = tuple(text_model.encode(item))
        else:
            ids = tuple(item)
            text_model.check_ids(ids, "prompt" if len(items) == 1 else f"prompt[{index}]")
        if not ids:
            raise InvalidParameterError(
                "prompt", f"prompt {index} has no tokens: send some text or token ids"
            )
        prompts.append(ids)
    return prompts


def prompt_items(prompt: Prompt) -> Sequence[str | list[int]]:
    """The prompts of ``prompt``: texts, or token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameterError("prompt", "prompt is empty: send a text or token ids")
    texts = [item for item in prompt if isinstance(item, str)]
    if len(texts) == len(prompt):
        return texts
    numbers = [item for item in prompt if isinstance(item, int)]
    if len(numbers) == len(prompt):
        return [numbers]
    return [item for item in prompt if isinstance(item, list)]


class CompletionAnswer:
    """The answer's JSON: whole, or as stream chunks."""

    def __init__(self, generation: Generation, request: CompletionRequest, answer_id: str) -> None:
        self.generation = generation
        self.request = request
        self.id = answer_id
        self.created = int(time.time())
        self.model = generation.model.manifest.name
        self._prompt_texts: list[str] | None = None

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{self.model}@{self.generation.version}",
        }

    def _echoed(self, index: int) -> str:
        """The prompt's text of choice ``index``, with ``echo``."""
        if self._prompt_texts is None:
            text_model = self.generation.text_model
            self._prompt_texts = [text_model.decode(ids) for ids in self.generation.prompts]
        return self._prompt_texts[index // self.request.n]

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        text_model = self.generation.text_model
        return {
            "tokens": [text_model.token_text(entry.token_id) for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [
                {text_model.token_text(token): logprob for token, logprob in entry.top}
                for entry in entries
            ],
            "text_offset": [entry.text_offset for entry in entries],
        }

    def whole(self, results: list[ChoiceResult]) -> dict[str, Any]:
        completion_tokens = sum(result.token_count for result in results)
        return {
            **self._head(),
            "choices": [
                {
                    "index": result.index,
                    "text": (self._echoed(result.index) if self.request.echo else "") + result.text,
                    "logprobs": self._logprobs(result.logprobs),
                    "finish_reason": result.finish_reason,
                }
                for result in results
            ],
            "usage": usage_of(self.generation.prompt_tokens, completion_tokens),
        }

    def _chunk(self, update: ChoiceUpdate, first: bool) -> dict[str, Any]:
        text = update.text
        if first and self.request.echo:
            text = self._echoed(update.index) + text
        return {
            **self._head(),
            "choices": [
                {
                    "index": update.index,
                    "text": text,
                    "logprobs": self._logprobs(update.logprobs),
                    "finish_reason": update.finish_reason,
                }
            ],
        }

    def events(self, choices: Sequence[StartedChoice]) -> AsyncIterator[bytes]:
        """The stream's events (``streaming.stream_events``)."""
        usage_head = self._head() if self.request.include_usage else None
        return stream_events(self.generation, choices, self._chunk, usage_head)
