"""The outermost layer of the service: request ids, request metrics, and the predict paths.

A plain ASGI middleware (``BaseHTTPMiddleware`` would cost a task per request). It answers
``POST`` on the inference routes (``inference_routes.INFERENCE_ROUTES``: ``/predict``,
``/models/{name}[/versions/{version}]/predict`` and the V2 ``infer`` routes) itself, through
``predict.serve_prediction`` or ``oip.rest.serve_v2_inference``: routing them through
FastAPI's exception, dependency and routing layers took half of the event loop's time per
request. Every other request goes on to the FastAPI app.
"""

from __future__ import annotations

import logging
import random
import re
import time

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import tracing
from service.errors import FrontendBusyError, ServiceError, forget_traceback
from service.frontend import request_spans
from service.frontend.answer_writing import send_answer, sends_whole
from service.frontend.inference_routes import INFERENCE_LABELS, RouteMatch, match_inference
from service.frontend.oip import rest as v2
from service.frontend.predict import PredictHeaders, serve_prediction
from service.frontend.refusal_hold import RefusalHolds
from service.frontend.requests import ClientDisconnectedError
from service.frontend.responses import internal_error_response, service_error_response
from service.frontend.state import FrontendState

logger = logging.getLogger(__name__)

#: nginx's code for "client closed the request": counted, never sent.
CLIENT_CLOSED_STATUS = 499
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ROUTES_WITH_METRICS = INFERENCE_LABELS | {"/healthz", "/readyz", "/models", "/metrics"}


class ServiceMiddleware:
    """Request id in ``X-Request-ID``, request count and latency by route and status."""

    def __init__(self, app: ASGIApp, frontend: FrontendState) -> None:
        self.app = app
        self.frontend = frontend
        self.tally = frontend.request_tally
        # Its own generator: code that seeds the global one (tests, libraries) must not make
        # request ids repeat.
        self._ids = random.Random()
        self.holds = RefusalHolds(frontend.settings.refusal_hold_ms)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if tracing.current is not None:
            route = traced_route(scope)
            if route is not None:
                await request_spans.serve_traced(self._serve, route, scope, receive, send)
                return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_of(scope, self._ids)
        scope.setdefault("state", {})["request_id"] = request_id
        route, found = route_of(scope["path"])
        status = 500
        started_s = time.perf_counter()

        async def send_with_request_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                if self.frontend.draining and all(
                    name.lower() != b"connection" for name, _ in headers
                ):
                    # A keep-alive client would send its next request to a closing socket.
                    headers.append((b"connection", b"close"))
                message["headers"] = headers
            await send(message)

        inference = found if scope["method"] == "POST" else None
        try:
            if inference is not None:
                self.tally.started()
                self.frontend.receiving += 1
                if inference.route.protocol == "v2":
                    response = await self._infer_v2(scope, receive, request_id, inference)
                else:
                    response = await self._predict(scope, receive, request_id, inference)
                if response is None:
                    status = CLIENT_CLOSED_STATUS
                elif sends_whole(response):
                    status = response.status_code
                    await send_answer(response, request_id, self.frontend.draining, send)
                else:
                    await response(scope, receive, send_with_request_id)
            else:
                await self.app(scope, receive, send_with_request_id)
        finally:
            if inference is not None:
                self.frontend.receiving -= 1
            self.tally.answered(
                route, str(status), time.perf_counter() - started_s, inference is not None
            )

    async def _predict(
        self,
        scope: Scope,
        receive: Receive,
        request_id: str,
        inference: RouteMatch,
    ) -> Response | None:
        """The prediction's response, an error response, or None if the client left."""
        try:
            self._check_capacity()
            return await serve_prediction(
                self.frontend,
                PredictHeaders.from_scope(scope),
                receive,
                request_id,
                scope.get("query_string", b""),
                inference.name,
                inference.version,
            )
        except ServiceError as error:
            await self.holds.hold(scope.get("client"), error)
            forget_traceback(error)
            return service_error_response(error, request_id)
        except ClientDisconnectedError:
            return None
        except Exception:
            logger.exception("unhandled_error", extra={"request_id": request_id})
            return internal_error_response(request_id)

    async def _infer_v2(
        self, scope: Scope, receive: Receive, request_id: str, inference: RouteMatch
    ) -> Response | None:
        """A V2 inference's response, its ``{"error": ...}`` response, or None if the client
        left."""
        try:
            self._check_capacity()
            headers = {
                name.decode("latin-1").lower(): value.decode("latin-1")
                for name, value in scope["headers"]
            }
            return await v2.serve_v2_inference(
                self.frontend, headers, receive, request_id, inference.name or "", inference.version
            )
        except ServiceError as error:
            await self.holds.hold(scope.get("client"), error)
            forget_traceback(error)
            return v2.error_response(error)
        except ClientDisconnectedError:
            return None
        except Exception:
            logger.exception("unhandled_error", extra={"request_id": request_id})
            return v2.error_response(ServiceError("internal server error"))

    def _check_capacity(self) -> None:
        limit = self.frontend.settings.max_requests_per_frontend
        if self.frontend.receiving > limit:
            raise FrontendBusyError(
                f"this front end holds {limit} requests already (max_requests_per_frontend);"
                " retry shortly"
            )


def route_of(path: str) -> tuple[str, RouteMatch | None]:
    """The route label of ``path`` in the request metrics, and the inference route it is on
    (with the model and version it names), if any."""
    found = match_inference(path)
    if found is not None:
        return found.route.label, found
    return (path if path in _ROUTES_WITH_METRICS else "other"), None


def traced_route(scope: Scope) -> str | None:
    """The route label of an inference request (``POST`` on an inference route): only those
    are traced."""
    if scope["method"] != "POST":
        return None
    found = match_inference(scope["path"])
    return None if found is None else found.route.label


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
