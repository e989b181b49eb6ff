"""Request heads are bounded in size (431) and in arrival time (408, then closed), on a real
uvicorn server on 127.0.0.1 and on gunicorn's front ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.server.draining import uvicorn_config
from tests.fixtures import uvicorn_port, wait_until
from tests.processes import serve_with_engines, wait_until_serving

HEAD_TIMEOUT_S = 0.5
MAX_HEADER_BYTES = 4096


async def slow_hello(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers after twice the head timeout: the head's timer must not cut a slow answer."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * HEAD_TIMEOUT_S)
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


@asynccontextmanager
async def serving(**settings: object) -> AsyncIterator[int]:
    """The port of uvicorn configured as batchserve configures it, serving ``slow_hello``."""
    chosen = Settings(
        port=1, max_header_bytes=MAX_HEADER_BYTES, header_timeout_s=HEAD_TIMEOUT_S, **settings
    )
    config = uvicorn_config(slow_hello, chosen)  # type: ignore[arg-type]
    config.port, config.lifespan = 0, "off"
    async with uvicorn_port(config) as port:
        yield port


async def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """What the server answers to ``data`` before it closes, and after how many seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started_s = time.monotonic()
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), timeout=10.0)
    writer.close()
    return answer, time.monotonic() - started_s


def status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_a_header_over_the_limit_is_answered_431_and_the_connection_closed() -> None:
    async with serving() as port:
        big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
        answer, _ = await exchange(port, big)
        many = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Small: aaaaaaaaaa\r\n" * 400 + b"\r\n"
        many_answer, _ = await exchange(port, many)
        within = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Ok: "
        within_answer, _ = await exchange(port, within + b"a" * 3000 + b"\r\n\r\n")

    status, body = status_and_body(answer)
    assert status == 431
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert f"exceed {MAX_HEADER_BYTES} bytes" in error["message"]
    assert b"connection: close" in answer.lower()
    assert status_and_body(many_answer)[0] == 431  # many small headers count together
    assert status_and_body(within_answer) == (200, b"hello")


async def test_a_huge_header_is_refused_before_it_is_all_sent() -> None:
    """100 MB offered: the server answers once the limit is passed, having read little."""
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answered = asyncio.create_task(reader.read())  # until the server's end of stream
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 100 * 1024 * 1024 and not (answered.done() or writer.is_closing()):
                writer.write(b"a" * 65536)
                await writer.drain()
                sent += 65536
        except ConnectionError:
            pass  # closed once the lingering read more than a MiB after answering
        answer = await asyncio.wait_for(answered, timeout=10.0)
        writer.close()
    assert status_and_body(answer)[0] == 431
    assert sent < 50 * 1024 * 1024


async def test_a_request_line_trickling_in_is_cut_at_the_head_timeout() -> None:
    async with serving() as port:
        half, half_s = await exchange(port, b"GET /predi")
        silent, silent_s = await exchange(port, b"")

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started_s = time.monotonic()
        answered = asyncio.create_task(reader.read())  # until the server's end of stream
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            if answered.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)  # a byte every 50 ms: the head needs 7 s
        trickled = await asyncio.wait_for(answered, timeout=10.0)
        trickled_s = time.monotonic() - started_s
        writer.close()

    assert status_and_body(half)[0] == 408
    assert b"did not arrive within 0.5 s" in half
    assert silent == b""  # nothing asked, nothing answered: closed
    for waited_s in (half_s, silent_s, trickled_s):
        assert HEAD_TIMEOUT_S * 0.9 <= waited_s < HEAD_TIMEOUT_S + 2.0
    assert status_and_body(trickled)[0] == 408


async def test_a_later_head_trickling_in_on_a_kept_alive_connection_is_cut_too() -> None:
    """The timer of a later request's head is armed only when a read ends with the head
    incomplete: a head sent in pieces after a first answer is still cut at the timeout."""
    async with serving(keep_alive_timeout_s=30) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"hello"), timeout=10.0)
        started_s = time.monotonic()
        answered = asyncio.create_task(reader.read())
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            if answered.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)  # a slow client, trickling its head: the behaviour tested
        trickled = await asyncio.wait_for(answered, timeout=10.0)
        trickled_s = time.monotonic() - started_s
        writer.close()
    assert status_and_body(first) == (200, b"hello")
    assert status_and_body(trickled)[0] == 408
    assert HEAD_TIMEOUT_S * 0.9 <= trickled_s < HEAD_TIMEOUT_S + 2.0


