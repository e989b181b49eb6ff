"""Two models in one engine: each alone, then both at once, to show that neither starves the
other on the device thread they share (it goes to the waiting model with the least device
time so far: fair in device time, ``service/engine/device_turns.py``).

``python -m loadtests.models [--duration-s 8] [--repeats 3] [--workers 1]``: one server with
``BATCHSERVE_MODELS=digits,textenc``; wrk (closed loop) on ``/models/digits/predict`` (one
8x8 image) and on ``/models/textenc/predict`` (16 tokens), each alone, then both together (two
wrk processes at once), ``--repeats`` interleaved rounds. Prints a Markdown table of medians:
req/s and p50/p99 ms per model, and each model's memory as ``/models`` reports it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import orjson

from loadtests import servers, wrk
from loadtests.wrk import WrkResult

CLIENTS = {"digits": 128, "textenc": 32}
"""wrk connections per model: digits has more clients than a batch holds (max_batch_size 64),
so its queue is never empty while textenc runs."""


def bodies() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    digit = rng.uniform(0, 1, size=(8, 8)).round(3).tolist()
    tokens = rng.integers(1, 1000, size=16).tolist()
    return {
        "digits": orjson.dumps({"instances": [digit]}),
        "textenc": orjson.dumps({"instances": [tokens]}),
    }


def run_models(
    url: str, scripts: dict[str, Path], names: Sequence[str], duration_s: float
) -> dict[str, WrkResult]:
    """wrk on each of ``names`` at the same time."""
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        runs = {
            name: pool.submit(
                wrk.run_wrk,
                f"{url}/models/{name}/predict",
                scripts[name],
                concurrency=CLIENTS[name],
                duration_s=duration_s,
            )
            for name in names
        }
        return {name: run.result() for name, run in runs.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_MODELS": "digits,textenc",
            "BATCHSERVE_WORKERS": str(args.workers),
        }
    )
    headers = {"Content-Type": "application/json"}
    results: dict[tuple[str, str], list[WrkResult]] = {}
    with tempfile.TemporaryDirectory(prefix="batchserve-models-") as folder:
        scratch = Path(folder)
        scripts = {
            name: wrk.write_script(scratch / name, [body], headers)
            for name, body in bodies().items()
        }
        command = servers.batchserve_command()
        with servers.running(command, env, scratch / "server.log", ready_timeout_s=300) as url:
            for name, body in bodies().items():
                servers.check_answers(f"{url}/models/{name}", [body], headers)
            memory = {
                model["name"]: model["memory_bytes"]
                for model in httpx.get(url + "/models", timeout=10).json()["models"]
            }
            for _ in range(args.repeats):
                for mode, names in (
                    ("alone", ["digits"]),
                    ("alone", ["textenc"]),
                    ("together", ["digits", "textenc"]),
                ):
                    for name, result in run_models(url, scripts, names, args.duration_s).items():
                        if result.errors:
                            raise RuntimeError(f"{name} {mode}: {result.errors} errors")
                        results.setdefault((name, mode), []).append(result)
    print("| model | clients | memory MiB | run | req/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for (name, mode), runs in results.items():
        print(
            f"| {name} | {CLIENTS[name]} | {memory[name] / 2**20:.1f} | {mode} "
            f"| {statistics.median(run.requests_per_s for run in runs):,.0f} "
            f"| {statistics.median(run.p50_ms for run in runs):.2f} "
            f"| {statistics.median(run.p99_ms for run in runs):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
