"""An OTLP/HTTP trace receiver on 127.0.0.1, standing in for a collector on the same host.

It decodes each export with the OpenTelemetry proto package and keeps the spans, so that a
test can read what a server exported.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_RESPONSE = ExportTraceServiceResponse().SerializeToString()


@dataclass(frozen=True)
class ReceivedSpan:
    role: str
    """The ``batchserve.role`` of the process that sent it: server, frontend or engine."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """Empty for a root span."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    """(trace id, span id) of each link."""


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """Answers ``POST /v1/traces`` and stores the spans it receives."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ExportHandler)
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        """The value of ``OTEL_EXPORTER_OTLP_ENDPOINT`` that reaches this receiver."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                spans.extend(
                    ReceivedSpan(
                        role=str(resource.get("batchserve.role", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: value_of(a.value) for a in span.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    )
                    for span in scope_spans.spans
                )
        with self._lock:
            self._spans.extend(spans)


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python: str, int, float, bool, or a tuple of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(item) for item in value.array_value.values)
    return getattr(value, kind) if kind else None


class _ExportHandler(http.server.BaseHTTPRequestHandler):
    server: OtlpReceiver

    def do_POST(self) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.add(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(_RESPONSE)))
        self.end_headers()
        self.wfile.write(_RESPONSE)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: callers read spans, not access logs."""


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver serving in a thread until the block ends."""
    receiver = OtlpReceiver()
    thread = threading.Thread(target=receiver.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield receiver
    finally:
        receiver.shutdown()
        thread.join(timeout=10.0)
        receiver.server_close()
