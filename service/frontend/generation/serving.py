"""One generation request's path through a front end, shared by every generation route.

A route reads and checks its body, then: ``text_model_of`` (the version's tokenizer, loaded
off the event loop), ``tokenized_nearby`` (prompts to ids: a short one on the event loop, a
long one on a handler thread), ``start`` (every
sequence sent to the engine at once, waiting for each one's first tokens, so that a refusal
is answered as an HTTP error), and either ``collect`` (the whole answer) or ``merged``
updates streamed as they come (``choices.merged``). A client that leaves while it waits is
noticed at once (``requests.DisconnectWatcher``): its sequences are cancelled in the engine.
``counted_while_streaming`` keeps an open stream counted as a request in flight.
``log_usage`` logs each request's token counts, never its text.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from opentelemetry import trace
from starlette.types import Receive, Scope

from service import tracing
from service.bridge.interface import ModelInfo
from service.frontend import request_spans
from service.frontend.generation.choices import (
    ChoiceText,
    ChoiceUpdate,
    FinishReason,
    StartedChoice,
    TokenLogprob,
    choice_updates,
    close,
    merged,
    start_choices,
)
from service.frontend.generation.sampling import SamplingSettings
from service.frontend.generation.text_model import TextModel
from service.frontend.predict import PredictHeaders, read_body
from service.frontend.requests import Deadline, DisconnectWatcher
from service.frontend.state import FrontendState
from service.types import Priority

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def off_loop(frontend: FrontendState, function: Callable[[], T]) -> T:
    """``function()`` on the front end's handler threads: tokenizing and reading files never
    hold the event loop."""
    return await asyncio.get_running_loop().run_in_executor(frontend.handler_pool, function)


#: Prompts of up to this many characters are tokenized on the event loop: beside busy streams,
#: a hop to a handler thread and back costs far more than tokenizing them (measured in
#: docs/bench/generation.md).
SHORT_PROMPT_CHARS = 512


async def tokenized_nearby(
    frontend: FrontendState, characters: int, tokenize: Callable[[], T]
) -> T:
    """``tokenize()`` for a prompt of ``characters``: on the event loop when it is short
    (``SHORT_PROMPT_CHARS``), else on a handler thread."""
    if characters <= SHORT_PROMPT_CHARS:
        return tokenize()
    return await off_loop(frontend, tokenize)


async def read_request_body(
    frontend: FrontendState, scope: Scope, receive: Receive, deadline: Deadline
) -> bytes:
    """The body, bounded by ``max_body_bytes`` and the request's deadline."""
    declared: str | None = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared = value.decode("latin-1")
    return await read_body(receive, declared, frontend.settings.max_body_bytes, deadline.at_s)


def request_priority(scope: Scope) -> Priority:
    """``X-Priority: high`` is served before normal traffic, as on ``/predict``."""
    return PredictHeaders.from_scope(scope).batch_priority()


async def text_model_of(frontend: FrontendState, model: ModelInfo) -> TextModel:
    """``model``'s tokenizer and chat template; 404 for a model that does not generate.
    Read off the event loop the first time, then taken as it is: a request beside running
    streams waits for no handler thread."""
    loaded = frontend.loaded_text_model(model)
    if loaded is not None:
        return loaded
    return await off_loop(frontend, partial(frontend.text_model_for, model))


@dataclass
class Generation:
    """One request's sequences: ``len(prompts) * n`` choices, choice ``p * n + i`` the
    ``i``-th of prompt ``p``."""

    model: ModelInfo
    text_model: TextModel
    prompts: list[tuple[int, ...]]
    settings: SamplingSettings
    request_id: str
    started_s: float = field(default_factory=time.monotonic)
    version: str = ""
    """The version generating the choices, once started (the engine's word for it)."""

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    async def start(
        self,
        frontend: FrontendState,
        *,
        deadline: Deadline,
        priority: Priority,
        receive: Receive,
    ) -> list[StartedChoice]:
        """Every choice queued in the engine and its first update come."""
        streams: list[AsyncIterator[ChoiceUpdate]] = []
        traceparent = request_spans.current_traceparent()  # the engine's spans: its children
        stream_deadline_s = self.started_s + frontend.settings.generation_timeout_s
        for prompt_ids in self.prompts:
            for request in self.settings.engine_requests(
                self.text_model,
                prompt_ids,
                priority=priority,
                deadline_s=deadline.at_s,
                stream_deadline_s=stream_deadline_s,
                request_id=self.request_id,
                traceparent=traceparent,
            ):
                choice = ChoiceText(len(streams), self.text_model, prompt_ids, self.settings.stop)
                streams.append(choice_updates(frontend.engine.generate(request), choice))
        with DisconnectWatcher(receive):
            started = await start_choices(streams)
        self.version = started[0].first.version or self.model.manifest.version
        return started

    def log_usage(self, completion_tokens: int, *, stream: bool) -> None:
        """The request's token counts in the log, and on its span when it is answered whole
        (a stream's span ends once its answer starts); never its text."""
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
        }
        if tracing.current is not None and not stream:
            span = trace.get_current_span()
            span.set_attribute("gen_ai.usage.input_tokens", self.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        logger.info(
            "generation_finished",
            extra={
                "request_id": self.request_id,
                "model": self.model.manifest.label,
                "stream": stream,
                "duration_ms": round((time.monotonic() - self.started_s) * 1000.0, 1),
                **usage,
            },
        )


async def counted_while_streaming(
    frontend: FrontendState, events: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """``events``, the stream counted in flight and against ``max_requests_per_frontend``
    until it ends: its request was counted until its answer began, and an open stream holds
    as much of a front end as a request waiting."""
    frontend.request_tally.started()
    frontend.receiving += 1
    try:
        async for event in events:
            yield event
    finally:
        frontend.receiving -= 1
        frontend.request_tally.stopped()
        await close(events)


@dataclass
class ChoiceResult:
    """One choice, whole."""

    index: int
    text: str = ""
    token_count: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    version: str = ""

    def add(self, update: ChoiceUpdate) -> None:
        self.text += update.text
        self.token_count += update.token_count
        if update.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(update.logprobs)
        self.finish_reason = update.finish_reason
        self.version = update.version or self.version


async def collect(choices: Sequence[StartedChoice], receive: Receive) -> list[ChoiceResult]:
    """Every choice whole, in index order; the client's leaving cancels them all."""
    results = [ChoiceResult(index) for index in range(len(choices))]
    with DisconnectWatcher(receive):
        async for update in merged(choices):
            results[update.index].add(update)
    return results
