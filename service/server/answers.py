"""How a connection's answers are written: each in one system call, and a whole answer the
front end built itself without uvicorn's per-header checks or its two ASGI messages.

``HeadHeldTransport``: uvicorn writes a response's head when the app sends
``http.response.start`` and its body on ``http.response.body``, two writes and, over TCP,
two segments for the client to wake up to (py-spy: uvicorn's ``send`` was the largest frame
of a front end under load). The head is held until the body's first write, or the end of the
loop turn if no body follows in it (a streamed answer).

``AnswerCycle``: uvicorn's response cycle with ``send_whole``, which ``/predict``'s answers
take (``frontend.answer_writing``). uvicorn's ``send`` tests every header of every answer
against two regular expressions (about 8,300 instructions per answer, a fiftieth of a front
end's), although ``/predict``'s headers are built from values the service has validated
already; and the head waits for the body through a scheduled flush. ``send_whole`` writes
the very bytes ``send`` would, in one call.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from service.frontend.answer_writing import RawHeaders, WholeAnswerWriter

#: A body up to this size is copied behind its head to go out in one write; a larger one is
#: written after it (the copy would cost more than the second system call).
JOINED_BODY_BYTES = 256 * 1024


class HeadHeldTransport(asyncio.Transport):
    """The transport one response is written to: a response head (the first write ending in
    a blank line) is held until the next write and goes out with it, or at the end of the
    loop turn; everything else goes through at once. uvicorn's response cycle calls only
    ``write``, ``close`` and ``is_closing``; ``AnswerCycle`` ``write_whole`` too."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= JOINED_BODY_BYTES:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif bytes(data[-4:]) == b"\r\n\r\n" and data[:5] == b"HTTP/":
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def write_whole(self, data: bytes) -> None:
        """Write a whole answer, head and body: nothing to hold back, nothing to look for."""
        if self._held is not None:
            self.flush()
        self._transport.write(data)

    def flush(self) -> None:
        """Write a head still held (no body followed it in its loop turn)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)


class AnswerCycle(RequestResponseCycle, WholeAnswerWriter):
    """uvicorn's cycle of one request and its response, able to write a whole answer at once.

    ``LimitedHttpToolsProtocol`` makes each of its cycles one (it adds methods only). The app's
    ASGI ``send`` is the cycle's ``send``, unchanged: every answer but ``send_whole``'s goes
    through uvicorn as before.
    """

    #: The server's default headers (``date``, and any from its configuration) last checked:
    #: uvicorn replaces the list once a second, and the new one is checked once.
    _checked_defaults: ClassVar[RawHeaders | None] = None

    async def send_whole(
        self, status_code: int, headers: RawHeaders, body: bytes | memoryview, checked: bool
    ) -> None:
        """What uvicorn's ``send`` writes for ``http.response.start`` with ``status_code`` and
        ``headers``, then ``http.response.body`` with ``body``, in one write when ``checked``
        (the headers' names and values hold no character uvicorn refuses) and the body is
        the whole of its ``content-length``. Anything else goes through ``send``."""
        if not checked or self.response_started or self.access_log:
            start = {"type": "http.response.start", "status": status_code, "headers": headers}
            await self.send(start)  # type: ignore[arg-type]
            await self._send_body(body)
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        self.response_started = True
        self.waiting_for_100_continue = False
        defaults = self.default_headers
        if defaults is not AnswerCycle._checked_defaults:
            _check(defaults)
            AnswerCycle._checked_defaults = defaults
        head = self._head(status_code, defaults + headers)
        transport = self.transport
        if (
            self.chunked_encoding is False
            and self.expected_content_length == len(body) <= JOINED_BODY_BYTES
            and self.scope["method"] != "HEAD"
            and isinstance(transport, HeadHeldTransport)
        ):
            self.expected_content_length = 0
            transport.write_whole(head + body)
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                transport.close()
            self.on_response()
            return
        transport.write(head)
        await self._send_body(body)

    async def _send_body(self, body: bytes | memoryview) -> None:
        # uvicorn types a body as bytes; Starlette's may be a memoryview, written as given.
        await self.send({"type": "http.response.body", "body": body})  # type: ignore[misc,arg-type]

    def _head(self, status_code: int, headers: RawHeaders) -> bytes:
        """The status line and headers as uvicorn's ``send`` writes them, its state (length,
        chunking, keep-alive) set as it sets it; the headers are checked already."""
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
                if b"close" in connection:
                    self.keep_alive = False
                    has_connection_close = True
            content.extend((name, b": ", value, b"\r\n"))
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status_code not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)


def _check(headers: RawHeaders) -> None:
    """uvicorn's checks of a response's headers, with its errors."""
    for name, value in headers:
        if HEADER_RE.search(name):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(value):
            raise RuntimeError("Invalid HTTP header value.")
