"""Spans of one inference request in a front end (HTTP and gRPC), while tracing is on.

The server span continues the client's W3C ``traceparent`` and is current while the request is
handled (from its route's handler to its answer, built), so its children (``parse``, and
``engine`` in one process or ``bridge`` to an engine process), its ``body_read`` event and
every log line belong to it. After the engine answers,
the request span records each batch that computed it (span id and rows, and a link to it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.responses import Response
from starlette.types import Scope

from service import tracing
from service.bridge.interface import InferenceRequest, InferenceResult
from service.frontend.access_log import TRACE_IDS_STATE
from service.frontend.state import FrontendState

T = TypeVar("T")

_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
#: Where a traced HTTP request's state keeps its exemplar (``tracing.current_exemplar``) for
#: the request metrics, which observe its latency once its span has ended.
EXEMPLAR_STATE = "trace_exemplar"
_NOT_TRACED: contextlib.nullcontext[None] = contextlib.nullcontext()


async def answer_traced(
    scope: Scope, route: str, answer: Callable[[], Awaitable[Response]]
) -> Response:
    """``answer()`` an HTTP request inside its server span; the span's exemplar for the
    request's latency is left in its state (``EXEMPLAR_STATE``)."""
    assert tracing.current is not None
    carrier = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name in _TRACE_HEADERS
    }
    state = scope.setdefault("state", {})
    with tracing.current.tracer.start_as_current_span(
        f"{scope['method']} {route}",
        context=tracing.context_from(carrier),
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": scope["method"],
            "http.route": route,
            "url.path": scope["path"],
        },
    ) as span:
        try:
            response = await answer()
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return response
        finally:
            request_id = state.get("request_id")
            if request_id is not None:
                span.set_attribute("batchserve.request_id", request_id)
            state[EXEMPLAR_STATE] = tracing.current_exemplar()
            ids = span.get_span_context()
            state[TRACE_IDS_STATE] = {
                "trace_id": format(ids.trace_id, "032x"),
                "span_id": format(ids.span_id, "016x"),
            }


async def serve_traced_grpc(
    answer: Callable[[], Awaitable[T]], method: str, metadata: Iterable[tuple[str, str | bytes]]
) -> T:
    """``answer()`` a gRPC call inside its server span, continuing a ``traceparent`` sent in
    the call's metadata."""
    assert tracing.current is not None
    carrier = {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in metadata
        if key in ("traceparent", "tracestate")
    }
    with tracing.current.tracer.start_as_current_span(
        method,
        context=tracing.context_from(carrier),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.method": method.rsplit("/", 1)[-1]},
    ):
        return await answer()


def event(name: str, attributes: dict[str, int | str]) -> None:
    """An event on the current span while tracing is on (cheaper than a span)."""
    if tracing.current is not None:
        trace.get_current_span().add_event(name, attributes)


def child(name: str) -> contextlib.AbstractContextManager[object]:
    """A child span of the current one while it is recorded (sampled); nothing otherwise:
    the children of a request left out by the sampler would be left out too, and creating
    them cost a fifth of the request's time."""
    if tracing.current is None or not trace.get_current_span().is_recording():
        return _NOT_TRACED
    return tracing.current.tracer.start_as_current_span(name)


def current_traceparent() -> str | None:
    """The current span's W3C trace context while it is recorded (an engine's spans for the
    request become its children); None otherwise."""
    if tracing.current is None:
        return None
    span = trace.get_current_span()
    return tracing.traceparent_of(span) if span.is_recording() else None


async def infer(frontend: FrontendState, request: InferenceRequest) -> InferenceResult:
    """``frontend.engine.infer(request)``; while tracing, inside a span (``engine`` in this
    process, ``bridge`` to an engine process) whose context travels with the request, and the
    batches that computed it recorded on the request span."""
    if tracing.current is None:
        return await frontend.engine.infer(request)
    request_span = trace.get_current_span()
    if not request_span.is_recording():
        return await frontend.engine.infer(request)
    in_process = frontend.engine_in_process
    with tracing.current.tracer.start_as_current_span(
        "engine" if in_process else "bridge",
        kind=SpanKind.INTERNAL if in_process else SpanKind.CLIENT,
        attributes={"batchserve.model": request.model, "batchserve.model.version": request.version},
    ) as span:
        traced = dataclasses.replace(request, traceparent=tracing.traceparent_of(span))
        result = await frontend.engine.infer(traced)
    record_batches(request_span, result)
    return result


def record_batches(span: trace.Span, result: InferenceResult) -> None:
    """The batches that computed ``result``: their span ids and this request's rows in each
    as attributes, and a link to each batch span."""
    if not result.batches or not span.is_recording():
        return
    span.set_attribute(
        "batchserve.batch.span_ids", [traceparent[36:52] for traceparent, _ in result.batches]
    )
    span.set_attribute("batchserve.batch.rows", [rows for _, rows in result.batches])
    for traceparent, rows in result.batches:
        span.add_link(tracing.span_context_from(traceparent), {"batchserve.rows": rows})
