"""The access log: one JSON line per answered request, over HTTP or gRPC, while the
``access_log`` setting is on.

Lines go to the ``batchserve.access`` logger, so they can be routed or filtered apart from the
service's other lines (and are written whatever ``log_level`` says). A line names the request
(method, route template, path, client address), its answer (status, the model and version
that answered, duration) and its ids (request id; trace and span ids while it was traced).
Sizes are those the ``content-length`` headers state (None where there is none, as for a
streamed answer). Bodies, query strings and other header values are never written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from starlette.types import Scope

from service.logs import ACCESS_LOGGER

#: The event name (``"event"``) of every access-log line.
ACCESS_EVENT = "request"
#: Where a traced HTTP request's state keeps its trace and span ids (``request_spans``).
TRACE_IDS_STATE = "trace_ids"

logger = logging.getLogger(ACCESS_LOGGER)


def log_http(
    scope: Scope, status: int, duration_s: float, answer_headers: Iterable[tuple[bytes, bytes]]
) -> None:
    """The line of an HTTP request answered ``status`` with ``answer_headers`` (none when its
    client left first). Its model and version are those its ``X-Model-Version`` names, else
    the model its path names."""
    model, version = _model_and_version(answer_headers)
    if model is None:
        model = scope.get("path_params", {}).get("name")
    state = scope.get("state", {})
    fields: dict[str, Any] = {
        "protocol": "http",
        "method": scope["method"],
        "route": getattr(scope.get("route"), "path", None),
        "path": scope["path"],
        "status": status,
        "model": model,
        "version": version,
        "duration_ms": round(duration_s * 1000, 3),
        "request_id": state.get("request_id"),
        "client": _address(scope.get("client")),
        "request_bytes": _content_length(scope["headers"]),
        "response_bytes": _content_length(answer_headers),
        **state.get(TRACE_IDS_STATE, {}),
    }
    logger.info(ACCESS_EVENT, extra=fields)


def log_grpc(
    method: str,
    status: int,
    duration_s: float,
    *,
    request_id: str | None,
    model: str | None,
    version: str | None,
    peer: str | None,
    sizes: tuple[int, int | None],
) -> None:
    """The line of a gRPC call of ``method`` (``/package.Service/Method``), its status as the
    request metrics count it (the HTTP status its error maps to). ``sizes``: the request's and
    the reply's serialized bytes (None without a reply). Written inside the call's span while
    it is traced, so the log record factory adds its trace and span ids."""
    request_bytes, response_bytes = sizes
    fields: dict[str, Any] = {
        "protocol": "grpc",
        "method": "POST",
        "route": method,
        "path": method,
        "status": status,
        "model": model,
        "version": version,
        "duration_ms": round(duration_s * 1000, 3),
        "request_id": request_id,
        "client": _grpc_address(peer),
        "request_bytes": request_bytes,
        "response_bytes": response_bytes,
    }
    logger.info(ACCESS_EVENT, extra=fields)


def _model_and_version(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    for name, value in headers:
        if name.lower() == b"x-model-version":
            model, _, version = value.decode("latin-1").rpartition("@")
            return model, version
    return None, None


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _address(client: tuple[str, int] | None) -> str | None:
    if client is None:
        return None
    host, port = client
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _grpc_address(peer: str | None) -> str | None:
    """``127.0.0.1:5000`` for grpc's ``ipv4:127.0.0.1:5000`` (``[::1]:5000`` for ``ipv6:``)."""
    if not peer:
        return None
    return peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
