"""The outermost layer of every HTTP request: its request id, the ``x-request-id`` of its answer
(with ``connection: close`` while the front end drains), the request metrics by route and
status, and its access-log line while the access log is on (``access_log``).

A plain ASGI middleware (``BaseHTTPMiddleware`` would cost a task per request), outside
FastAPI's error handling, so that its 500s carry a request id and are counted too. The route
of a request is the route object that took it (``scope["route"]``, set by FastAPI's router or
by ``ServingApp``'s short way to the inference routes): routes outside the request metrics'
list are counted as ``other``.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.frontend import access_log, request_spans
from service.frontend.inference import CLIENT_CLOSED_STATUS
from service.frontend.inference_routes import INFERENCE_LABELS
from service.frontend.routing import ROUTING_STATE
from service.frontend.state import FrontendState

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: The routes counted by themselves in the request metrics, by their paths.
ROUTE_LABELS = INFERENCE_LABELS | {
    path: path for path in ("/healthz", "/readyz", "/models", "/metrics")
}


class ServiceMiddleware:
    """Request id in ``X-Request-ID``, request count and latency by route and status, and
    the access log."""

    def __init__(self, app: ASGIApp, frontend: FrontendState) -> None:
        self.app = app
        self.frontend = frontend
        self.tally = frontend.request_tally
        self.access_log = frontend.settings.access_log
        # Its own generator: code that seeds the global one (tests, libraries) must not make
        # request ids repeat.
        self._ids = random.Random()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope, self._ids)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status: int | None = None
        answer_headers: Sequence[tuple[bytes, bytes]] = ()  # the access log's, once answered
        started_s = time.perf_counter()

        async def send_with_request_id(message: Message) -> None:
            nonlocal status, answer_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                if self.frontend.draining and all(
                    name.lower() != b"connection" for name, _ in headers
                ):
                    # A keep-alive client would send its next request to a closing socket.
                    headers.append((b"connection", b"close"))
                message["headers"] = answer_headers = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_request_id)
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            # An app that returned without an answer did so because its client had left.
            answered = CLIENT_CLOSED_STATUS if status is None else status
            latency_s = time.perf_counter() - started_s
            exemplar = state.get(request_spans.EXEMPLAR_STATE)
            routing = state.get(ROUTING_STATE)
            if routing is not None:  # before the tally's answer, whose flush writes it
                self.frontend.answered_with(routing, answered)
            self.tally.answered(route_label(scope), str(answered), latency_s, exemplar)
            if self.access_log:
                access_log.log_http(scope, answered, latency_s, answer_headers)


def route_label(scope: Scope) -> str:
    """The route of an answered request in the request metrics: its inference route's label,
    the path of a route counted by itself, else ``other``."""
    return ROUTE_LABELS.get(getattr(scope.get("route"), "path", ""), "other")


def request_id_of(scope: Scope, ids: random.Random) -> str:
    """The client's ``X-Request-ID`` when it sent one plain token, else a fresh random one
    (a repeated header is refused on ``/predict``; its answer still needs an id)."""
    given: bytes | None = None
    copies = 0
    for name, value in scope["headers"]:  # a loop: a comprehension is a call more
        if name == b"x-request-id":
            given = value
            copies += 1
    if copies == 1 and given is not None:
        candidate = given.decode("latin-1")
        if _CLIENT_REQUEST_ID.fullmatch(candidate):
            return candidate
    # Unique enough to find a request in the logs; no system call per request. ``%``
    # formats faster than an f-string's format spec.
    return "%032x" % ids.getrandbits(128)  # noqa: UP031
