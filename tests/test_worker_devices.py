"""One GPU per gunicorn worker: slots and devices, checked without a GPU (pure functions)."""

from __future__ import annotations

import pytest

from service.worker_devices import chooses_gpu, device_for_worker, lowest_free_slot


def test_slots_fill_from_zero_and_a_replacement_takes_the_dead_workers_slot() -> None:
    assert lowest_free_slot([]) == 0
    assert lowest_free_slot([0, 1, 2]) == 3
    # Worker in slot 1 died; its replacement gets slot 1 (and so its GPU), not slot 3.
    assert lowest_free_slot([0, 2]) == 1
    assert lowest_free_slot([2, 0, 1, 4]) == 3


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_as_many_workers_as_gpus_gives_each_worker_its_own_gpu(device: str) -> None:
    assert [device_for_worker(device, slot, cuda_device_count=4) for slot in range(4)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
    ]


def test_more_workers_than_gpus_share_them_evenly() -> None:
    devices = [device_for_worker("auto", slot, cuda_device_count=2) for slot in range(5)]
    assert devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]


@pytest.mark.parametrize(
    ("device", "cuda_device_count", "expected"),
    [
        ("auto", 0, "auto"),  # no GPU: the runner picks the CPU
        ("cuda", 0, "cuda"),  # no GPU: the runner refuses with its own message
        ("cpu", 4, "cpu"),
        ("cuda:3", 4, "cuda:3"),  # pinned by the operator: every worker on cuda:3
    ],
)
def test_other_devices_are_left_as_configured(
    device: str, cuda_device_count: int, expected: str
) -> None:
    assert device_for_worker(device, 2, cuda_device_count) == expected
    assert chooses_gpu(device) == (device in ("auto", "cuda"))


def test_a_negative_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="got -1"):
        device_for_worker("auto", -1, 2)
