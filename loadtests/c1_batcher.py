"""One closed-loop client against the batcher alone: the event-loop work and the wake-ups a
lone request costs between its enqueue and its answer, without HTTP or a model.

A ``DynamicBatcher`` (default settings: adaptive policy, a real one-thread device executor, a
model that returns its input) serves one request at a time, as ``wrk -c1`` does: enqueue,
await the ticket, repeat. Reported per request: the round trip (µs, moves with the machine's
load), and under ``cProfile`` the Python calls the event loop's thread made and how many
times the collector task was resumed (counts: they do not move with the load). A lone
request should cost the collector two resumptions: its enqueue, and the device's answer.

    python -m loadtests.c1_batcher [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def _echo(payloads: list[np.ndarray]) -> list[np.ndarray]:
    return payloads


async def closed_loop(requests: int, max_wait_ms: float) -> list[float]:
    """Round trips (s) of ``requests`` requests sent one after another."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="c1-device")
    options: dict[str, Any] = {
        "executor": executor,
        "max_batch_size": 64,
        "max_queue_size": 1024,
        "request_timeout_ms": 10_000,
    }
    try:
        from service.engine.batcher import DynamicBatcher, dispatch_policy
        from service.metrics import EngineMetrics

        batcher: Any = DynamicBatcher(
            _echo,
            policy=dispatch_policy("adaptive", max_wait_ms, expected_requests=lambda: 1),
            metrics=EngineMetrics().for_model("c1"),
            max_batch_ms=100.0,  # the server's default time quantum
            stall_timeout_s=120.0,  # the server's default: a stall watch armed per batch
            **options,
        )

        async def one(payload: np.ndarray) -> object:
            return await batcher.enqueue(payload, group="g").wait()

    except ImportError:  # the pre-split layout (12e05c8): ``service.batching``
        from service.batching import DynamicBatcher as OldBatcher  # type: ignore[import-not-found]

        from service.metrics import ServiceMetrics  # type: ignore[attr-defined]

        batcher = OldBatcher(_echo, metrics=ServiceMetrics(), max_wait_ms=max_wait_ms, **options)

        async def one(payload: np.ndarray) -> object:
            return await batcher.submit(payload, group="g")

    batcher.start()
    payload = np.zeros((1, 256), dtype=np.float32)
    times_s = []
    try:
        for _ in range(requests):
            started_s = time.perf_counter()
            await one(payload)
            times_s.append(time.perf_counter() - started_s)
    finally:
        await batcher.drain()
        executor.shutdown(wait=True)
    return times_s


async def bare_hops(requests: int) -> list[float]:
    """Round trips (s) of the device hop alone: ``run_in_executor`` of the same model."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="c1-device")
    loop = asyncio.get_running_loop()
    payload = np.zeros((1, 256), dtype=np.float32)
    times_s = []
    for _ in range(requests):
        started_s = time.perf_counter()
        await loop.run_in_executor(executor, _echo, [payload])
        times_s.append(time.perf_counter() - started_s)
    executor.shutdown(wait=True)
    return times_s


def _resumptions(stats: pstats.Stats, name: str) -> int:
    return sum(
        entry[1]
        for (path, _, function), entry in stats.stats.items()  # type: ignore[attr-defined]
        if function == name and path.endswith(("batching.py", "collector.py"))
    )


class PathCounter:
    """Counts the calls (Python and C) made while a frame of the collector task
    (``_collect_forever`` and everything it resumes) or of ``enqueue`` is running, on this
    thread: ``sys.setprofile`` sees each resumption of the collector as a call of its frame."""

    def __init__(self) -> None:
        self.calls = {"collector": 0, "enqueue": 0}
        self._inside: str | None = None
        self._frame: object = None

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if self._inside is not None:
            if event in ("call", "c_call"):
                self.calls[self._inside] += 1
            elif event == "return" and frame is self._frame:
                self._inside = self._frame = None
            return
        if event == "call":
            name = frame.f_code.co_name
            if name == "_collect_forever":
                self._inside, self._frame = "collector", frame
            elif name == "enqueue" and frame.f_code.co_filename.endswith(
                ("batching.py", "collector.py")
            ):
                self._inside, self._frame = "enqueue", frame


def path_calls(requests: int, max_wait_ms: float) -> dict[str, float]:
    """Calls a request in the collector task and in ``enqueue``: the difference of a short
    and a long run divided by the difference in requests."""
    runs = []
    for count in (requests // 4, requests):
        counter = PathCounter()
        sys.setprofile(counter)
        try:
            asyncio.run(closed_loop(count, max_wait_ms))
        finally:
            sys.setprofile(None)
        runs.append(counter.calls)
    short, long = runs
    return {path: (long[path] - short[path]) / (requests - requests // 4) for path in short}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--top", type=int, default=0, help="list the most called functions")
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    hops_s: list[float] = []
    times_s: list[float] = []
    for _ in range(args.rounds):  # interleaved: the machine's load moves both alike
        hops_s += asyncio.run(bare_hops(args.requests // args.rounds))
        times_s += asyncio.run(closed_loop(args.requests // args.rounds, args.max_wait_ms))
    counted: dict[int, tuple[int, int]] = {}
    per_function: dict[int, dict[str, int]] = {}
    for requests in (args.requests // 4, args.requests):
        profile = cProfile.Profile()
        profile.enable()
        asyncio.run(closed_loop(requests, args.max_wait_ms))
        profile.disable()
        stats = pstats.Stats(profile)
        counted[requests] = (
            stats.total_calls,  # type: ignore[attr-defined]
            _resumptions(stats, "_collect_forever"),
        )
        per_function[requests] = {
            f"{function} ({path.split('service/')[-1]}:{line})": entry[1]
            for (path, line, function), entry in stats.stats.items()  # type: ignore[attr-defined]
        }
    (short, (calls_a, resumed_a)), (long, (calls_b, resumed_b)) = counted.items()
    print(
        f"c=1 round trip: p50 {statistics.median(times_s) * 1e6:.0f} µs "
        f"(the device hop alone: {statistics.median(hops_s) * 1e6:.0f} µs) over "
        f"{len(times_s)} requests; "
        f"{(calls_b - calls_a) / (long - short):.0f} Python calls and "
        f"{(resumed_b - resumed_a) / (long - short):.2f} collector resumptions a request"
    )
    short_calls, long_calls = per_function[short], per_function[long]
    added = {
        name: (calls - short_calls.get(name, 0)) / (long - short)
        for name, calls in long_calls.items()
    }
    for name, calls in sorted(added.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{calls:8.2f}  {name}")
    paths = path_calls(args.requests, args.max_wait_ms)
    print(
        f"calls a request in the collector task: {paths['collector']:.1f}; "
        f"in enqueue: {paths['enqueue']:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