async def test_the_head_timer_spares_slow_answers_and_restarts_for_the_next_request() -> None:
    async with serving(keep_alive_timeout_s=1) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            slow = await client.get("/slow")  # longer than the head timeout
            again = await client.get("/")  # the same kept-alive connection
            await asyncio.sleep(2 * HEAD_TIMEOUT_S)  # idle, within keep-alive
            third = await client.get("/")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        started_s = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), timeout=10.0)  # until it is closed
        idle_closed_s = time.monotonic() - started_s
        writer.close()
    assert [slow.status_code, again.status_code, third.status_code] == [200, 200, 200]
    assert status_and_body(answer) == (200, b"hello")
    assert 0.9 <= idle_closed_s < 4.0  # keep_alive_timeout_s = 1


async def test_a_head_trickling_in_behind_a_request_in_flight_is_refused_after_its_answer() -> None:
    """A pipelined head cut at the timeout while the request before it is answered: that
    answer is written whole first, then the 408, then the connection is closed."""
    async with serving(keep_alive_timeout_s=30) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nX-Slow: a")
        answer = await asyncio.wait_for(reader.read(), timeout=10.0)  # until it is closed
        writer.close()
    first, _, refusal = answer.partition(b"hello")
    assert status_and_body(first + b"hello") == (200, b"hello")
    assert status_and_body(refusal)[0] == 408
    assert b"connection: close" in refusal


async def accepting_websockets(scope: Scope, receive: Receive, send: Send) -> None:
    """Accepts a WebSocket, echoes one text message, closes."""
    if scope["type"] != "websocket":
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    message = await receive()
    await send({"type": "websocket.send", "text": message.get("text")})
    await send({"type": "websocket.close"})


async def test_a_websocket_handshake_is_handed_to_uvicorns_websocket_protocol() -> None:
    """Past the head limits, uvicorn upgrades a connection as it would without them, and the
    limits leave it alone after (no 408 once its head timer would have run out)."""
    config = uvicorn_config(
        accepting_websockets,  # type: ignore[arg-type]
        Settings(port=1, header_timeout_s=HEAD_TIMEOUT_S),
    )
    config.port, config.lifespan = 0, "off"
    async with uvicorn_port(config) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10.0)
        await asyncio.sleep(2 * HEAD_TIMEOUT_S)  # past the head timeout: nothing may cut it
        # One masked text frame, "hi".
        writer.write(bytes([0x81, 0x82, 1, 2, 3, 4, ord("h") ^ 1, ord("i") ^ 2]))
        echoed = await asyncio.wait_for(reader.readexactly(4), timeout=10.0)
        writer.close()
    assert head.startswith(b"HTTP/1.1 101 ")
    assert echoed == bytes([0x81, 2]) + b"hi"


async def test_gunicorn_front_ends_limit_heads_too(tmp_path: Path) -> None:
    with serve_with_engines(
        tmp_path,
        2,
        BATCHSERVE_MAX_HEADER_BYTES="4096",
        BATCHSERVE_HEADER_TIMEOUT_S="0.5",
    ) as server:
        wait_until_serving(server, 2)
        port = int(server.url.rsplit(":", 1)[1])
        big, _ = await exchange(port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 8192 + b"\r\n")
        half, half_s = await exchange(port, b"GET /heal")
    assert status_and_body(big)[0] == 431
    assert status_and_body(half)[0] == 408
    assert half_s < 3.0


class TransportRecordingWrites(asyncio.Transport):
    """A connection's transport that keeps what each ``write`` call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True


async def answer_with(app: Any, request: bytes) -> list[bytes]:
    """The writes of batchserve's HTTP protocol answering ``request`` with ``app``."""
    config = uvicorn_config(app, Settings(port=1))
    config.lifespan = "off"
    config.load()
    state = uvicorn.server.ServerState()
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
    transport = TransportRecordingWrites()
    protocol.connection_made(transport)
    protocol.data_received(request)
    await wait_until(lambda: not state.tasks)
    await asyncio.sleep(0)
    protocol.connection_lost(None)
    return transport.writes


async def test_an_answers_head_and_body_go_out_in_one_write() -> None:
    """uvicorn writes the head on ``http.response.start`` and the body apart: two system
    calls and two TCP segments per answer. Held until the body comes, the head goes with it."""
    writes = await answer_with(slow_hello, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(writes) == 1
    status, body = status_and_body(writes[0])
    assert (status, body) == (200, b"hello")


async def test_a_head_whose_body_comes_later_is_written_at_the_end_of_its_turn() -> None:
    """A streamed answer: its head is not held back while the body is still being made (it
    went out alone, before the body)."""
    head_written = asyncio.Event()

    async def streaming(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.05)
        head_written.set()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    task = asyncio.create_task(
        answer_with(streaming, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"), name="answer"
    )
    await head_written.wait()
    writes = await task
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b"\r\n\r\n")
    assert b"late" in b"".join(writes[1:])
