"""The generation loop (``engine/generation_loop.py``) around a fake batch, without a model:
what happens between its device thread and the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from service.bridge.interface import GenerateRequest
from service.bridge.streams import TokenQueue
from service.engine.batcher.run import StallWatch
from service.engine.device_turns import DeviceTurns
from service.engine.generation.sequences import GenerationRequest, TokenEvent
from service.engine.generation_loop import GenerationLoop
from service.metrics import EngineMetrics
from tests.fixtures import SteppedClock

PROMPTLY_S = 60.0


class GatedDecodeBatch:
    """A continuous batch of one sequence whose decode waits for ``gate`` (set from the
    test): a step held in flight on the device thread."""

    slots = 1
    max_waiting_sequences = 0
    waiting = 0

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.decoding = threading.Event()
        self.decoded = threading.Event()
        self._sequence: Hashable | None = None

    @property
    def running(self) -> int:
        return 0 if self._sequence is None else 1

    @property
    def prefill_due(self) -> bool:
        return False

    def check(self, request: GenerationRequest) -> int:
        return request.max_tokens or 1

    def submit(self, request: GenerationRequest) -> None:
        self._sequence = request.request_id

    def cancel(self, request_id: Hashable) -> bool:
        self._sequence = None
        return True

    def prefill(self) -> list[TokenEvent]:
        return []

    def decode(self) -> list[TokenEvent]:
        sequence = self._sequence
        self.decoding.set()
        self.gate.wait(PROMPTLY_S)
        self._sequence = None
        self.decoded.set()
        return [TokenEvent(sequence, 7, finish_reason="length")]


async def test_a_step_that_ends_after_the_loop_drained_leaves_no_stall_watch_armed() -> None:
    """A stream cancelled while its step runs lets ``drain`` finish at once; when that step
    comes back later, nothing rearms the stall watch, so the retired loop is never reported
    stalled (which would mark the engine not ready)."""
    clock = SteppedClock()
    stalls: list[str] = []
    batch = GatedDecodeBatch()
    executor = ThreadPoolExecutor(1)
    loop = GenerationLoop(
        cast(Any, batch),
        model="lm",
        version="v1",
        executor=executor,
        turns=DeviceTurns().for_model("lm"),
        metrics=EngineMetrics(),
        stall=StallWatch(clock, 30.0, lambda: stalls.append("stalled")),
    )
    loop.start()
    try:
        key = loop.submit(GenerateRequest("lm", "v1", (1, 2), max_tokens=1), TokenQueue())
        await asyncio.to_thread(batch.decoding.wait, PROMPTLY_S)
        loop.cancel(key)
        await loop.drain()
        batch.gate.set()
        await asyncio.to_thread(batch.decoded.wait, PROMPTLY_S)
    finally:
        batch.gate.set()
        await asyncio.to_thread(executor.shutdown, wait=True)
    for _ in range(3):  # the step's last events, posted from the device thread, run
        await asyncio.sleep(0)
    clock.advance(60.0)
    for _ in range(3):  # the timers that came due run on the loop's next turns
        await asyncio.sleep(0)
    assert stalls == []
    assert not loop.stalled
