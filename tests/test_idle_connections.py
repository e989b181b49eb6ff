"""A kept-alive connection is closed ``keep_alive_timeout_s`` after its last answer if no
byte came since, served as batchserve serves it (uvicorn's keep-alive timer, behind the head
limits of ``http_limits``): never while a request is answered, and a request before the
timeout moves the close to the timeout after its answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.server.draining import uvicorn_config
from tests.fixtures import uvicorn_port

KEEP_ALIVE_S = 1
#: Longer than the keep-alive timeout.
SLOW_S = 2 * KEEP_ALIVE_S
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
SLOW_REQUEST = b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
ANSWER_BYTES = len(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def answering_ok(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection to uvicorn as batchserve configures it, idle connections kept alive
    ``KEEP_ALIVE_S``, without a ``date`` header (answers of a known length)."""
    config = uvicorn_config(answering_ok, Settings(port=1, keep_alive_timeout_s=KEEP_ALIVE_S))
    config.port, config.lifespan, config.date_header = 0, "off", False
    async with uvicorn_port(config) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield reader, writer
        finally:
            writer.close()


async def answered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> None:
    writer.write(request)
    answer = await asyncio.wait_for(reader.readexactly(ANSWER_BYTES), timeout=10.0)
    assert answer.endswith(b"\r\n\r\nok")


async def closed_after_s(reader: asyncio.StreamReader) -> float:
    """Seconds until the server closes the connection."""
    started_s = time.monotonic()
    assert await asyncio.wait_for(reader.read(), timeout=10.0) == b""
    return time.monotonic() - started_s


async def test_an_idle_connection_is_closed_the_timeout_after_its_answer() -> None:
    async with connected() as (reader, writer):
        await answered(reader, writer, REQUEST)
        closed_s = await closed_after_s(reader)
    assert KEEP_ALIVE_S * 0.9 <= closed_s < KEEP_ALIVE_S + 2.0


async def test_a_request_before_the_timeout_moves_the_close_to_the_timeout_after_its_answer() -> (
    None
):
    """The timer armed at the first answer fires during the idle time after the second: the
    connection stays open until the timeout after the second."""
    async with connected() as (reader, writer):
        await answered(reader, writer, REQUEST)
        await asyncio.sleep(KEEP_ALIVE_S / 2)  # idle between requests: the behaviour tested
        await answered(reader, writer, REQUEST)
        closed_s = await closed_after_s(reader)
    assert KEEP_ALIVE_S * 0.9 <= closed_s < KEEP_ALIVE_S + 2.0


async def test_a_connection_is_not_closed_while_its_request_is_answered() -> None:
    """A request outlasting the timeout armed at the answer before it: the timer fires while
    the connection is busy, and the close comes the timeout after the slow answer."""
    async with connected() as (reader, writer):
        await answered(reader, writer, REQUEST)
        await answered(reader, writer, SLOW_REQUEST)
        closed_s = await closed_after_s(reader)
    assert KEEP_ALIVE_S * 0.9 <= closed_s < KEEP_ALIVE_S + 2.0
