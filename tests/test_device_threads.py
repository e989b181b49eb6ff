"""The device threads' torch threads (``engine/instances.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from service.engine.instances import device_threads


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
    reason="counts this process's threads in /proc, on a machine where OpenMP would use two",
)
def test_one_instance_runs_on_the_torch_threads_configured_not_openmps_default() -> None:
    """OpenMP's thread count is per calling thread: a device thread that was not given one
    ran its forwards with OpenMP's default (a worker per CPU, spinning between batches)."""
    left = torch.randn(256, 256)
    executor = device_threads(1, 1)
    try:
        executor.submit(lambda: None).result()
        before = thread_count()
        executor.submit(lambda: [left @ left for _ in range(20)]).result()
        assert thread_count() == before  # no OpenMP worker started for the device thread
    finally:
        executor.shutdown()
