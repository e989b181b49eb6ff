"""How the inference routes are served over HTTP, whichever protocol they speak (``/predict``
and its model routes, V2 ``infer``).

``DirectRoute``: the route class they are registered with, in the app's router like any
other. FastAPI documents them from that registration and answers what they do not (a method
other than ``POST``: 405); their handlers are called with the request and its path parameters
as they are, and a request they answer is served by ``DirectRoute.serve`` straight from the
middleware (``app.ServingApp``).

``answer_inference``: what every inference request goes through. It is counted in flight;
refused (503) when the front end holds its limit of requests; traced, while tracing is on; a
refusal for load is held for a client that resends before its ``Retry-After`` has passed
(``refusal_hold``); and every failure is answered in the protocol's own error shape, an
unexpected one logged with the request id and described to the client only as an internal
error. A client that leaves before its answer gets none (``CLIENT_CLOSED_STATUS``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service import tracing
from service.errors import FrontendBusyError, ServiceError, forget_traceback
from service.frontend import request_spans
from service.frontend.inference_routes import INFERENCE_LABELS
from service.frontend.requests import ClientDisconnectedError
from service.frontend.state import FrontendState

logger = logging.getLogger(__name__)

#: nginx's code for "client closed the request": counted in the request metrics, never sent.
CLIENT_CLOSED_STATUS = 499

ErrorAnswer = Callable[[ServiceError, str], Response]
"""A protocol's answer to an error, given the request id."""
Serve = Callable[[FrontendState, str], Awaitable[Response]]
"""A protocol's answer to an inference request, given the front end and the request id."""


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose endpoint is awaited with the request and the path's parameters
    (strings), and nothing else: FastAPI solves no dependencies and validates nothing per
    request, which cost more than all the rest of a front end's work on a request. The
    endpoint reads and checks its headers and body itself."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.respond

    async def respond(self, request: Request) -> Response:
        """The endpoint's answer to ``request``."""
        response: Response = await self.endpoint(request, **request.path_params)
        return response

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a request this route fully matched (``scope`` updated with the match), as
        an ASGI app: the request, the endpoint's answer, sent."""
        request = Request(scope, receive)
        response: Response = await self.endpoint(request, **request.path_params)
        await response(scope, receive, send)


class NoAnswer(Response):
    """What a request whose client has left is answered with: nothing at all (the request
    metrics count it ``CLIENT_CLOSED_STATUS``)."""

    def __init__(self) -> None:
        super().__init__(status_code=CLIENT_CLOSED_STATUS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


def answer_inference(
    request: Request, serve: Serve, error_answer: ErrorAnswer
) -> Awaitable[Response]:
    """``serve``'s answer to ``request``, or ``error_answer``'s to what it raised."""
    if tracing.current is None:
        return _answered(request, serve, error_answer)
    route = INFERENCE_LABELS[request.scope["route"].path]
    answer = partial(_answered, request, serve, error_answer)
    return request_spans.answer_traced(request.scope, route, answer)


async def _answered(request: Request, serve: Serve, error_answer: ErrorAnswer) -> Response:
    frontend: FrontendState = request.app.state.frontend
    request_id: str = request.scope["state"]["request_id"]  # ServiceMiddleware's
    tally = frontend.request_tally
    tally.started()
    frontend.receiving += 1
    try:
        limit = frontend.settings.max_requests_per_frontend
        if frontend.receiving > limit:
            raise FrontendBusyError(
                f"this front end holds {limit} requests already (max_requests_per_frontend);"
                " retry shortly"
            )
        return await serve(frontend, request_id)
    except ServiceError as error:
        await frontend.refusal_holds.hold(request.scope.get("client"), error)
        forget_traceback(error)
        return error_answer(error, request_id)
    except ClientDisconnectedError:
        return NoAnswer()
    except Exception:
        logger.exception("unhandled_error", extra={"request_id": request_id})
        return error_answer(ServiceError("internal server error"), request_id)
    finally:
        frontend.receiving -= 1
        tally.stopped()
