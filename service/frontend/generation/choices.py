"""The engine's token events of each choice turned into text, and the choices of a request as
one stream.

``ChoiceText`` is one choice's text: each token through the incremental detokenizer, the text
through the stop strings (``service/stop_strings.py``: nothing past a stop string is ever
sent), and the finish reason. ``choice_updates`` drives it from the engine's iterator and
closes that iterator as soon as the choice is done, which cancels the sequence in the engine
(a stop string matched, the client left, or an error). ``start_choices`` starts every choice
of a request at once and waits for each one's first event, so that a refusal (404, 422, 429,
503) is answered as an HTTP error before anything is sent; ``merged`` interleaves the started
choices in the order their events come.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

from service.bridge.interface import GeneratedTokens
from service.detokenizer import IncrementalDetokenizer
from service.errors import InferenceError
from service.frontend.generation.text_model import TextModel
from service.stop_strings import StopStringText

FinishReason = Literal["stop", "length"]
"""As OpenAI's API names them: ``stop`` for an end-of-sequence token, a stop token or a stop
string; ``length`` for ``max_tokens`` or the end of the model's context."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token taken, its log-probability, and the most likely tokens at its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    text_offset: int
    """Where its text starts in the choice's text (characters)."""


@dataclass(frozen=True, slots=True)
class ChoiceUpdate:
    """What one choice adds: text to send, the tokens that made it, and how it ended."""

    index: int
    text: str
    token_count: int
    """Tokens taken from the engine for this update (the completion's token count)."""
    logprobs: tuple[TokenLogprob, ...] | None
    """Each token's log-probability, when the request asked for them."""
    finish_reason: FinishReason | None
    version: str


class ChoiceText:
    """One choice's text, built from the engine's token events."""

    def __init__(
        self,
        index: int,
        text_model: TextModel,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
    ) -> None:
        self.index = index
        self._detokenizer = IncrementalDetokenizer(text_model.tokenizer, prompt_ids=prompt_ids)
        self._stop = StopStringText(stop)
        self.token_count = 0
        self.finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        """The text given out so far."""
        return self._stop.text

    def take(self, item: GeneratedTokens) -> ChoiceUpdate:
        """The text ``item``'s tokens add. Tokens after a stop string's end are dropped (the
        caller cancels the sequence); a failed sequence raises ``InferenceError``."""
        if self.finish_reason is not None:
            return self._update("", 0, (), item.version)
        if item.finish_reason == "error":
            raise InferenceError("the model failed on this sequence; its batch-mates go on")
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        taken = 0
        for position, token_id in enumerate(item.token_ids):
            offset = len(self._detokenizer.text)
            delta = self._stop.add(self._detokenizer.push(token_id))
            taken += 1
            pieces.append(delta.text)
            if item.logprobs is not None:
                top = item.top_logprobs[position] if item.top_logprobs is not None else ()
                logprobs.append(TokenLogprob(token_id, item.logprobs[position], top, offset))
            if delta.stopped:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and item.finish_reason is not None:
            last = self._stop.finish(self._detokenizer.finish())
            pieces.append(last.text)
            self.finish_reason = "stop" if last.stopped else _openai_reason(item.finish_reason)
        self.token_count += taken
        chosen = tuple(logprobs) if item.logprobs is not None else None
        return self._update("".join(pieces), taken, chosen, item.version)

    def _update(
        self,
        text: str,
        taken: int,
        logprobs: tuple[TokenLogprob, ...] | None,
        version: str,
    ) -> ChoiceUpdate:
        return ChoiceUpdate(self.index, text, taken, logprobs, self.finish_reason, version)


def _openai_reason(reason: str) -> FinishReason:
    return "length" if reason == "length" else "stop"


async def choice_updates(
    tokens: AsyncIterator[GeneratedTokens], choice: ChoiceText
) -> AsyncIterator[ChoiceUpdate]:
    """``choice``'s updates as the engine's events come, until it finishes. The engine's
    iterator is closed when this ends, however it ends: a choice cut by a stop string, or
    left by its client, is cancelled in the engine."""
    try:
        async for item in tokens:
            update = choice.take(item)
            yield update
            if update.finish_reason is not None:
                return
        raise InferenceError("the engine ended the sequence without a finish reason")
    finally:
        await close(tokens)


async def close(iterator: AsyncIterator[object]) -> None:
    """Close an async generator early (its ``finally`` runs now, not when it is collected)."""
    closing = getattr(iterator, "aclose", None)
    if closing is not None:
        await closing()


class StartedChoice:
    """A choice whose first update has come: that update, then the rest."""

    def __init__(self, first: ChoiceUpdate, rest: AsyncIterator[ChoiceUpdate]) -> None:
        self.first = first
        self._rest = rest

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        yield self.first
        if self.first.finish_reason is None:
            async for update in self._rest:
                yield update

    async def close(self) -> None:
        await close(self._rest)


async def start_choices(streams: Sequence[AsyncIterator[ChoiceUpdate]]) -> list[StartedChoice]:
    """Each stream's first update, all asked for at once (every sequence queued together). If
    any is refused, every stream is closed and the first refusal raised: a request is
    answered whole or refused."""
    firsts = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
    failure = next((first for first in firsts if isinstance(first, BaseException)), None)
    if failure is not None:
        for stream in streams:
            await close(stream)
        if isinstance(failure, StopAsyncIteration):
            raise InferenceError("the engine ended a sequence before its first token")
        raise failure
    return [
        StartedChoice(first, stream)
        for first, stream in zip(firsts, streams, strict=True)
        if isinstance(first, ChoiceUpdate)
    ]


async def merged(choices: Sequence[StartedChoice]) -> AsyncIterator[ChoiceUpdate]:
    """Every choice's updates, in the order they come. One task per choice beyond the first;
    each is cancelled (its sequence with it) when this ends early."""
    if len(choices) == 1:
        try:
            async for update in choices[0].updates():
                yield update
        finally:
            await choices[0].close()
        return
    arrived: asyncio.Queue[ChoiceUpdate | BaseException | None] = asyncio.Queue()

    async def pump(choice: StartedChoice) -> None:
        try:
            async for update in choice.updates():
                arrived.put_nowait(update)
        except Exception as error:  # raised where the choices are read
            arrived.put_nowait(error)
        finally:
            await choice.close()
            arrived.put_nowait(None)

    pumps = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        running = len(pumps)
        while running:
            item = await arrived.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
