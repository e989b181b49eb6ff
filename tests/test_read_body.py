"""``read_body``: a body is read whole, refused over its limit, and cut at the request's
deadline (``CutAt``, the deadline's timer), without mistaking any other cancellation for it."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.types import Message

from service.errors import PayloadTooLargeError, RequestTimeoutError
from service.frontend.predict import CutAt, read_body

#: Long enough for a busy machine to reach the awaits before the deadline.
DEADLINE_AFTER_S = 0.2


def chunks(*bodies: bytes) -> asyncio.Queue[Message]:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    for index, body in enumerate(bodies):
        more = index < len(bodies) - 1
        messages.put_nowait({"type": "http.request", "body": body, "more_body": more})
    return messages


async def test_a_body_in_pieces_is_read_whole_and_nothing_is_left_cancelled() -> None:
    messages = chunks(b"ab", b"cd", b"e")
    deadline_s = time.monotonic() + DEADLINE_AFTER_S
    assert await read_body(messages.get, "5", 10, deadline_s) == b"abcde"
    await asyncio.sleep(2 * DEADLINE_AFTER_S)  # past the deadline: the timer was cancelled


async def test_a_body_over_the_limit_is_refused() -> None:
    with pytest.raises(PayloadTooLargeError):
        await read_body(chunks(b"abc", b"def").get, None, 5, time.monotonic() + 10)
    with pytest.raises(PayloadTooLargeError):
        await read_body(chunks(b"abcdef").get, "6", 5, time.monotonic() + 10)


async def test_a_body_still_arriving_at_the_deadline_is_cut_then() -> None:
    messages: asyncio.Queue[Message] = asyncio.Queue()
    messages.put_nowait({"type": "http.request", "body": b"ab", "more_body": True})
    started_s = time.monotonic()  # the rest never comes
    with pytest.raises(RequestTimeoutError, match="2 bytes came"):
        await read_body(messages.get, None, 10, started_s + DEADLINE_AFTER_S)
    assert time.monotonic() - started_s >= DEADLINE_AFTER_S * 0.9


async def test_another_cancellation_inside_the_block_is_not_a_timeout() -> None:
    entered = asyncio.Event()

    async def waiting() -> None:
        with CutAt(time.monotonic() + 60):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(waiting())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_cut_comes_out_as_timeout_error_and_the_task_goes_on() -> None:
    with pytest.raises(TimeoutError), CutAt(time.monotonic() + DEADLINE_AFTER_S):
        await asyncio.Event().wait()
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left over
