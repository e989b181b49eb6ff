"""The V2 ``GRPCInferenceService`` on ``BATCHSERVE_GRPC_PORT``, in each front end's event loop.

``ModelInfer`` takes inputs as typed contents or ``raw_input_contents`` and answers every
output as ``raw_output_contents`` (what tritonclient reads). It validates like the REST route,
takes the call's gRPC deadline (or its ``timeout`` parameter, when sooner) as the request's
deadline, leaves the queue when the caller cancels, and counts in the same request metrics
(route ``grpc:ModelInfer``). A refusal for load (``RESOURCE_EXHAUSTED``) sent on a
connection before its last ``Retry-After`` passed is held as over HTTP (``refusal_hold``).
Every front end of a server listens on the port (``SO_REUSEPORT``), like the HTTP one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from service import tracing
from service.errors import (
    BadRequestError,
    InvalidInputError,
    ServiceError,
    forget_traceback,
    grpc_status_name,
)
from service.frontend import access_log, request_spans
from service.frontend.about import __version__
from service.frontend.oip.parameters import TIMEOUT_PARAMETER, batch_priority, timeout_s
from service.frontend.oip.proto import grpc_predict_v2_pb2 as pb
from service.frontend.oip.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from service.frontend.oip.rest import binary_of, run_inference
from service.frontend.oip.routes import EXTENSIONS, PLATFORM, tensor_metadata
from service.frontend.oip.tensors import (
    InferInput,
    InferOptions,
    RequestedOutput,
)
from service.frontend.refusal_hold import RefusalHolds
from service.frontend.requests import Deadline
from service.frontend.routing import ROUTING_KEY_HEADER, Routing
from service.frontend.state import FrontendState

logger = logging.getLogger(__name__)

#: The typed ``InferTensorContents`` field that carries each datatype.
_CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
INFER_ROUTE = "grpc:ModelInfer"
#: The deadline's source when the call's own deadline set it.
GRPC_DEADLINE = "the call's gRPC deadline"
#: The server span's name: the full gRPC method, as OpenTelemetry's conventions name it.
MODEL_INFER_METHOD = "inference.GRPCInferenceService/ModelInfer"

Reply = TypeVar("Reply")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The protocol's six calls over one front end's engines."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend
        self.holds = RefusalHolds(frontend.settings.refusal_hold_ms)
        self.access_log = frontend.settings.access_log

    async def ServerLive(  # noqa: N802 - the protocol's names
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(  # noqa: N802
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.frontend.ready)

    async def ModelReady(  # noqa: N802
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        try:
            self.frontend.serving_model(request.name, request.version or None)
        except ServiceError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(  # noqa: N802
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="batchserve", version=__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(  # noqa: N802
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        async def metadata() -> pb.ModelMetadataResponse:
            manifest = self.frontend.serving_model(request.name, request.version or None).manifest
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=manifest.name,
                versions=[manifest.version],
                platform=PLATFORM,
                inputs=[tensor(**tensor_metadata(spec)) for spec in manifest.inputs],
                outputs=[tensor(**tensor_metadata(spec)) for spec in manifest.outputs],
            )

        return await _answering(context, metadata, pb.ModelMetadataResponse)

    async def ModelInfer(  # noqa: N802
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        if tracing.current is None:
            return await self._metered_infer(request, context)
        return await request_spans.serve_traced_grpc(
            lambda: self._metered_infer(request, context),
            MODEL_INFER_METHOD,
            context.invocation_metadata() or (),
        )

    async def _metered_infer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        tally = self.frontend.request_tally
        started_s = time.perf_counter()
        status = "200"
        reply: pb.ModelInferResponse | None = None
        routing = Routing(_routing_key(context))
        tally.started()
        self.frontend.receiving += 1
        try:
            try:
                reply = await self._infer(request, context, routing)
                return reply
            except ServiceError as error:
                status = str(error.status_code)
                _set_status(context, error)
                await self.holds.hold(context.peer(), error, context.time_remaining())
                return pb.ModelInferResponse()
        except BaseException:
            status = "499" if context.cancelled() else "500"
            raise
        finally:
            self.frontend.receiving -= 1
            tally.stopped()
            latency_s = time.perf_counter() - started_s
            self.frontend.answered_with(routing, int(status))
            tally.answered(INFER_ROUTE, status, latency_s, tracing.current_exemplar())
            if self.access_log:
                access_log.log_grpc(
                    "/" + MODEL_INFER_METHOD,
                    int(status),
                    latency_s,
                    request_id=request.id or None,
                    model=request.model_name or None,
                    version=reply.model_version if reply is not None else None,
                    peer=context.peer(),
                    sizes=(request.ByteSize(), reply.ByteSize() if reply is not None else None),
                )

    async def _infer(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        routing: Routing,
    ) -> pb.ModelInferResponse:
        """The call's answer; a ``ServiceError`` for any refusal."""
        frontend = self.frontend
        deadline = Deadline.start(frontend.settings).sooner(context.time_remaining(), GRPC_DEADLINE)
        model = frontend.serving_model(request.model_name, request.model_version or None, routing)
        options = InferOptions(
            outputs=tuple(_requested(output) for output in request.outputs),
            parameters=_parameters(request.parameters),
        )
        result, answered = await run_inference(
            frontend,
            model,
            _inputs(request),
            options,
            deadline=deadline.sooner(timeout_s(options.parameters), TIMEOUT_PARAMETER),
            priority=batch_priority(options.parameters),
            request_id=request.id or "grpc",
        )
        response = pb.ModelInferResponse(
            model_name=model.manifest.name, model_version=result.version, id=request.id
        )
        for tensor in answered:
            response.outputs.add(
                name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape)
            )
            response.raw_output_contents.append(binary_of(tensor))
        return response


