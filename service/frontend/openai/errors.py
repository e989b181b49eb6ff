"""Every error on the OpenAI-compatible routes, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

From the service's one taxonomy (``service/errors.py``): the status is the service's, except
that invalid input is OpenAI's 400 (the ``openai`` SDK's ``BadRequestError``; OpenAI answers
422 for nothing); ``code`` is the service's stable code; ``type`` is OpenAI's word for the
status; ``param`` names the request field at fault, when one is. ``Retry-After`` comes with
429 and 503, which the SDK retries after it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from service.errors import InvalidInputError, InvalidParameterError, ServiceError
from service.frontend.responses import json_response

#: The error answer, as the OpenAPI document states it for every OpenAI-compatible route.
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_error_response(error: ServiceError, request_id: str = "") -> Response:
    """``error`` in OpenAI's shape, with its status and headers."""
    status = 400 if isinstance(error, InvalidInputError) else error.status_code
    param = error.param if isinstance(error, InvalidParameterError) else None
    headers = error.headers
    if error.closes_connection:
        headers = {**headers, "Connection": "close"}
    body = {
        "error": {
            "message": error.message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": error.code,
        }
    }
    return json_response(body, status_code=status, headers=headers)


def invalid_request(error: ValidationError) -> InvalidParameterError:
    """A body that does not fit the request's schema, as one error naming its first problem:
    an unknown field first (the likeliest mistake: a setting batchserve does not serve)."""
    problems = error.errors()
    unknown = [problem for problem in problems if problem["type"] == "extra_forbidden"]
    problem = (unknown or problems)[0]
    # A union's members show in the location by their type (``str``, ``list[int]``): not a
    # field. A value that fits none of them is described by its field's accepted types.
    path = [str(part) for part in problem["loc"] if not _is_union_member(part)]
    param = ".".join(path) or "body"
    if unknown:
        return InvalidParameterError(
            param, f"unknown field {param!r}: batchserve does not serve it (see /docs)"
        )
    given = repr(problem.get("input"))
    given = given if len(given) <= 60 else given[:59] + "…"
    if any(_is_union_member(part) for part in problem["loc"]):
        return InvalidParameterError(
            param, f"{param} is none of the types it may be (see /docs), got {given}"
        )
    return InvalidParameterError(param, f"{param}: {problem['msg']}, got {given}")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_member(part: int | str) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)
