"""Closed-loop gRPC ``ModelInfer`` clients for the goodput attack (``--protocol grpc``).

Each client has a channel, and so a connection, of its own (channels to one address in a
process share one unless told not to, and the server holds refusals per connection); each
sends its next call as soon as it has an answer, ``RESOURCE_EXHAUSTED`` included. Statuses are
named as HTTP's, so the attack's table reads alike for both protocols.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc

from service.frontend.oip.proto import grpc_predict_v2_pb2 as pb
from service.frontend.oip.proto import grpc_predict_v2_pb2_grpc as pb_grpc

#: gRPC statuses by the HTTP status the server maps to them.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
}
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def token_request(model: str, tokens: Sequence[int]) -> bytes:
    """A serialized ``ModelInferRequest`` of one row of ``tokens`` (``token_ids``, INT64)."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="token_ids", datatype="INT64", shape=[1, len(tokens)])
    request.raw_input_contents.append(b"".join(t.to_bytes(8, "little") for t in tokens))
    return request.SerializeToString()


async def closed_loop(
    address: str,
    request: bytes,
    clients: int,
    duration_s: float,
    record: Callable[[int | str, float, float], None],
    max_calls_per_client: int,
) -> float:
    """``clients`` channels to ``address``, each calling ``ModelInfer`` with ``request`` again
    as soon as it has an answer, for ``duration_s``; ``record(status, latency_s, sent_s)``
    each answer. Returns the seconds it ran."""
    started_s = time.monotonic()
    message = pb.ModelInferRequest.FromString(request)

    async def client() -> None:
        async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            for _ in range(max_calls_per_client):
                if time.monotonic() - started_s >= duration_s:
                    return
                sent_s = time.monotonic()
                code = await stub.ModelInfer(message).code()
                status: int | str = HTTP_STATUS.get(code, code.name)
                record(status, time.monotonic() - sent_s, sent_s)

    await asyncio.gather(*(client() for _ in range(clients)))
    return time.monotonic() - started_s
