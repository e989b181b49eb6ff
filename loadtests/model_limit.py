"""The model limit: in-process forward throughput (rows/s) at batch sizes 1, 2, 4 ... max.

The model is loaded exactly as the server loads it, by running the lifespan of
``service.server.single.create_app`` for the same ``BATCHSERVE_*`` settings (an engine process
loads it the same way, with ``service.engine.engine.Engine``): ``ModelStore.load``, then
``TorchRunner`` with the same device, precision, compile mode, length buckets and
``configure_torch_threads``, and the server's warm-up. Then ``TorchRunner.run_batch``
(collation, forward, split) is timed with ``time.perf_counter`` in the runner's own device
thread (``service.server.tuning.model_limit``, as ``batchserve tune`` times it), after
``WARMUP_ITERATIONS`` untimed runs per batch size. Each batch size runs for at
most ``--max-seconds-per-size`` seconds and ``--max-iterations`` runs (at least
``MIN_ITERATIONS``). Prints one JSON object on stdout.

    BATCHSERVE_PRECISION=bf16 python -m loadtests.model_limit --max-seconds-per-size 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from functools import partial

import numpy as np
import torch

from service.config import load_settings
from service.engine.runner import batch_sizes_to_warm
from service.server.tuning.model_limit import example_batch, served_in_process, time_batch

WARMUP_ITERATIONS = 3
MIN_ITERATIONS = 3


async def measure(
    *, length: int | None, max_seconds_per_size: float, max_iterations: int
) -> dict[str, object]:
    settings = load_settings()
    async with served_in_process(settings) as served:
        runner, manifest = served.runner, served.manifest
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(0)
        rows_per_s: dict[int, float] = {}
        for size in batch_sizes_to_warm(settings.max_batch_size):
            batch = example_batch(manifest, size, length, rng)
            rows_per_s[size] = await loop.run_in_executor(
                runner.executor,
                partial(
                    time_batch,
                    warmup_iterations=WARMUP_ITERATIONS,
                    min_iterations=MIN_ITERATIONS,
                ),
                runner.run_batch,
                batch,
                max_seconds_per_size,
                max_iterations,
            )
        return {
            "model": manifest.name,
            "version": manifest.version,
            "device": str(runner.device),
            "precision": settings.precision,
            "compile_mode": settings.compile_mode,
            "torch_threads": torch.get_num_threads(),
            "length": length,
            "rows_per_s": rows_per_s,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=None, help="length of variable axes")
    parser.add_argument("--max-seconds-per-size", type=float, default=1.0)
    parser.add_argument("--max-iterations", type=int, default=2000)
    args = parser.parse_args()
    result = asyncio.run(
        measure(
            length=args.length,
            max_seconds_per_size=args.max_seconds_per_size,
            max_iterations=args.max_iterations,
        )
    )
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
