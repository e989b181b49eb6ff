"""``received_or_pending``: a message already there needs no timer; one still coming is
awaited, bounded and cancellable, as a plain ``await receive()`` is."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import pytest

from service.frontend.receiving import received_or_pending

BODY = {"type": "http.request", "body": b"{}", "more_body": False}


async def test_a_message_that_has_arrived_is_returned_without_waiting() -> None:
    async def receive() -> dict[str, Any]:
        return BODY

    assert received_or_pending(receive) == (BODY, None)


async def test_a_message_still_coming_is_awaited_from_where_receive_stopped() -> None:
    arrived = asyncio.Event()
    calls = []

    async def receive() -> dict[str, Any]:
        calls.append("started")
        await arrived.wait()
        await asyncio.sleep(0)  # and waits once more after the first wake-up
        return BODY

    message, pending = received_or_pending(receive)
    assert message is None
    assert pending is not None
    asyncio.get_running_loop().call_soon(arrived.set)
    assert await pending == BODY
    assert calls == ["started"]  # one call, resumed, never started again


async def test_a_pending_message_is_cancelled_by_a_timeout_and_its_receive_cleaned_up() -> None:
    cleaned = []

    async def receive() -> dict[str, Any]:
        try:
            await asyncio.Event().wait()  # never arrives
        finally:
            cleaned.append(True)
        return BODY

    _, pending = received_or_pending(receive)
    assert pending is not None
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await pending
    assert cleaned == [True]


async def test_a_receive_that_is_no_coroutine_is_handed_back_to_await() -> None:
    future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    future.set_result(BODY)
    message, pending = received_or_pending(lambda: future)
    assert message is None
    assert pending is future


class _ReturningAtOnce(Coroutine[Any, Any, dict[str, Any]]):
    """A coroutine that is no ``async def``'s: it returns ``BODY`` when first sent to."""

    def send(self, value: Any) -> Any:
        raise StopIteration(BODY)

    def throw(self, *args: Any) -> Any:
        raise StopIteration(BODY)

    def close(self) -> None:
        return None

    def __await__(self) -> Generator[Any, Any, dict[str, Any]]:
        return BODY
        yield


async def test_a_coroutine_of_another_type_is_run_as_an_async_defs_is() -> None:
    message, pending = received_or_pending(_ReturningAtOnce)
    assert message == BODY
    assert pending is None
