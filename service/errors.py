"""Errors the service answers with, each carrying its HTTP status and a stable code.

Messages are written for the client: they say what was wrong and what is accepted, and never
contain file-system paths or secrets.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Base of every error that maps to an HTTP answer."""

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
    """The body could not be parsed at all (malformed JSON, wrong content type)."""

    status_code = 400
    code = "bad_request"


class InvalidInputError(ServiceError):
    """The body parsed but does not match the model's input spec."""

    status_code = 422
    code = "invalid_input"


class DeadlineUnreachableError(InvalidInputError):
    """The request's instances alone need more compute than its deadline leaves: fewer
    instances per request would fit (gRPC answers it ``DEADLINE_EXCEEDED``)."""

    code = "deadline_unreachable"


class PayloadTooLargeError(ServiceError):
    status_code = 413
    code = "payload_too_large"
    closes_connection = True


class RequestTimeoutError(ServiceError):
    """The body did not arrive by the request's deadline."""

    status_code = 408
    code = "request_timeout"
    closes_connection = True


class UnsupportedMediaTypeError(ServiceError):
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
    """The operation cannot run now (another version is loading, nothing to roll back to)."""

    status_code = 409
    code = "conflict"


class ModelRejectedError(ServiceError):
    """A version failed its hash check or could not be built; the serving one is kept."""

    status_code = 422
    code = "model_rejected"


class ModelNotFoundError(ServiceError):
    """Unknown model name or version in the repository."""

    status_code = 404
    code = "model_not_found"


class RetryLaterError(ServiceError):
    """A refusal the client should retry after ``Retry-After`` seconds."""

    retry_after_s: int = 1

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        seconds = self.retry_after_s if retry_after_s is None else retry_after_s
        super().__init__(message, headers={"Retry-After": str(seconds)})


class QueueFullError(RetryLaterError):
    """The batcher's queue is full."""

    status_code = 429
    code = "queue_full"


class OverloadedError(RetryLaterError):
    """The work queued ahead would keep this request past its deadline."""

    status_code = 429
    code = "overloaded"


class DeadlineExceededError(ServiceError):
    status_code = 504
    code = "deadline_exceeded"


class NotReadyError(RetryLaterError):
    """No model is loaded yet, or the server is draining for shutdown."""

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
    """No engine can take the request: it died, hung or is restarting."""

    status_code = 503
    code = "engine_unavailable"


class InsufficientDeviceMemoryError(RetryLaterError):
    """The request ran out of device memory even in a batch of its own."""

    status_code = 503
    code = "out_of_device_memory"
    retry_after_s = 5


class InferenceError(ServiceError):
    """The model raised on this request's input; its batch-mates are unaffected."""

    status_code = 500
    code = "inference_failed"


class HandlerError(ServiceError):
    """The version's handler (pre- or post-processing) failed on this request, or cannot be
    loaded; other requests are unaffected."""

    status_code = 500
    code = "handler_failed"


class NotAcceptableError(ServiceError):
    """The ``Accept`` header asks for an answer format this model cannot give."""

    status_code = 406
    code = "not_acceptable"


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
