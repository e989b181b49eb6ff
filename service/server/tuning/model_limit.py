"""The model limit: rows/s of the model alone per batch size and padded length, in process.

The model is loaded exactly as ``batchserve serve`` loads it (the lifespan of
``service.server.single.create_app`` with the same settings: store, runner, device, precision,
compile mode, torch threads), then ``TorchRunner.run_batch`` (collation, forward, split) is
timed with ``perf_counter`` on the runner's own device thread. Every cell is bounded in time
and iterations, and a row of cells stops at the first batch too slow to meet the p99 target:
larger ones are never served, so they are not measured either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import numpy as np
import torch

from service.config import Settings
from service.engine.engine import Engine
from service.engine.outputs import example_inputs
from service.engine.state import ServedModel
from service.manifest import Manifest
from service.server.single import loaded
from service.server.tuning.search import ModelLimit
from service.tensors import NamedArrays

MIN_ITERATIONS = 2
MAX_ITERATIONS = 1000


def example_batch(
    manifest: Manifest, rows: int, length: int | None, rng: np.random.Generator
) -> NamedArrays:
    """Random rows of every input, within each one's declared values and never its padding
    (as the warm-up makes them); variable axes get ``length`` (1 when not given)."""
    return NamedArrays(example_inputs(manifest, rows, length or 1, rng))


def time_batch(
    run_batch: Callable[[list[NamedArrays]], object],
    batch: NamedArrays,
    max_seconds: float,
    max_iterations: int = MAX_ITERATIONS,
    warmup_iterations: int = 1,
    min_iterations: int = MIN_ITERATIONS,
) -> float:
    """Rows/s of ``run_batch([batch])`` after warm-up, bounded in time and iterations (at
    least ``min_iterations``)."""
    for _ in range(warmup_iterations):  # compiles this shape when compiling
        run_batch([batch])
    iterations = 0
    elapsed_s = 0.0
    started_s = time.perf_counter()
    while iterations < max(max_iterations, min_iterations):
        run_batch([batch])
        iterations += 1
        elapsed_s = time.perf_counter() - started_s
        if iterations >= min_iterations and elapsed_s >= max_seconds:
            break
    return len(batch) * iterations / elapsed_s


@asynccontextmanager
async def served_in_process(settings: Settings) -> AsyncIterator[ServedModel]:
    """The model ``settings`` serve, loaded and warmed up in this process as a server would
    (for timing its forward without HTTP); released on exit."""
    async with loaded(settings) as app:
        engine: Engine = app.state.engine
        assert engine.served is not None  # loaded, or ModelLoadError
        yield engine.served


def powers_of_two_up_to(largest: int) -> list[int]:
    return [1 << exponent for exponent in range(largest.bit_length()) if 1 << exponent <= largest]


async def measure_limit(
    settings: Settings,
    *,
    lengths: Sequence[int | None],
    largest_batch: int,
    slowest_batch_ms: float,
    budget_s: float,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[ModelLimit, Manifest]:
    """Rows/s per length and batch size (powers of two up to ``largest_batch``) within
    ``budget_s`` (cells left when it runs out are not measured, but batch 1 of every length
    always is: a load slower than the budget, on a busy host, left a limit of 0 rows/s); the
    model's memory as the engine measured it at load."""
    sizes = powers_of_two_up_to(largest_batch)
    per_cell_s = max(0.05, budget_s / max(1, len(sizes) * len(lengths)) * 0.7)
    deadline_s = time.monotonic() + budget_s
    async with served_in_process(settings) as served:
        runner, manifest = served.runner, served.manifest
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(0)
        rows_per_s: dict[int | None, dict[int, float]] = {length: {} for length in lengths}
        too_slow: set[int | None] = set()
        # Batch sizes outer: when the budget ends, every length has its small batches.
        for size in sizes:
            for length in lengths:
                out_of_time = size > sizes[0] and time.monotonic() >= deadline_s
                if length in too_slow or out_of_time:
                    continue
                batch = example_batch(manifest, size, length, rng)
                rate = await loop.run_in_executor(
                    runner.executor, time_batch, runner.run_batch, batch, per_cell_s
                )
                rows_per_s[length][size] = rate
                batch_ms = size / rate * 1000
                shown = f"length {length}, " if length is not None else ""
                progress(
                    f"model limit: {shown}batch {size}: {rate:,.0f} rows/s ({batch_ms:.2f} ms)"
                )
                if batch_ms > slowest_batch_ms:
                    too_slow.add(length)
        limit = ModelLimit(
            rows_per_s=rows_per_s,
            memory_bytes=served.memory_bytes,
            torch_threads=torch.get_num_threads(),
        )
        return limit, manifest
