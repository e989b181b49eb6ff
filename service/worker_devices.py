"""Which device each gunicorn worker serves on: one GPU per worker while there are enough.

gunicorn numbers workers only by spawn order (``worker.age`` keeps growing as workers are
replaced), so the master gives each new worker the lowest *slot* no live worker holds; a
worker that replaces a dead one then takes over its GPU instead of doubling up on another.
"""

from __future__ import annotations

from collections.abc import Iterable

#: ``device`` settings that let batchserve choose the GPU; ``cpu`` and ``cuda:N`` are kept.
_CHOOSABLE_DEVICES = frozenset({"auto", "cuda"})


def chooses_gpu(device: str) -> bool:
    """Whether the ``device`` setting leaves the choice of GPU to batchserve."""
    return device in _CHOOSABLE_DEVICES


def lowest_free_slot(taken: Iterable[int]) -> int:
    """The smallest non-negative slot not in ``taken`` (the slots of the live workers)."""
    used = set(taken)
    slot = 0
    while slot in used:
        slot += 1
    return slot


def device_for_worker(device: str, slot: int, cuda_device_count: int) -> str:
    """The ``device`` setting for the worker in ``slot``.

    With ``auto`` or ``cuda`` and at least one GPU, worker ``slot`` takes ``cuda:<slot>``; with
    more workers than GPUs they wrap around (``slot % count``), so GPUs are shared as evenly as
    the counts allow. ``cpu``, an explicit ``cuda:N``, and ``auto`` without a GPU are returned
    unchanged: the operator's choice, or nothing to spread.
    """
    if slot < 0:
        raise ValueError(f"a worker slot is 0 or more, got {slot}")
    if not chooses_gpu(device) or cuda_device_count < 1:
        return device
    return f"cuda:{slot % cuda_device_count}"
