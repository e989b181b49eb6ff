"""Limits on a request's head that uvicorn does not set: its size, and the time it takes to come.

uvicorn reads a request line and headers of any size for as long as a client takes to send
them (uvicorn issue #157): a 100 MB header was answered 200, held in the front end's memory,
and a client sending a header a byte a second kept its connection open as long as it liked.
``HeadLimitedProtocol`` stands between each connection and uvicorn's own httptools protocol: it
hands uvicorn every asyncio callback unchanged, and watches the bytes with a parser of its own
(httptools, told only where each head begins and ends, across kept-alive and pipelined
requests). Per connection:

- a head (request line and headers) larger than ``max_head_bytes`` is answered 431, as soon as
  that many bytes have arrived without the head ending;
- a head must arrive whole within ``head_timeout_s`` of the connection opening, or of its first
  byte for a later request on a kept-alive connection; else 408 (the connection is closed
  without an answer if not a byte came).

A request uvicorn holds already is answered first: the refusal is written when uvicorn closes
the connection after it. Then the connection lingers: what the client still sends is read and
dropped for a while before the connection is closed, since closing with unread bytes would
reset it and the client would lose the answer (nginx's lingering close). uvicorn closes idle
kept-alive connections itself (``timeout_keep_alive``); the request's deadline cuts a slow body
(``predict.read_body``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast

import httptools
import orjson
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from service.config import Settings

#: What a response's status line says, for the two statuses answered here.
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
#: After a refusal, how long and how much the client's further bytes are read and dropped
#: before the connection closes.
LINGER_S = 2.0
LINGER_MAX_BYTES = 4 * 1024 * 1024
#: The bytes each header adds to the head besides its name and value (": " and CRLF).
_HEADER_OVERHEAD_BYTES = 4


class UvicornHttp(Protocol):
    """What the head limits call of uvicorn's HTTP protocol: asyncio's protocol callbacks, and
    ``shutdown`` (what ``uvicorn.Server`` calls to close a connection once its request is
    answered)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...
    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...
    def shutdown(self) -> None: ...


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The app of the throwaway config that names uvicorn's protocol class: never called."""


@functools.cache
def httptools_protocol() -> Callable[..., UvicornHttp]:
    """uvicorn's own httptools protocol class, as uvicorn's public ``Config`` resolves
    ``http="httptools"`` (its module path is not part of uvicorn's API)."""
    config = uvicorn.Config(_no_app, http="httptools", lifespan="off", log_config=None)
    config.load()
    return cast(Callable[..., UvicornHttp], config.http_protocol_class)


class _HeadTooLargeError(Exception):
    """Raised from a parser callback to stop parsing a head over the limit."""


