"""The device threads' torch threads (``engine/instances.py``)."""

from __future__ import annotations

import asyncio
import os
import threading

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


async def test_a_batch_result_and_its_error_come_back_on_the_event_loop() -> None:
    threads = device_threads(1, 1)
    try:
        assert await threads.run(sum, [1, 2, 3]) == 6
        with pytest.raises(ZeroDivisionError):
            await threads.run(divmod, 1, 0)
        assert threads.submit(sum, [4, 5]).result() == 9  # warm-ups still submit
    finally:
        threads.shutdown()


async def test_a_batch_cancelled_while_queued_never_runs() -> None:
    threads = device_threads(1, 1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        busy = threads.run(gate.wait, 5.0)
        queued = threads.run(ran.append, "queued")
        queued.cancel()
        gate.set()
        assert await busy
        assert await threads.run(ran.append, "after") is None  # in order: "queued" came first
        assert ran == ["after"]
    finally:
        threads.shutdown()


async def test_a_batch_cancelled_while_it_runs_is_let_go_of_quietly() -> None:
    """Its result arrives for a future already cancelled: dropped, not set twice."""
    threads = device_threads(1, 1)
    started, gate = threading.Event(), threading.Event()
    try:
        running = threads.run(lambda: started.set() or gate.wait(5.0))
        await asyncio.to_thread(started.wait, 5.0)
        running.cancel()
        gate.set()
        assert await threads.run(lambda: "next") == "next"
        assert running.cancelled()
    finally:
        threads.shutdown()


def test_shutdown_runs_what_is_queued_then_refuses_more() -> None:
    threads = device_threads(2, 2)
    gate = threading.Event()
    queued = [threads.submit(gate.wait, 5.0) for _ in range(4)]
    gate.set()
    threads.shutdown(wait=True)
    assert all(future.result() for future in queued)
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit(sum, [])
    threads.shutdown()  # twice is harmless
