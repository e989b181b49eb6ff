"""A generated stream as its consumer reads it: the tokens that came since it last asked, as
one item (``GeneratedTokens.joined``), then its end or its error.

Both ends of ``EngineClient.generate`` use it: the engine for a caller in its own process,
the bridge client for a stream whose tokens arrive in frames."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from service.bridge.interface import GeneratedTokens
from service.errors import ServiceError


class TokenQueue:
    """One stream's tokens, filled on the event loop (``tokens``, ``failed``) and read by
    one consumer (``next``)."""

    def __init__(self) -> None:
        self._items: list[GeneratedTokens] = []
        self._error: ServiceError | None = None
        self._ready = asyncio.Event()

    def tokens(self, item: GeneratedTokens) -> None:
        self._items.append(item)
        self._ready.set()

    def failed(self, error: ServiceError) -> None:
        self._error = error
        self._ready.set()

    async def next(self) -> GeneratedTokens:
        """The tokens that came since the last call (waiting for one); raises the stream's
        error once they have been taken."""
        while not self._items and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._items:
            items, self._items = self._items, []
            return GeneratedTokens.joined(items)
        assert self._error is not None
        raise self._error

    async def until_finished(self) -> AsyncIterator[GeneratedTokens]:
        """``next`` after ``next``, up to the item that finishes the stream."""
        while True:
            item = await self.next()
            yield item
            if item.finish_reason is not None:
                return