class HeadLimitedProtocol(asyncio.Protocol):
    """One connection: uvicorn's httptools protocol behind the head limits.

    uvicorn builds one per connection (``uvicorn.Config(http=...)``); ``limited_protocol``
    makes the class with the settings' limits.
    """

    max_head_bytes: ClassVar[int] = 32 * 1024
    head_timeout_s: ClassVar[float] = 5.0
    #: The connections of this class now open (``DrainingServer`` waits on their first
    #: requests at shutdown).
    open_connections: ClassVar[set[HeadLimitedProtocol]] = set()

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        **_loop: object,
    ) -> None:
        # uvicorn also passes the loop to run on (``_loop``), None when it serves: the running one.
        self._http = httptools_protocol()(
            config=config,
            server_state=server_state,
            app_state=app_state,
        )
        self._server_state = server_state
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        # As uvicorn's parser: a pipelined request after a ``connection: close`` is not an error.
        self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._watching = True
        """False once the parser failed (uvicorn's fails alike, answers 400 and closes) or
        uvicorn handed the connection to a WebSocket protocol."""
        self._transport: asyncio.Transport
        self._reading_head = True
        """The bytes arriving belong to a head: from a connection's start or a request's end
        until the next request's headers are complete."""
        self._head_bytes = 0
        """Bytes received while reading a head, counted a read at a time."""
        self._parsed_head_bytes = 0
        """The current head's URL and headers as parsed so far, with their separators."""
        self._in_head = False
        """A head has begun and not ended (its timer is armed once a read ends with it
        incomplete: most heads arrive whole in one read, and need no timer)."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        """Told uvicorn to finish: on its close, ``_refusal`` is answered (None: nothing)."""
        self._refusal: int | None = None
        self._discarded_bytes: int | None = None
        """Bytes dropped since the refusal was written; None until then."""
        self._linger: asyncio.TimerHandle | None = None
        self.awaiting_first_request = True
        """No request's head has arrived whole on this connection yet."""

    # The asyncio protocol, forwarded to uvicorn's.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream's transport (uvloop's is no subclass of asyncio's classes).
        self._transport = cast(asyncio.Transport, transport)
        type(self).open_connections.add(self)
        self._start_head_timer()
        self._http.connection_made(_GuardedTransport(self._transport, self))

    def data_received(self, data: bytes) -> None:
        if self._discarded_bytes is not None:
            self._discarded_bytes += len(data)
            if self._discarded_bytes > LINGER_MAX_BYTES:
                self._transport.close()
            return
        if self._refused:
            return  # read before reading was paused: no request of it is answered
        if self._watching and not self._watched(data):
            return
        self._http.data_received(data)

    def eof_received(self) -> None:
        self._http.eof_received()  # then the transport closes, as under uvicorn

    def connection_lost(self, exc: Exception | None) -> None:
        type(self).open_connections.discard(self)
        self._stop_head_timer()
        if self._linger is not None:
            self._linger.cancel()
        self._refused = False  # nobody is left to answer
        self._http.connection_lost(exc)

    def pause_writing(self) -> None:
        self._http.pause_writing()

    def resume_writing(self) -> None:
        self._http.resume_writing()

    # The head watch.

    def _watched(self, data: bytes) -> bool:
        """Parse ``data`` for where heads begin and end; False if a head was refused."""
        if self._reading_head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # uvicorn's parser stops at the same byte, and upgrades or carries on
        except httptools.HttpParserError:
            if self._parsed_head_bytes > self.max_head_bytes:
                self._refuse(431)
                return False
            self._watching = False  # uvicorn meets the same error and answers 400
            self._stop_head_timer()
            return True
        if self._reading_head and self._head_bytes > self.max_head_bytes:
            self._refuse(431)
            return False
        if self._in_head and self._head_timer is None:
            self._start_head_timer()  # a later request's head, begun in this read, not ended
        return True

    def on_message_begin(self) -> None:
        self._in_head = True
        self._parsed_head_bytes = 0

    # A head over the limit, though it arrived within one read, stops the parse. (Counted in
    # each callback itself: they run for every header of every request.)

    def on_url(self, url: bytes) -> None:
        self._parsed_head_bytes += len(url)
        if self._parsed_head_bytes > self.max_head_bytes:
            raise _HeadTooLargeError

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_head_bytes += len(name) + len(value) + _HEADER_OVERHEAD_BYTES
        if self._parsed_head_bytes > self.max_head_bytes:
            raise _HeadTooLargeError

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._in_head = False
        self.awaiting_first_request = False
        self._stop_head_timer()

    def on_message_complete(self) -> None:
        # What follows on this connection is the next request's head.
        self._reading_head = True
        self._head_bytes = 0

    def _start_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or not self._reading_head:
            return
        self._refuse(408 if self._head_bytes or self._in_head else None)

    # The refusal.

    def _refuse(self, status: int | None) -> None:
        """Read no more, and let uvicorn finish the requests it holds and close; ``closed``
        then answers ``status`` (None: closes without an answer)."""
        self._stop_head_timer()
        self._refused = True
        self._refusal = status
        if self._transport.is_reading():
            self._transport.pause_reading()
        self._http.shutdown()  # closes at once if no request is in flight, else after it

    def closed(self) -> None:
        """uvicorn closed the connection: write a refusal due, then linger; else close."""
        transport = self._transport
        if not self._refused or self._refusal is None or transport.is_closing():
            transport.close()
            return
        transport.write(_refusal_answer(self._refusal, self, self._server_state))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._discarded_bytes = 0
        transport.resume_reading()
        self._linger = self._loop.call_later(LINGER_S, transport.close)

    def flush_soon(self, transport: _GuardedTransport) -> None:
        """``transport.flush()`` at the end of this loop turn."""
        self._loop.call_soon(transport.flush)

    def reading_resumed(self) -> None:
        """uvicorn resumes reading, unless a refusal is due."""
        if not self._refused:
            self._transport.resume_reading()

    def handed_over(self) -> None:
        """uvicorn upgraded the connection (a WebSocket): the head limits are done with it,
        and its end goes to the new protocol."""
        self._watching = False
        self._stop_head_timer()
        type(self).open_connections.discard(self)


def _refusal_answer(status: int, limits: HeadLimitedProtocol, server: ServerState) -> bytes:
    """A 408 or 431 with the service's JSON error body, closing the connection."""
    if status == 431:
        code = "request_header_fields_too_large"
        message = (
            f"the request line and headers exceed {limits.max_head_bytes} bytes; send "
            "smaller headers"
        )
    else:
        code = "request_timeout"
        message = f"the request line and headers did not arrive within {limits.head_timeout_s:g} s"
    body = orjson.dumps({"error": {"code": code, "message": message}})
    head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
    for name, value in server.default_headers:
        head.append(name + b": " + value + b"\r\n")
    head.append(b"content-type: application/json\r\n")
    head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(head) + body


#: A body up to this size is copied behind its held head to go out in one write; a larger
#: one is written after it (the copy would cost more than the second system call).
JOINED_BODY_BYTES = 256 * 1024


class _GuardedTransport(asyncio.Transport):
    """The transport uvicorn's protocol is given: the connection's own, except that closing
    it, resuming reading and handing it to another protocol go through the guard, and that
    an answer's head is held until its body comes, to go out with it in one write.

    uvicorn writes a response's head on ``http.response.start`` and its body on
    ``http.response.body``: two system calls and, over TCP, two segments for the client to
    wake up to. A head (a write starting ``HTTP/`` and ending in a blank line) waits for the
    next write, or for the end of the loop turn if none comes in it (a streamed answer)."""

    def __init__(self, transport: asyncio.Transport, guard: HeadLimitedProtocol) -> None:
        super().__init__()
        self._transport = transport
        self._guard = guard
        self._closing = False
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
            self._guard.flush_soon(self)
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Write a head still held (no body followed it in its loop turn)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def writelines(self, list_of_data: Any) -> None:
        self.flush()
        self._transport.writelines(list_of_data)

    def close(self) -> None:
        self.flush()
        if not self._closing:
            self._closing = True
            self._guard.closed()

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._guard.reading_resumed()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._guard.handed_over()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._closing = True
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


def limited_protocol(settings: Settings) -> type[HeadLimitedProtocol]:
    """The protocol class uvicorn builds for each connection, with the settings' limits."""
    return type(
        "HeadLimitedProtocol",
        (HeadLimitedProtocol,),
        {
            "max_head_bytes": settings.max_header_bytes,
            "head_timeout_s": settings.header_timeout_s,
            "open_connections": set(),
        },
    )
