"""``HEAD`` answered as ``GET`` without its body, on every route that answers ``GET``.

FastAPI's routes answer only the methods they declare, so ``HEAD /healthz`` was 405, though
HTTP says a server answering ``GET`` should answer ``HEAD`` (RFC 9110, 9.3.2) and load
balancers and uptime checks send it. The route runs as for ``GET`` and its headers
(``Content-Length`` included) are sent; its body is not.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """ASGI middleware: a ``HEAD`` request runs as ``GET``, and its answer has no body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)
