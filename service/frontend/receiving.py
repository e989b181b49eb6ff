"""``received_or_pending``: an ASGI message that has arrived already, or what waits for it.

A request body of a few kilobytes is usually in the server's buffer by the time the request is
served; ``receive()`` then returns without waiting. Bounding that wait with
``asyncio.timeout`` armed a timer for every request (about 5 % of a front end's Python per
request, py-spy). Starting ``receive()`` by hand tells whether it waits: only then is a timer
needed, and the coroutine is handed on, already started, to be awaited under it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Generator
from types import CoroutineType
from typing import Any

from starlette.types import Message, Receive


def received_or_pending(receive: Receive) -> tuple[Message | None, Awaitable[Message] | None]:
    """``(message, None)`` when ``receive()`` returned without waiting, else ``(None,
    pending)``: the same call, started, to be awaited exactly once."""
    awaitable = receive()
    # The type first: an ABC's isinstance costs a microsecond (uvicorn's receive, and any
    # ``async def``, is a plain coroutine).
    if type(awaitable) is not CoroutineType and not isinstance(awaitable, Coroutine):
        return None, awaitable
    try:
        yielded = awaitable.send(None)
    except StopIteration as done:
        return done.value, None
    return None, _Started(awaitable, yielded)


class _Started:
    """A coroutine that has run up to its first wait; awaiting it runs it on from there (the
    event loop's results and cancellations are passed into it, as to any coroutine)."""

    def __init__(self, coroutine: Coroutine[Any, Any, Message], yielded: Any) -> None:
        self._coroutine = coroutine
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, Message]:
        yielded = self._yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                self._coroutine.close()
                raise
            except BaseException as error:
                try:
                    yielded = self._coroutine.throw(error)
                except StopIteration as done:
                    result: Message = done.value
                    return result
            else:
                try:
                    yielded = self._coroutine.send(sent)
                except StopIteration as done:
                    result = done.value
                    return result
