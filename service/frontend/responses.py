"""JSON answers, and the one mapping from errors to error responses that every route uses."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response

from service.errors import ServiceError

JSON = "application/json"


def json_response(
    content: object, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type=JSON, headers=headers)


class PreparedResponse(Response):
    """A ``Response`` whose headers come ready, as raw pairs (lower-case names, latin-1
    values): a prediction's answer skips Starlette's ``init_headers`` (a dict of headers
    lowered, encoded and scanned for each answer)."""

    def __init__(
        self, body: bytes, raw_headers: list[tuple[bytes, bytes]], status_code: int = 200
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = raw_headers


def json_answer(content: object, *raw_headers: tuple[bytes, bytes]) -> PreparedResponse:
    """``content`` as a 200 JSON answer with ``raw_headers`` (lower-case names, latin-1)."""
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return PreparedResponse(
        body,
        [*raw_headers, (b"content-length", b"%d" % len(body)), (b"content-type", _JSON_BYTES)],
    )


_JSON_BYTES = JSON.encode()


def error_response(
    status_code: int,
    code: str,
    message: str,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The JSON error every failure is answered with."""
    return json_response(
        {"error": {"code": code, "message": message, "request_id": request_id}},
        status_code=status_code,
        headers=headers,
    )


def service_error_response(error: ServiceError, request_id: str) -> Response:
    headers = error.headers
    if error.closes_connection:
        headers = {**headers, "Connection": "close"}
    return error_response(error.status_code, error.code, error.message, request_id, headers)


def internal_error_response(request_id: str) -> Response:
    """For an error nobody expected: logged where it happened, never described to the client."""
    return error_response(500, "internal_error", "internal server error", request_id)
