"""Closed-loop load with wrk against a real ``batchserve serve`` on 127.0.0.1.

Starts one server per configuration, runs ``wrk`` (Debian package ``wrk``) at each
concurrency for a fixed time, reads the mean batch size from ``/metrics``, and prints a
Markdown table. Every run is bounded in time; traffic goes to 127.0.0.1 only.

    python -m loadtests.wrk_bench --concurrency 1 64 --duration-s 10
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson

BATCHSERVE = Path(sys.executable).with_name("batchserve")

CONFIGURATIONS: dict[str, dict[str, str]] = {
    "batched (max_batch_size=64)": {"BATCHSERVE_MAX_BATCH_SIZE": "64"},
    "unbatched (max_batch_size=1)": {"BATCHSERVE_MAX_BATCH_SIZE": "1"},
}


@dataclass
class Result:
    configuration: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    mean_batch_rows: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wrk_script(folder: Path) -> Path:
    """A wrk Lua script POSTing one random 8x8 digit instance as JSON."""
    instance = np.random.default_rng(0).random((8, 8)).round(4).tolist()
    body = orjson.dumps({"instances": [instance]}).decode()
    script = folder / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{body}]==]\n"
    )
    return script


def parse_duration_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit]


def run_wrk(
    url: str, script: Path, concurrency: int, duration_s: int
) -> tuple[float, float, float, int]:
    output = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{duration_s}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration_s + 30,
    ).stdout
    requests_per_s = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    p50 = parse_duration_ms(re.search(r"\s50%\s+(\S+)", output).group(1))  # type: ignore[union-attr]
    p99 = parse_duration_ms(re.search(r"\s99%\s+(\S+)", output).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    errors = int(non_2xx.group(1)) if non_2xx else 0
    if socket_errors:
        errors += sum(int(count) for count in socket_errors.groups())
    return requests_per_s, p50, p99, errors


def batch_counts(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    count = float(re.search(r"^batchserve_batch_size_rows_count (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    rows = float(re.search(r"^batchserve_batch_size_rows_sum (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    return count, rows


def measure(
    name: str, env: dict[str, str], concurrencies: list[int], duration_s: int
) -> list[Result]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_env = (
        os.environ | {"BATCHSERVE_PORT": str(port), "BATCHSERVE_LOG_LEVEL": "warning"} | env
    )
    process = subprocess.Popen([str(BATCHSERVE), "serve"], env=server_env)
    results = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        with tempfile.TemporaryDirectory() as scratch:
            script = wrk_script(Path(scratch))
            run_wrk(url + "/predict", script, 8, 2)  # warm the connection path and allocator
            for concurrency in concurrencies:
                before = batch_counts(url)
                rps, p50, p99, errors = run_wrk(url + "/predict", script, concurrency, duration_s)
                after = batch_counts(url)
                batches, rows = after[0] - before[0], after[1] - before[1]
                results.append(
                    Result(
                        name, concurrency, rps, p50, p99, errors, rows / batches if batches else 0.0
                    )
                )
    finally:
        process.terminate()
        process.wait(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--duration-s", type=int, default=10)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per point; the median is shown"
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk")
    print("| configuration | concurrency | req/s | p50 ms | p99 ms | errors | mean rows/batch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, env in CONFIGURATIONS.items():
        runs = [measure(name, env, args.concurrency, args.duration_s) for _ in range(args.repeats)]
        for point in range(len(args.concurrency)):
            samples = [run[point] for run in runs]
            median = sorted(samples, key=lambda result: result.requests_per_s)[len(samples) // 2]
            print(
                f"| {name} | {median.concurrency} | {median.requests_per_s:,.0f} | "
                f"{float(np.median([s.p50_ms for s in samples])):.2f} | "
                f"{float(np.median([s.p99_ms for s in samples])):.2f} | "
                f"{sum(s.errors for s in samples)} | {median.mean_batch_rows:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
