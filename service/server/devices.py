"""Which devices get an engine: one engine process per device.

The supervisor decides this without importing torch: with no NVIDIA driver loaded there is no
GPU to count; otherwise a short child process asks torch, so that ``CUDA_VISIBLE_DEVICES`` is
honoured exactly as the engines will see it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

#: Present whenever the NVIDIA kernel driver is loaded.
NVIDIA_DRIVER = Path("/proc/driver/nvidia")
COUNT_TIMEOUT_S = 120.0


def engine_devices(device: str, cuda_device_count: Callable[[], int]) -> list[str]:
    """The device of each engine for the ``device`` setting.

    ``auto``: every GPU, or the CPU when there is none. ``cuda``: every GPU (none is an
    error). ``cpu`` or ``cuda:N``: that device. A list (``cuda:0,cuda:2``): each of them.
    """
    listed = device.split(",")
    if len(listed) > 1 or device not in ("auto", "cuda"):
        return listed
    count = cuda_device_count()
    if count > 0:
        return [f"cuda:{index}" for index in range(count)]
    if device == "cuda":
        raise ValueError("device cuda was requested but no CUDA device is visible")
    return ["cpu"]


def count_cuda_devices() -> int:
    """Visible CUDA devices, asked of torch in a child process (0 without an NVIDIA driver)."""
    if not NVIDIA_DRIVER.exists():
        return 0
    counted = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        timeout=COUNT_TIMEOUT_S,
        check=True,
    )
    return int(counted.stdout.strip() or 0)
