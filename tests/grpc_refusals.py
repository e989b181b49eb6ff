"""gRPC refusals for load, measured in a process of their own (``tests/test_grpc_refusal_hold.py``
runs ``python -m tests.grpc_refusals`` and checks what it prints).

A real ``grpc.aio`` server with the front end's ``InferenceServicer`` over an engine that
refuses every request. Its own process: the server's protocol module and tritonclient's (which
other tests import) define the same protobuf symbols, and one process cannot hold both.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc

from service.bridge.interface import InferenceRequest, InferenceResult
from service.config import Settings
from service.errors import OverloadedError, QueueFullError, ServiceError
from service.frontend.oip.grpc_server import INFER_ROUTE, InferenceServicer
from service.frontend.oip.proto import grpc_predict_v2_pb2 as pb
from service.frontend.oip.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from service.frontend.state import FrontendState
from service.repository import ModelRepository
from tests.test_requests import EngineAnsweringLate, tokens_model

#: The hold of the first scenarios, and the larger one of the deadline's.
HOLD_MS = 400.0
LONG_HOLD_MS = 10_000.0
#: The deadline of the calls of the deadline's scenario.
CALL_TIMEOUT_S = 1.0
#: A channel with a connection of its own: channels to one address in a process share one
#: unless told not to.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class EngineRefusingForLoad(EngineAnsweringLate):
    """An engine whose queue is always full: every request is refused as ``refusal`` says."""

    def __init__(self, refusal: ServiceError) -> None:
        super().__init__(tokens_model())
        self.refusal: ServiceError = refusal

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        self.requests.append(request)
        raise self.refusal


@asynccontextmanager
async def serving(
    engine: EngineRefusingForLoad, hold_ms: float
) -> AsyncIterator[tuple[FrontendState, str]]:
    """A gRPC server over ``engine`` holding refusals up to ``hold_ms``, and its address."""
    with tempfile.TemporaryDirectory() as folder:
        frontend = FrontendState.over(
            engine,
            Settings(request_timeout_ms=60_000, refusal_hold_ms=hold_ms),
            repository=ModelRepository(Path(folder)),
        )
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            InferenceServicer(frontend), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield frontend, f"127.0.0.1:{port}"
        finally:
            await server.stop(grace=None)


def infer_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tokens")
    tensor = request.inputs.add(name="ids", datatype="INT64", shape=[1, 3])
    tensor.contents.int64_contents.extend([1, 2, 3])
    return request


async def called(
    stub: pb_grpc.GRPCInferenceServiceStub, timeout_s: float | None = None
) -> tuple[str, float]:
    """The status name a ``ModelInfer`` call ended with, and how long it took (s)."""
    started_s = time.monotonic()
    code = await stub.ModelInfer(infer_request(), timeout=timeout_s).code()
    return code.name, time.monotonic() - started_s


async def resent_at_once() -> dict[str, Any]:
    """One connection refused twice in a row, then another connection's first refusal."""
    engine = EngineRefusingForLoad(QueueFullError("the queue is full; retry shortly"))
    async with serving(engine, HOLD_MS) as (frontend, address):
        async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as greedy:
            stub = pb_grpc.GRPCInferenceServiceStub(greedy)  # type: ignore[no-untyped-call]
            greedy_calls = [await called(stub) for _ in range(2)]
        async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as other:
            stub = pb_grpc.GRPCInferenceServiceStub(other)  # type: ignore[no-untyped-call]
            other_call = await called(stub)
        frontend.request_tally.flush()
        counted = {
            status: frontend.registry.get_sample_value(
                "batchserve_requests_total", {"route": INFER_ROUTE, "status": status}
            )
            for status in ("429", "500")
        }
    return {"greedy": greedy_calls, "other": other_call, "counted": counted}


async def resent_with_a_deadline() -> dict[str, Any]:
    """A connection refused twice, each call with a deadline of ``CALL_TIMEOUT_S``, by a
    server that would hold the second far longer (``Retry-After`` 30 s)."""
    engine = EngineRefusingForLoad(OverloadedError("the work ahead is too long", retry_after_s=30))
    async with serving(engine, LONG_HOLD_MS) as (_, address):
        channel = grpc.aio.insecure_channel(address, OWN_CONNECTION)
        async with channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            return {"calls": [await called(stub, CALL_TIMEOUT_S) for _ in range(2)]}


async def garbage() -> dict[str, int]:
    """Objects only the garbage collector freed after 3 calls of each kind: refused, and
    ``ServerLive`` (a call that does nothing: grpc's own per-call garbage)."""
    engine = EngineRefusingForLoad(QueueFullError("the queue is full; retry shortly"))
    async with serving(engine, 0.0) as (_, address):
        channel = grpc.aio.insecure_channel(address, OWN_CONNECTION)
        async with channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]

            async def live() -> None:
                await stub.ServerLive(pb.ServerLiveRequest())

            async def refused() -> None:
                await stub.ModelInfer(infer_request()).code()

            return {"live": await garbage_of(live), "refused": await garbage_of(refused)}


async def garbage_of(call: Callable[[], Awaitable[None]]) -> int:
    for _ in range(2):  # caches and lazily built parts made once
        await call()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            await call()
        return gc.collect()
    finally:
        if was_enabled:
            gc.enable()


async def measure() -> dict[str, Any]:
    return {
        "hold_ms": HOLD_MS,
        "call_timeout_s": CALL_TIMEOUT_S,
        "resent_at_once": await resent_at_once(),
        "resent_with_a_deadline": await resent_with_a_deadline(),
        "garbage": await garbage(),
    }


if __name__ == "__main__":
    json.dump(asyncio.run(measure()), sys.stdout)
