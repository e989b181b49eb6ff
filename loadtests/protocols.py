"""One digit per request through every protocol the server speaks, at 1 and 64 clients.

``python -m loadtests.protocols`` starts one server (one process, ``digits``, gRPC on) and
measures, interleaved over ``--repeats`` rounds: ``/predict`` JSON and ``.npy``, V2 REST JSON
and with the binary tensor extension (wrk, closed loop), and V2 gRPC (a grpc.aio client in
this process, closed loop: no wrk for gRPC here). Prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests import servers, wrk

IMAGE = np.random.default_rng(0).random((1, 8, 8), dtype=np.float32)


def http_workloads() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Name -> (path, body, headers) of each HTTP variant, for one digit."""
    npy = io.BytesIO()
    np.save(npy, IMAGE)
    v2_json = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 8, 8],
                    "data": IMAGE.ravel().tolist(),
                }
            ]
        }
    )
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 8, 8],
                    "parameters": {"binary_data_size": IMAGE.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    )
    return {
        "/predict JSON": (
            "/predict",
            orjson.dumps({"instances": IMAGE.tolist()}),
            {"Content-Type": "application/json"},
        ),
        "/predict .npy": (
            "/predict",
            npy.getvalue(),
            {"Content-Type": "application/x-npy", "Accept": "application/x-npy"},
        ),
        "V2 REST JSON": ("/v2/models/digits/infer", v2_json, {"Content-Type": "application/json"}),
        "V2 REST binary": (
            "/v2/models/digits/infer",
            header + IMAGE.astype("<f4").tobytes(),
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        ),
    }


def check_answer(url: str, body: bytes, headers: dict[str, str]) -> None:
    response = httpx.post(url, content=body, headers=headers, timeout=30)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")


async def grpc_load(target: str, concurrency: int, duration_s: float) -> tuple[float, float]:
    """(requests/s, p50 ms) of ``concurrency`` closed-loop gRPC callers for ``duration_s``."""
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="image", datatype="FP32", shape=[1, 8, 8])
    request.raw_input_contents.append(IMAGE.astype("<f4").tobytes())
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(request)  # connect first
        stop_s = time.monotonic() + duration_s

        async def caller() -> None:
            while time.monotonic() < stop_s:
                started = time.perf_counter()
                await stub.ModelInfer(request, timeout=10)
                latencies.append(time.perf_counter() - started)

        started_s = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed_s = time.monotonic() - started_s
    return len(latencies) / elapsed_s, statistics.median(latencies) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args(argv)
    grpc_port = servers.free_port()
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_GRPC_PORT": str(grpc_port),
        }
    )
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    workloads = http_workloads()
    with tempfile.TemporaryDirectory(prefix="batchserve-protocols-") as folder:
        scratch = Path(folder)
        command = servers.batchserve_command()
        with servers.running(command, env, scratch / "server.log", ready_timeout_s=120) as url:
            scripts = {}
            for index, (name, (path, body, headers)) in enumerate(workloads.items()):
                check_answer(url + path, body, headers)
                scripts[name] = (path, wrk.write_script(scratch / f"w{index}", [body], headers))
            for _ in range(args.repeats):
                for concurrency in args.concurrency:
                    for name, (path, script) in scripts.items():
                        run = wrk.run_wrk(
                            url + path,
                            script,
                            concurrency=concurrency,
                            duration_s=args.duration_s,
                        )
                        if run.errors:
                            raise RuntimeError(f"{name}: {run.errors} errors")
                        results.setdefault((name, concurrency), []).append(
                            (run.requests_per_s, run.p50_ms)
                        )
                    rate, p50 = asyncio.run(
                        grpc_load(f"127.0.0.1:{grpc_port}", concurrency, args.duration_s)
                    )
                    results.setdefault(("V2 gRPC", concurrency), []).append((rate, p50))
    names = [*workloads, "V2 gRPC"]
    lines = [
        "| protocol | "
        + " | ".join(f"c={c} req/s | c={c} p50 ms" for c in args.concurrency)
        + " |",
        "|---|" + "---:|---:|" * len(args.concurrency),
    ]
    for name in names:
        cells = []
        for concurrency in args.concurrency:
            runs = results[(name, concurrency)]
            cells.append(f"{statistics.median(r for r, _ in runs):,.0f}")
            cells.append(f"{statistics.median(p for _, p in runs):.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
