"""Traces of requests and the batches that served them: the real app and model, the SDK's
in-memory exporter; and a real multi-process server exporting OTLP/HTTP to a receiver here."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc_client
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from service import tracing
from service.config import Settings
from service.logs import JsonFormatter
from service.server.single import create_app
from tests.fixtures import lifespan
from tests.otlp_receiver import OtlpReceiver, otlp_receiver
from tests.processes import free_port, serve_with_engines, wait_for, wait_until_serving

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def digits(count: int, seed: int) -> list[object]:
    images: list[object] = np.random.default_rng(seed).random((count, 8, 8)).tolist()
    return images


def hex_id(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.start([SimpleSpanProcessor(exporter)], role="server")
    try:
        yield exporter
    finally:
        tracing.stop()


@pytest.fixture
async def client(exported: InMemorySpanExporter) -> AsyncIterator[httpx.AsyncClient]:
    # Fixed waits of 50 ms: concurrent requests share batches however slowly they arrive.
    settings = Settings(device="cpu", batch_policy="fixed", max_wait_ms=50.0, max_batch_size=64)
    app: FastAPI = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


async def predict(
    client: httpx.AsyncClient, instances: list[object], **headers: str
) -> httpx.Response:
    response = await client.post(
        "/predict",
        content=orjson.dumps({"instances": instances}),
        headers={"content-type": "application/json", **headers},
    )
    assert response.status_code == 200, response.text
    return response


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_one_request_gives_its_spans_and_the_batch_that_served_it(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    await predict(client, digits(3, seed=1))
    spans = list(exported.get_finished_spans())
    (server,) = named(spans, "POST /predict")
    (engine,) = named(spans, "engine")
    (queued,) = named(spans, "queue_wait")
    (batch,) = named(spans, "batch")
    assert server.parent is None
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200
    trace_id = server.context.trace_id
    assert [event.name for event in server.events] == ["body_read"]
    for child in ("parse", "engine"):
        (span,) = named(spans, child)
        assert span.context.trace_id == trace_id
        assert parent_of(span) == server.context.span_id
    assert parent_of(queued) == engine.context.span_id
    assert queued.context.trace_id == trace_id

    # The batch is a trace of its own, linked to the request it served, with its phases.
    assert batch.parent is None
    assert batch.context.trace_id != trace_id
    assert [link.context.span_id for link in batch.links] == [engine.context.span_id]
    assert batch.attributes is not None
    assert batch.attributes["batchserve.model"] == "digits"
    assert batch.attributes["batchserve.batch.rows"] == 3
    assert batch.attributes["batchserve.device"] == "cpu"
    assert batch.attributes["batchserve.precision"] == "fp32"
    assert batch.attributes["batchserve.batch.padded_rows"] >= 3  # type: ignore[operator]
    for phase in ("collate", "forward", "split"):
        (span,) = named(spans, phase)
        assert parent_of(span) == batch.context.span_id
        assert batch.start_time is not None
        assert span.start_time is not None
        assert batch.start_time <= span.start_time

    # The request span records the batch's span id and its rows in it, and links to it.
    assert server.attributes["batchserve.batch.span_ids"] == (hex_id(batch.context.span_id, 16),)
    assert server.attributes["batchserve.batch.rows"] == (3,)
    assert [link.context.span_id for link in server.links] == [batch.context.span_id]


async def test_32_concurrent_requests_batch_links_cover_exactly_the_requests_served(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    rows = [1 + index % 3 for index in range(32)]
    await asyncio.gather(*(predict(client, digits(count, seed)) for seed, count in enumerate(rows)))
    spans = list(exported.get_finished_spans())
    servers = named(spans, "POST /predict")
    engines = {span.context.span_id: span for span in named(spans, "engine")}
    batches = named(spans, "batch")
    assert len(servers) == 32
    assert len(engines) == 32
    assert any(len(batch.links) > 1 for batch in batches), "no batch was shared"

    batch_ids_of = {
        server.context.span_id: server.attributes["batchserve.batch.span_ids"]  # type: ignore[index]
        for server in servers
    }
    linked = [link.context.span_id for batch in batches for link in batch.links]
    assert sorted(linked) == sorted(engines), "each request linked by exactly one batch"
    for batch in batches:
        assert batch.attributes is not None
        link_rows = [link.attributes["batchserve.rows"] for link in batch.links]  # type: ignore[index]
        assert sum(link_rows) == batch.attributes["batchserve.batch.rows"]  # type: ignore[arg-type]
        batch_id = hex_id(batch.context.span_id, 16)
        served = {
            engine_id
            for engine_id, engine in engines.items()
            if batch_id in batch_ids_of[parent_of(engine)]
        }
        assert served == {link.context.span_id for link in batch.links}
    assert sum(rows) == sum(
        batch.attributes["batchserve.batch.rows"]  # type: ignore[index, misc]
        for batch in batches
    )


async def test_a_request_split_over_batches_records_each_batch_and_its_rows(
    exported: InMemorySpanExporter,
) -> None:
    settings = Settings(device="cpu", max_wait_ms=2.0, max_batch_size=4)
    app: FastAPI = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            await predict(http, digits(10, seed=6))
    spans = list(exported.get_finished_spans())
    (server,) = named(spans, "POST /predict")
    batches = {hex_id(span.context.span_id, 16): span for span in named(spans, "batch")}
    assert server.attributes is not None
    assert server.attributes["batchserve.batch.rows"] == (4, 4, 2)
    recorded = server.attributes["batchserve.batch.span_ids"]
    assert set(recorded) == set(batches)  # type: ignore[arg-type]
    for span_id, rows in zip(recorded, (4, 4, 2), strict=True):  # type: ignore[call-overload]
        assert batches[span_id].attributes["batchserve.batch.rows"] == rows
    assert len(named(spans, "queue_wait")) == 3


async def test_a_v2_inference_is_traced_like_predict(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    images = np.random.default_rng(7).random((2, 8, 8), dtype=np.float32)
    document = {
        "inputs": [
            {
                "name": "image",
                "datatype": "FP32",
                "shape": [2, 8, 8],
                "data": images.ravel().tolist(),
            }
        ]
    }
    response = await client.post(
        "/v2/models/digits/infer",
        content=orjson.dumps(document),
        headers={
            "content-type": "application/json",
            "traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01",
        },
    )
    assert response.status_code == 200, response.text
    spans = list(exported.get_finished_spans())
    (server,) = named(spans, "POST /v2/models/{name}/infer")
    assert hex_id(server.context.trace_id, 32) == CLIENT_TRACE_ID
    for child in ("parse", "to_tensors", "engine"):
        (span,) = named(spans, child)
        assert span.context.trace_id == server.context.trace_id
    assert server.attributes is not None
    assert server.attributes["batchserve.batch.rows"] == (2,)


async def test_a_request_to_a_named_model_is_traced_like_predict(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    response = await client.post("/models/digits/predict", json={"instances": digits(2, seed=3)})
    assert response.status_code == 200, response.text
    spans = list(exported.get_finished_spans())
    (server,) = named(spans, "POST /models/{name}/predict")
    (batch,) = named(spans, "batch")
    assert server.attributes is not None
    assert server.attributes["batchserve.batch.rows"] == (2,)
    assert server.attributes["batchserve.batch.span_ids"] == (hex_id(batch.context.span_id, 16),)


async def test_a_client_traceparent_is_continued(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    await predict(
        client, digits(1, seed=2), traceparent=f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    )
    (server,) = named(list(exported.get_finished_spans()), "POST /predict")
    assert hex_id(server.context.trace_id, 32) == CLIENT_TRACE_ID
    assert server.parent is not None
    assert hex_id(server.parent.span_id, 16) == CLIENT_SPAN_ID


async def test_an_unsampled_client_trace_records_no_request_or_batch_span(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    await predict(
        client, digits(1, seed=2), traceparent=f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"
    )
    assert list(exported.get_finished_spans()) == []


async def test_openmetrics_latency_histograms_carry_the_trace_of_a_sampled_request(
    client: httpx.AsyncClient, exported: InMemorySpanExporter
) -> None:
    await predict(client, digits(2, seed=3))
    (server,) = named(list(exported.get_finished_spans()), "POST /predict")
    trace_id = hex_id(server.context.trace_id, 32)

    response = await client.get("/metrics", headers={"accept": OPENMETRICS})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    exemplars: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.exemplar is not None:
                exemplars.setdefault(family.name, set()).add(sample.exemplar.labels["trace_id"])
    assert exemplars["batchserve_request_duration_seconds"] == {trace_id}
    assert exemplars["batchserve_queue_wait_seconds"] == {trace_id}

    plain = await client.get("/metrics")
    assert plain.headers["content-type"].startswith("text/plain")
    assert trace_id not in plain.text


def test_log_lines_written_inside_a_span_carry_its_ids(exported: InMemorySpanExporter) -> None:
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tests.tracing")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        assert tracing.current is not None
        with tracing.current.tracer.start_as_current_span("work") as span:
            logger.warning("inside")
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    inside, outside = (orjson.loads(line) for line in lines.getvalue().splitlines())
    context = span.get_span_context()
    assert inside["trace_id"] == hex_id(context.trace_id, 32)
    assert inside["span_id"] == hex_id(context.span_id, 16)
    assert "trace_id" not in outside


def test_tracing_is_off_unless_otel_variables_ask_for_it() -> None:
    assert not tracing.requested_by({})
    assert not tracing.requested_by({"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.requested_by(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert tracing.requested_by({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.requested_by({"OTEL_TRACES_EXPORTER": "console"})
    with pytest.raises(ValueError, match="'jaegr'"):
        tracing.exporters_from({"OTEL_TRACES_EXPORTER": "jaegr"})


# ----------------------------------------------------------------- OTLP, several processes


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.mark.slow
def test_spans_of_front_end_and_engine_processes_arrive_over_otlp_http(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    """HTTP and gRPC requests with the client's ``traceparent``, served by a front-end process
    and an engine process: the request spans continue the client's traces, and the engine's
    batch spans link to the front end's bridge spans across the bridge."""
    grpc_port = free_port()
    with serve_with_engines(
        tmp_path,
        workers=1,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="50",
        BATCHSERVE_GRPC_PORT=str(grpc_port),
    ) as server:
        wait_until_serving(server, workers=1)
        http_trace, grpc_trace = CLIENT_TRACE_ID, "0af7651916cd43dd8448eb211c80319c"
        answer = httpx.post(
            server.url + "/predict",
            json={"instances": digits(2, seed=4)},
            headers={"traceparent": f"00-{http_trace}-{CLIENT_SPAN_ID}-01"},
            timeout=30.0,
        )
        assert answer.status_code == 200, answer.text
        image = triton_grpc_client.InferInput("image", [3, 8, 8], "FP32")
        image.set_data_from_numpy(np.random.default_rng(5).random((3, 8, 8), dtype=np.float32))
        triton_grpc_client.InferenceServerClient(f"127.0.0.1:{grpc_port}").infer(
            "digits", [image], headers={"traceparent": f"00-{grpc_trace}-{CLIENT_SPAN_ID}-01"}
        )

        def both_batches_arrived() -> bool:
            return len([span for span in receiver.received() if span.name == "batch"]) >= 2

        wait_for(both_batches_arrived, "the batch spans exported", server, timeout_s=30.0)
        metrics = httpx.get(server.url + "/metrics", headers={"accept": OPENMETRICS}).text

    spans = receiver.received()
    by_name = {(span.name, span.trace_id): span for span in spans}
    http_server = by_name["POST /predict", http_trace]
    grpc_server = by_name["inference.GRPCInferenceService/ModelInfer", grpc_trace]
    assert http_server.parent_span_id == CLIENT_SPAN_ID == grpc_server.parent_span_id
    assert http_server.role == grpc_server.role == "frontend"
    bridges = {span.trace_id: span for span in spans if span.name == "bridge"}
    assert set(bridges) == {http_trace, grpc_trace}
    queued = [span for span in spans if span.name == "queue_wait"]
    assert {(span.trace_id, span.parent_span_id, span.role) for span in queued} == {
        (trace, bridge.span_id, "engine") for trace, bridge in bridges.items()
    }
    links = {link for span in spans if span.name == "batch" for link in span.links}
    assert links == {(trace, bridge.span_id) for trace, bridge in bridges.items()}
    assert {span.role for span in spans if span.name == "batch"} == {"engine"}
    # prometheus-client's multiprocess mode keeps no exemplars (docs/tracing.md says so).
    assert "trace_id" not in metrics
