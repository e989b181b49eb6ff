"""uvicorn's httptools protocol with a cap on a request's head and a time to receive it.

uvicorn's httptools protocol has neither: a 100 MB header was answered 200 (the front end
holding it in memory), and connections that sent half a request line, or a header a byte a
second, stayed open for as long as the client liked. Here, per connection:

- a request's head (request line and headers) larger than ``max_bytes`` is answered 431 and
  the connection closed, as soon as that many bytes have arrived without the head ending;
- a head must arrive whole within ``timeout_s`` of the connection opening or of its first
  byte (later requests on a kept-alive connection); else 408 and the connection is closed
  (closed silently if not a byte came). Idle keep-alive connections close after uvicorn's
  ``timeout_keep_alive``. Slow bodies are cut by the request's deadline (``read_body``).

Its answers are written as ``answers`` says: head and body in one system call, and the whole
answer of an inference request in one call from the middleware (``AnswerCycle``).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.config import Settings
from service.server.answers import AnswerCycle, HeadHeldTransport

#: What a response's status line says, for the two statuses answered here.
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
#: After a refusal, how long and how much the client's further bytes are read and dropped
#: before the connection closes: closing with unread bytes would reset it (RST), and the
#: client would lose the answer (nginx's lingering close).
LINGER_S = 2.0
LINGER_MAX_BYTES = 4 * 1024 * 1024
#: The bytes each header adds to the head besides its name and value (": " and CRLF).
_HEADER_OVERHEAD_BYTES = 4


class _HeadTooLargeError(Exception):
    """Raised from a parser callback to stop parsing a head over the limit."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol for one connection; ``limited_protocol`` sets the limits."""

    max_head_bytes: ClassVar[int] = 32 * 1024
    head_timeout_s: ClassVar[float] = 5.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._reading_head = True
        self._received_head_bytes = 0
        """Bytes received since the head began: all head, while it has not ended."""
        self._head_too_large = False
        self._in_head = False
        """A head has begun and not ended (its timer is armed once a ``data_received`` ends
        with it incomplete: most heads arrive whole in one, and need no timer)."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._discarded_bytes: int | None = None
        """Bytes dropped since a refusal; None until one."""
        self._head_held: HeadHeldTransport
        self._idle_deadline_s: float | None = None
        """When an idle kept-alive connection is closed (loop time); None while busy."""
        self._idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_held = HeadHeldTransport(transport, self.loop)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive timeout kept by ``_idle_deadline_s``: uvicorn arms
        a timer at each answer and cancels it at the next request's first bytes (two micro-
        seconds a request); here one timer per connection, moved on when it fires early."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_deadline_s = self.loop.time() + self.timeout_keep_alive
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_at(self._idle_deadline_s, self._idle_timer_fired)

    def _unset_keepalive_if_required(self) -> None:
        """Busy (bytes came, or the connection is gone): not to be closed as idle."""
        self._idle_deadline_s = None

    def _idle_timer_fired(self) -> None:
        self._idle_timer = None
        deadline_s = self._idle_deadline_s
        if deadline_s is None:
            return  # busy since: the next answer sets a deadline and a timer
        if self.loop.time() < deadline_s:
            self._idle_timer = self.loop.call_at(deadline_s, self._idle_timer_fired)
            return
        self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head's bytes counted and a head over the limit answered 431."""
        if self._discarded_bytes is not None:
            self._discarded_bytes += len(data)
            if self._discarded_bytes > LINGER_MAX_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._reading_head:
            self._received_head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._head_too_large:
                self._refuse(431)
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)
            return
        if self._reading_head and self._received_head_bytes > self.max_head_bytes:
            self._refuse(431)
            return
        if self._in_head and self._head_timer is None:
            self._start_head_timer()  # a later request's head, begun in this data, not ended

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head = True
        self._in_head = True

    def on_headers_complete(self) -> None:
        """Refuses a head over the limit that ended within one read (a head still incomplete
        is counted in ``data_received``): its exact size, the URL and each header's name
        and value with their separators, counted once it is whole rather than header by
        header as it is parsed."""
        parsed = len(self.url) + _HEADER_OVERHEAD_BYTES * len(self.headers)
        for name, value in self.headers:
            parsed += len(name) + len(value)
        if parsed > self.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLargeError
        self._reading_head = False
        self._in_head = False
        if self._head_timer is not None:
            self._stop_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            # One per connection: its responses are written one after another.
            cycle.transport = self._head_held
            # uvicorn builds its cycle in ``on_headers_complete``; ``AnswerCycle`` only adds
            # methods, so the cycle becomes one in place rather than through a copy of
            # uvicorn's 40 lines.
            cycle.__class__ = AnswerCycle

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What follows on this connection is the next request's head.
        self._reading_head = True
        self._received_head_bytes = 0

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head trickling in behind a request still being answered: answer
            # that one, then close instead of waiting for this one.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        if self._received_head_bytes == 0:
            self.transport.close()  # nothing was asked: nobody to answer
            return
        self._refuse(408)

    def _refuse(self, status: int) -> None:
        """Answer ``status`` with the service's JSON error body, and close the connection."""
        if status == 431:
            code = "request_header_fields_too_large"
            message = (
                f"the request line and headers exceed {self.max_head_bytes} bytes; send "
                "smaller headers"
            )
        else:
            code = "request_timeout"
            message = (
                f"the request line and headers did not arrive within {self.head_timeout_s:g} s"
            )
        body = orjson.dumps({"error": {"code": code, "message": message}})
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self._stop_head_timer()
        self.transport.write(b"".join(head) + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._discarded_bytes = 0
        self.loop.call_later(LINGER_S, self.transport.close)


def limited_protocol(settings: Settings) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn builds for each connection, with the settings' limits."""
    return type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {
            "max_head_bytes": settings.max_header_bytes,
            "head_timeout_s": settings.header_timeout_s,
        },
    )