async def _answering(
    context: grpc.aio.ServicerContext[Any, Any],
    call: Callable[[], Awaitable[Reply]],
    empty: Callable[[], Reply],
) -> Reply:
    """``call``'s reply, or the gRPC status its ``ServiceError`` maps to (with its message)
    and an ``empty()`` reply, which grpc does not send with a status other than OK."""
    try:
        return await call()
    except ServiceError as error:
        _set_status(context, error)
        return empty()


def _set_status(context: grpc.aio.ServicerContext[Any, Any], error: ServiceError) -> None:
    """Make ``error`` the call's status. Not by ``context.abort``: grpc keeps the
    ``AbortError`` it raises in a frame of that error's own traceback, a reference cycle (about
    40 objects a refusal) that only the garbage collector frees, and in a storm of refusals
    its collections paused the event loop (issue 23)."""
    code = grpc.StatusCode[grpc_status_name(type(error))]
    if code == grpc.StatusCode.INTERNAL:
        logger.error("grpc_request_failed", extra={"error": error.message})
    forget_traceback(error)
    context.set_code(code)
    context.set_details(error.message)
    if tracing.current is not None:
        span = trace.get_current_span()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if error.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR, error.message))


def _inputs(request: pb.ModelInferRequest) -> list[InferInput]:
    """The request's tensors, from ``raw_input_contents`` (one per input, in order) or each
    input's typed contents."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequestError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs"
        )
    inputs = []
    for index, tensor in enumerate(request.inputs):
        shape = tuple(tensor.shape)
        if raw:
            inputs.append(InferInput(tensor.name, tensor.datatype, shape, raw=raw[index]))
            continue
        field = _CONTENTS_FIELDS.get(tensor.datatype)
        if field is None:
            raise BadRequestError(
                f"input {tensor.name!r}: {tensor.datatype} travels in raw_input_contents only"
            )
        values = list(getattr(tensor.contents, field))
        inputs.append(InferInput(tensor.name, tensor.datatype, shape, data=values))
    return inputs


def _parameter(value: pb.InferParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


def _parameters(parameters: Any) -> dict[str, Any]:
    return {name: _parameter(value) for name, value in parameters.items()}


def _requested(output: pb.ModelInferRequest.InferRequestedOutputTensor) -> RequestedOutput:
    parameters = _parameters(output.parameters)
    classification = parameters.get("classification", 0)
    if not isinstance(classification, int) or isinstance(classification, bool):
        raise InvalidInputError(f"output {output.name!r}: classification must be an integer")
    return RequestedOutput(output.name, binary=True, classification=classification)


async def start_grpc_server(frontend: FrontendState) -> grpc.aio.Server:
    """Serve the protocol on ``host:grpc_port`` (shared with the other front ends)."""
    settings = frontend.settings
    limit = settings.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", max(limit, 64 << 20)),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        InferenceServicer(frontend), server
    )
    address = f"{settings.host}:{settings.grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    await server.start()
    logger.info("grpc_serving", extra={"address": address})
    return server


def _routing_key(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The call's ``x-routing-key`` metadata (``routing.py``), or None."""
    wanted = ROUTING_KEY_HEADER.decode()
    for key, value in context.invocation_metadata() or ():
        if key == wanted:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None
