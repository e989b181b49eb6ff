"""How the middleware sends an inference request's answer: its headers with the request id
(and ``connection: close`` while draining) built once, and the whole answer handed to the
server in one call where the server can take it.

Starlette's ``Response.__call__`` sends two ASGI messages, which the middleware's wrapper
around ``send`` copied to add the request id, and which uvicorn then checked header by header
and wrote in two steps. ``send_answer`` sends the same status, headers (in the same order)
and body: to a ``WholeAnswerWriter`` (the server's response cycle, ``server.answers``) as one
call, to any other ``send`` (a test's, a tracing wrapper's) as the two messages.
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Send

from service.frontend.responses import PreparedResponse

RawHeaders = list[tuple[bytes, bytes]]

_CLOSE = (b"connection", b"close")


class WholeAnswerWriter:
    """What an ASGI ``send`` may be a bound method of: a connection's response cycle that
    writes a whole answer at once. A plain class, not an ABC: ``isinstance`` on an ABC costs
    a microsecond per answer."""

    async def send_whole(
        self, status_code: int, headers: RawHeaders, body: bytes | memoryview, checked: bool
    ) -> None:
        """Write the answer ``http.response.start`` (``status_code``, ``headers``) then
        ``http.response.body`` (``body``) would; ``checked`` when every header's name and value
        is known to hold only characters HTTP allows in them."""
        raise NotImplementedError


def sends_whole(response: Response) -> bool:
    """Whether ``send_answer`` sends ``response`` as its own ``__call__`` would: a plain
    ``Response`` (or ``PreparedResponse``) with its body whole and no background task."""
    kind = type(response)
    return (kind is Response or kind is PreparedResponse) and response.background is None


async def send_answer(response: Response, request_id: str, draining: bool, send: Send) -> None:
    """``response`` (one ``sends_whole`` accepts) sent with ``x-request-id`` and, while
    ``draining``, ``connection: close`` unless it has a ``connection`` header (a keep-alive
    client would send its next request to a closing socket). ``request_id`` is
    ``middleware.request_id_of``'s: a token of letters, digits, ``.``, ``_`` and ``-``; with a
    ``PreparedResponse``'s headers, built from values validated already, the writer need not
    check them again."""
    headers = [*response.raw_headers, (b"x-request-id", request_id.encode())]
    if draining and all(name.lower() != b"connection" for name, _ in headers):
        headers.append(_CLOSE)
    writer = getattr(send, "__self__", None)
    if isinstance(writer, WholeAnswerWriter):
        await writer.send_whole(
            response.status_code, headers, response.body, type(response) is PreparedResponse
        )
        return
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
