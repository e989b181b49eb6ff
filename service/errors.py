"""Errors the service answers with, each carrying its HTTP status and a stable code.

Messages are written for the client: they say what was wrong and what is accepted, and never
contain file-system paths or secrets.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Anything unexpected in the server (a bug): logged with the request id, never sent to
    the client beyond a generic message."""

    status_code: int = 500
    code: str = "internal_error"
    closes_connection: bool = False
    """Answered with ``Connection: close``: what the client sends next on this connection
    cannot be trusted to start a request (an unread body, a body still arriving)."""

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def to_wire(self) -> dict[str, Any]:
        """The error as it crosses the bridge; ``from_wire`` rebuilds it on the other side."""
        return {
            "status": self.status_code,
            "code": self.code,
            "message": self.message,
            "headers": self.headers,
        }


def forget_traceback(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and the exceptions it was raised during, once it is
    answered. A frame of its own traceback often holds it (``refused = ...; raise refused``, a
    future's exception): a reference cycle of the exception, its frames and all they hold,
    which only the garbage collector frees: in a storm of refusals, collections that pause
    the event loop."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__context__


def error_from_wire(document: dict[str, Any]) -> ServiceError:
    """The error an engine sent, as the class its code names (``QueueFullError`` for
    ``queue_full``), with the same status, message and headers."""
    code, status = str(document["code"]), int(document["status"])
    kind = _ERROR_CLASSES.get((code, status), ServiceError)
    error = kind.__new__(kind)
    ServiceError.__init__(
        error, str(document["message"]), headers=dict(document.get("headers") or {})
    )
    error.status_code, error.code = status, code
    return error


class BadRequestError(ServiceError):
    """The body could not be parsed at all: malformed JSON (the literals ``NaN`` and
    ``Infinity`` included), a ``.npy`` body that is not one readable array; or a header that
    must appear once (``Content-Type``, ``X-Priority``, ``X-Request-ID``) is repeated."""

    status_code = 400
    code = "bad_request"


class InvalidInputError(ServiceError):
    """The body parsed but does not match the model's inputs: wrong shape, non-numbers,
    values not finite or outside the declared range, empty or too many instances, unknown
    fields or query parameters, inputs missing or of unequal lengths, an image that is not a
    PNG or JPEG. The message names what was expected and what was received."""

    status_code = 422
    code = "invalid_input"


class InvalidParameterError(InvalidInputError):
    """A generation request's parameter of the wrong type or out of its range (``max_tokens``,
    ``temperature``, ``messages``...); ``param`` names it, as OpenAI's error shape reports."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class DeadlineUnreachableError(InvalidInputError):
    """The request's instances alone need more compute than its deadline leaves, by the
    timings measured: refused at once, never computed. Sent again unchanged it fails again,
    so it is 422 (send fewer instances per request, or allow a longer deadline), not a 504
    that gateways and clients retry; gRPC answers ``DEADLINE_EXCEEDED``."""

    code = "deadline_unreachable"


class PayloadTooLargeError(ServiceError):
    """The body is over ``max_body_bytes`` (by ``Content-Length``, or while it streams), or
    an image or ``.npz`` would decode to more than allowed. The connection is closed: nothing
    after it is read."""

    status_code = 413
    code = "payload_too_large"
    closes_connection = True


class RequestTimeoutError(ServiceError):
    """The body did not arrive by the request's deadline; the connection is closed."""

    status_code = 408
    code = "request_timeout"
    closes_connection = True


class UnsupportedMediaTypeError(ServiceError):
    """A ``Content-Type`` other than JSON, ``.npy`` and ``.npz``, or what the version's
    handler reads (text, images)."""

    status_code = 415
    code = "unsupported_media_type"


class UnauthorizedError(ServiceError):
    """A missing or wrong bearer token on an admin route."""

    status_code = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(ServiceError):
    """The admin API is disabled (no token configured)."""

    status_code = 403
    code = "forbidden"


class ConflictError(ServiceError):
    """An admin change that cannot be made: another is under way, nothing was served before
    to roll back to, a version does not fit in ``device_memory_budget_mb``, the model to
    unload is the only one served, or the version to shadow is the one served."""

    status_code = 409
    code = "conflict"


class ModelRejectedError(ServiceError):
    """A version failed its hash check or could not be built; the serving one is kept."""

    status_code = 422
    code = "model_rejected"


class ModelNotFoundError(ServiceError):
    """An unknown model or version (or one not served), or a name that is not a plain
    identifier."""

    status_code = 404
    code = "model_not_found"


class RetryLaterError(ServiceError):
    """A refusal the client should retry after ``Retry-After`` seconds."""

    retry_after_s: int = 1

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        seconds = self.retry_after_s if retry_after_s is None else retry_after_s
        super().__init__(message, headers={"Retry-After": str(seconds)})


class QueueFullError(RetryLaterError):
    """The model's queue holds ``max_queue_size`` instances already."""

    status_code = 429
    code = "queue_full"


class OverloadedError(RetryLaterError):
    """The work queued ahead would keep this request past its deadline."""

    status_code = 429
    code = "overloaded"


class DeadlineExceededError(ServiceError):
    """The request's deadline (``request_timeout_ms``, or a shorter V2 ``timeout`` or gRPC
    deadline) passed before it was answered; one still queued is never computed."""

    status_code = 504
    code = "deadline_exceeded"


class NotReadyError(RetryLaterError):
    """The model is not served yet (loading), failed to load, or the server is draining."""

    status_code = 503
    code = "not_ready"


class VersionSwitchedError(NotReadyError):
    """The request was prepared for a version switched away from before it was queued, and
    the version served now would prepare or answer it otherwise (another tokenizer, handler
    or tensors). ``/predict`` prepares it again for the version served, once."""

    code = "version_switched"


class FrontendBusyError(RetryLaterError):
    """The front end holds ``max_requests_per_frontend`` requests already."""

    status_code = 503
    code = "too_many_requests_in_progress"
    closes_connection = True


class EngineUnavailableError(RetryLaterError):
    """No engine can take the request: it died, hung or is restarting. An admin change that
    cannot be decided now (an engine restarting) or whose engine was lost before the change
    was recorded (it did not take place) is answered this too."""

    status_code = 503
    code = "engine_unavailable"


class InsufficientDeviceMemoryError(RetryLaterError):
    """The request ran out of device memory even in a batch of its own."""

    status_code = 503
    code = "out_of_device_memory"
    retry_after_s = 5


class InferenceError(ServiceError):
    """The model raised on this request's input, or gave values that are not finite for it;
    its batch-mates are still answered."""

    status_code = 500
    code = "inference_failed"


class HandlerError(ServiceError):
    """The version's handler (pre- or post-processing) failed on this request, or cannot be
    loaded; other requests are unaffected."""

    status_code = 500
    code = "handler_failed"


class NotAcceptableError(ServiceError):
    """The ``Accept`` header asks for an answer format this model cannot give (``.npy`` from
    a model with several outputs: ask for ``.npz``)."""

    status_code = 406
    code = "not_acceptable"


#: The gRPC status each HTTP status is answered with (anything else: ``INTERNAL``).
GRPC_STATUS_BY_HTTP: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "FAILED_PRECONDITION",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def grpc_status_name(error: type[ServiceError]) -> str:
    """The gRPC status code (its name) ``error`` is answered with over gRPC."""
    if issubclass(error, DeadlineUnreachableError):
        return "DEADLINE_EXCEEDED"  # gRPC's status for "cannot finish by the deadline"
    return GRPC_STATUS_BY_HTTP.get(error.status_code, "INTERNAL")


def documented_errors() -> list[type[ServiceError]]:
    """Every error a client can be answered with, once per (code, status), by HTTP status."""
    return sorted(_ERROR_CLASSES.values(), key=lambda cls: (cls.status_code, cls.code))


class ModelIntegrityError(Exception):
    """A model's files do not match the hashes in its manifest, or cannot be read; never served."""


class ModelLoadError(Exception):
    """A model's manifest is valid but the model cannot be built (architecture, format, device)."""


class DeviceOutOfMemoryError(Exception):
    """The runner's device ran out of memory on a batch; the batcher splits it and retries."""


def _every_subclass(cls: type[ServiceError]) -> list[type[ServiceError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _every_subclass(child))]


#: Each concrete error by its (code, status), to rebuild errors that crossed the bridge.
_ERROR_CLASSES: dict[tuple[str, int], type[ServiceError]] = {
    (cls.code, cls.status_code): cls for cls in reversed(_every_subclass(ServiceError))
}
