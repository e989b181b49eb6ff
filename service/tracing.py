"""OpenTelemetry tracing: off unless the standard ``OTEL_*`` variables ask for it.

While it is off ``current`` is None, and that one attribute is all the request path checks.
It is on when ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``, or when an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` keeps it off. The sampler, the exporters' endpoints, headers and
timeouts, the batch span processor and the resource come from the same variables, read by the
SDK itself. The SDK and exporters are the optional extra ``batchserve[tracing]``, imported only
when tracing starts; the API (no-op without the SDK) is a dependency of the service.

Every JSON log line written while a span is current carries its ``trace_id`` and ``span_id``.

A shared module: it imports nothing else of the service.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

#: The W3C Trace Context header: in HTTP headers, gRPC metadata and bridge requests.
TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_EXPORTER_ENTRY_POINTS = "opentelemetry_traces_exporter"
_EMPTY_CONTEXT = _PROPAGATOR.extract({})


@dataclass(frozen=True)
class Tracing:
    """The tracers of this process, and how to undo what starting them changed."""

    tracer: trace.Tracer
    """Request spans, sampled by ``OTEL_TRACES_SAMPLER`` (default: parent-based, always on)."""
    engine_tracer: trace.Tracer
    """Queue-wait and batch spans: always recorded, and started only for sampled requests, so
    a batch is traced exactly when a request it served is."""
    provider: TracerProvider
    engine_provider: TracerProvider
    previous_record_factory: Callable[..., logging.LogRecord]


current: Tracing | None = None
"""The tracers while tracing is on; None while it is off."""


def requested_by(environ: Mapping[str, str]) -> bool:
    """Whether ``environ``'s ``OTEL_*`` variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(name.strip().lower() not in ("", "none") for name in exporters.split(","))
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def start_from_environment(role: str) -> bool:
    """Start tracing as the ``OTEL_*`` variables say, unless it is on already or not asked
    for; True when this call started it (the caller then calls ``stop``)."""
    if current is not None or not requested_by(os.environ):
        return False
    try:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.error(
            "tracing_unavailable",
            extra={
                "detail": "OTEL_* variables ask for traces but opentelemetry-sdk is not "
                "installed: pip install 'batchserve[tracing]'"
            },
        )
        return False
    start([BatchSpanProcessor(exporter) for exporter in exporters_from(os.environ)], role)
    return True


def exporters_from(environ: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (default ``otlp``): ``otlp`` is OTLP over
    HTTP/protobuf unless ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` is ``grpc``; any name an
    installed package registers (``console``, ``otlp_proto_http``, ``otlp_proto_grpc``...)."""
    exporters = []
    for given in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = given.strip().lower()
        if name in ("", "none"):
            continue
        if name == "otlp":
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            name = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
        found = list(entry_points(group=_EXPORTER_ENTRY_POINTS, name=name))
        if not found:
            known = sorted({"otlp", *entry_points(group=_EXPORTER_ENTRY_POINTS).names})
            raise ValueError(
                f"OTEL_TRACES_EXPORTER names {given.strip()!r}, which no installed package "
                f"provides; installed: {known} (pip install 'batchserve[tracing]' for otlp)"
            )
        exporters.append(found[0].load()())
    return exporters


def start(processors: Sequence[SpanProcessor], role: str) -> Tracing:
    """Trace through ``processors`` from now on (tests give an in-memory exporter's)."""
    global current
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    if current is not None:
        raise RuntimeError("tracing is on already; stop() it first")
    attributes: dict[str, str] = {"batchserve.role": role}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = "batchserve"
    resource = Resource.create(attributes)
    # Stopped by stop(), from the lifespan or the engine's main: an atexit hook of its own
    # would shut the shared processors down a second time.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    engine_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    for processor in processors:
        provider.add_span_processor(processor)
        engine_provider.add_span_processor(processor)
    previous_record_factory = logging.getLogRecordFactory()
    logging.setLogRecordFactory(_with_trace_ids(previous_record_factory))
    current = Tracing(
        tracer=provider.get_tracer("batchserve"),
        engine_tracer=engine_provider.get_tracer("batchserve.engine"),
        provider=provider,
        engine_provider=engine_provider,
        previous_record_factory=previous_record_factory,
    )
    return current


def stop() -> None:
    """Export the spans still buffered and turn tracing off (nothing if it is off)."""
    global current
    if current is None:
        return
    stopping, current = current, None
    logging.setLogRecordFactory(stopping.previous_record_factory)
    stopping.provider.shutdown()


def _with_trace_ids(
    make_record: Callable[..., logging.LogRecord],
) -> Callable[..., logging.LogRecord]:
    """A log record factory adding the current span's ids: ``logs.JsonFormatter`` writes them
    like any ``extra`` field."""

    def record_with_trace_ids(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return record

    return record_with_trace_ids


# ----------------------------------------------------------------- W3C trace context


def traceparent_of(span: trace.Span) -> str | None:
    """``span``'s W3C ``traceparent``, None when it has no valid context."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def context_from(carrier: Mapping[str, str]) -> Context:
    """The parent context a client's ``traceparent`` (and ``tracestate``) in ``carrier``
    names; an empty one when it has none or an invalid one."""
    if TRACEPARENT not in carrier:
        return _EMPTY_CONTEXT
    return _PROPAGATOR.extract(carrier)


def parent_from(traceparent: str) -> Context:
    """The parent context of a ``traceparent`` this service wrote."""
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context_from(traceparent)))


def span_context_from(traceparent: str) -> trace.SpanContext:
    """The span context of a ``traceparent`` this service wrote (version 00, checked by the
    front end that made it): sliced, not parsed by the propagator's regular expression,
    because the engine reads one per request and batch."""
    return trace.SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(traceparent[53:55], 16)),
    )


def is_sampled(traceparent: str) -> bool:
    """Whether the ``traceparent`` (version 00, as this service writes it) has its sampled
    flag set."""
    return len(traceparent) == 55 and int(traceparent[53:], 16) & 1 == 1


def exemplar_of(traceparent: str) -> dict[str, str] | None:
    """The exemplar labels of a sampled ``traceparent``; None when it was not sampled."""
    if not is_sampled(traceparent):
        return None
    return {"trace_id": traceparent[3:35], "span_id": traceparent[36:52]}


def current_exemplar() -> dict[str, str] | None:
    """The exemplar labels of the current span when tracing is on and it is sampled."""
    if current is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.trace_flags.sampled:
        return None
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }
