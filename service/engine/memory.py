"""What each model takes of its device's memory, and the budget that bounds their sum.

A model's memory is measured around its load and warm-up: CUDA memory allocated on a GPU, the
growth of the engine's resident memory on the CPU (weights, the allocator's caches of the
warm-up's activations, compiled kernels). Before a load, the budget is checked against an
estimate (the version's own measurement from an earlier load, else the size of its weight
files); after the warm-up, against what was measured. A load that does not fit is refused
with 409 naming what is loaded and how much each takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import torch

from service.errors import ConflictError
from service.manifest import Manifest
from service.metrics import resident_memory_bytes

MIB = 1024 * 1024


def memory_in_use(device: torch.device) -> int:
    """Bytes in use now: CUDA memory allocated on ``device``, or this process's RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident_memory_bytes()


def taken_since(device: torch.device, before_bytes: int, folder: Path, manifest: Manifest) -> int:
    """What a version took since ``memory_in_use`` was ``before_bytes``. On the CPU at least
    its artifact's size: resident memory also moves with what the other models free and
    reuse meanwhile, which can hide a small model's growth."""
    grown = memory_in_use(device) - before_bytes
    if device.type == "cuda":
        return max(0, grown)
    return max(grown, artifact_bytes(folder, manifest))


def release_freed_memory(device: torch.device) -> None:
    """Hand memory freed by a retired model back to the device: CUDA's cache is emptied;
    on the CPU glibc's ``malloc_trim`` returns freed heap pages, which it otherwise keeps."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    return trim


def artifact_bytes(folder: Path, manifest: Manifest) -> int:
    """The size of a version's artifact (its weights, or its compiled program): the least
    it will take, before it has been measured."""
    try:
        return (folder / manifest.artifact).stat().st_size
    except OSError:
        return 0


def check_budget(
    budget_mb: int, label: str, needed_bytes: int, others: Iterable[tuple[str, int]], how: str
) -> None:
    """Raise 409 when ``needed_bytes`` for ``label`` beside ``others`` (``name@version``,
    bytes) exceed ``budget_mb`` (0: no budget). ``how`` says where ``needed_bytes`` comes
    from."""
    if budget_mb <= 0:
        return
    others = list(others)
    total = needed_bytes + sum(size for _, size in others)
    if total <= budget_mb * MIB:
        return
    loaded = ", ".join(f"{name} {_mib(size)}" for name, size in others) or "nothing"
    raise ConflictError(
        f"{label} needs {_mib(needed_bytes)} ({how}), and with what is loaded ({loaded}) that "
        f"is {_mib(total)}, over the device memory budget of {budget_mb} MiB "
        "(BATCHSERVE_DEVICE_MEMORY_BUDGET_MB); unload a model first "
        "(POST /admin/models/{name}/unload) or raise the budget"
    )


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
