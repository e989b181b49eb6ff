"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the
status, for every OpenAI-compatible route (``/v1/embeddings``, and the generation routes).

The error is the service's own (``service/errors.py``), with its status and headers
(``Retry-After``); its ``code`` is the taxonomy's, and its ``type`` the class of error
OpenAI's clients tell apart: ``invalid_request_error`` for what the client sent,
``rate_limit_error`` for a 429 (the SDK retries it after ``Retry-After``), ``server_error``
for the rest.
"""

from __future__ import annotations

from starlette.responses import Response

from service.errors import ServiceError
from service.frontend.responses import json_response


class ParamError(ServiceError):
    """A field of an OpenAI request is wrong: 400, naming the field in ``param``."""

    status_code = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def error_type(status_code: int) -> str:
    """OpenAI's ``type`` for an error of ``status_code``."""
    if status_code == 401:
        return "authentication_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def openai_error_response(error: ServiceError, request_id: str) -> Response:
    """``error`` in OpenAI's shape, with its status and headers (``X-Request-ID`` is added
    by the middleware); a ``ParamError`` names its field."""
    headers = dict(error.headers)
    if error.closes_connection:
        headers["Connection"] = "close"
    content = {
        "error": {
            "message": error.message,
            "type": error_type(error.status_code),
            "param": getattr(error, "param", None),
            "code": error.code,
        }
    }
    return json_response(content, status_code=error.status_code, headers=headers)
