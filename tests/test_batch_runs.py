"""Runs of full batches (``max_run_ms``): several handed to the device at once, run back to
back, each answered as a batch of its own; the next run queued behind the one running. The
device is a ``ManualExecutor``: each hand-off is one call the test finishes, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.engine.batcher.adaptive import AdaptivePolicy
from service.engine.batcher.collector import joins_run, max_estimate
from service.engine.batcher.policy import Target
from service.engine.batcher.run import StallWatch
from service.engine.device_turns import DeviceTurns
from service.errors import InferenceError, ServiceError
from service.metrics import EngineMetrics
from tests.fixtures import (
    MEASURED_FORWARD_S,
    Batcher,
    BatcherFactory,
    ManualExecutor,
    Payload,
    PoisonModel,
    RecordingDoubler,
    SteppedClock,
    sample,
    wait_until,
)

#: Long enough for three measured batches, not four.
THREE_BATCHES_MS = 3.5 * MEASURED_FORWARD_S * 1e3


@pytest.fixture
async def make_batcher() -> AsyncIterator[BatcherFactory]:
    factory = BatcherFactory()
    yield factory
    await factory.aclose()


async def busy_device(
    make_batcher: BatcherFactory, model: RecordingDoubler
) -> tuple[Batcher, ManualExecutor, asyncio.Task[list[Payload]]]:
    """A batcher of 2-row batches and runs of up to three, its device busy with a first
    request ([100]) until the test finishes it."""
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_run_ms=THREE_BATCHES_MS)
    first = asyncio.create_task(batcher.submit([100], group="g"))
    await wait_until(lambda: device.pending == 1)
    return batcher, device, first


def test_a_batch_joins_a_run_only_while_both_are_known_and_end_within_the_bound() -> None:
    assert joins_run(0.004, 0.005, 0.010)
    assert joins_run(0.005, 0.005, 0.010)  # exactly at the bound
    assert not joins_run(0.006, 0.005, 0.010)
    assert not joins_run(None, 0.001, 0.010)  # a batch of unknown duration runs alone
    assert not joins_run(0.001, None, 0.010)
    assert not joins_run(0.0, 0.0, 0.0)  # no runs: max_run_ms 0 takes none, however quick
    assert max_estimate([0.001, 0.003, 0.002]) == 0.003
    assert max_estimate([0.001, None]) is None
    assert max_estimate([]) == 0.0


async def test_full_batches_queued_behind_the_device_run_in_one_hand_off(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher, device, first = await busy_device(make_batcher, model)
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in range(1, 9)]
    await wait_until(lambda: batcher.queue_depth == 8)

    device.finish_next()  # the first batch: then three full batches go at once, and the
    await wait_until(lambda: device.pending == 2)  # fourth, past the bound, queued behind them
    assert first.done()
    assert batcher.queue_depth == 0
    device.finish_next()
    assert model.batch_rows == [1, 2, 2, 2]  # the run: each batch its own forward
    await device.finish_until(lambda: all(task.done() for task in queued))

    assert model.batch_rows == [1, 2, 2, 2, 2]
    assert [await task for task in queued] == [[[2 * row]] for row in range(1, 9)]
    assert await first == [[200]]


class ClockAdvancingDoubler(RecordingDoubler):
    """Each batch takes ``seconds`` of the batcher's clock (the device's time passing)."""

    def __init__(self, clock: SteppedClock, seconds: float) -> None:
        super().__init__()
        self.clock = clock
        self.seconds = seconds

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self.clock.advance(self.seconds)
        return super().__call__(payloads)


async def test_each_batch_of_a_run_ends_its_requests_queue_wait_when_the_device_begins_it() -> None:
    clock = SteppedClock()
    clock.freeze()
    factory = BatcherFactory(clock)
    metrics = EngineMetrics()
    device = ManualExecutor()
    batcher = factory(
        ClockAdvancingDoubler(clock, 0.002),
        metrics=metrics,
        executor=device,
        max_batch_size=2,
        max_run_ms=THREE_BATCHES_MS,
    )
    try:
        tickets = [batcher.enqueue([row], group="g") for row in range(1, 7)]
        await wait_until(lambda: device.pending == 1)  # one run of three batches, at 0 s
        device.finish_next()  # the device begins them at 0, 2 and 4 ms
        await wait_until(lambda: all(ticket.done for ticket in tickets))

        name = "batchserve_queue_wait_seconds"
        assert sample(metrics, f"{name}_count") == 6
        assert sample(metrics, f"{name}_sum") == pytest.approx(2 * (0 + 0.002 + 0.004))
    finally:
        await factory.aclose()


async def test_the_next_run_is_queued_behind_the_running_one_while_full_batches_wait(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_run_ms=THREE_BATCHES_MS)
    tickets = [batcher.enqueue([row], group="g") for row in range(1, 13)]

    await wait_until(lambda: device.pending == 2)  # one run on the device, the next behind it
    assert batcher.queue_depth == 0
    await device.finish_until(lambda: all(ticket.done for ticket in tickets))

    assert model.batch_rows == [2] * 6
    assert [await ticket.wait() for ticket in tickets] == [[[2 * row]] for row in range(1, 13)]


async def test_with_max_run_ms_zero_each_batch_is_a_hand_off_of_its_own(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_run_ms=0)
    tickets = [batcher.enqueue([row], group="g") for row in range(1, 7)]
    for handed in range(3):
        await wait_until(lambda: device.pending == 1)
        assert model.calls == handed
        device.finish_next()
    await wait_until(lambda: all(ticket.done for ticket in tickets))
    assert model.batch_rows == [2, 2, 2]


async def test_a_group_still_filling_ends_the_run(make_batcher: BatcherFactory) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model,
        executor=device,
        max_batch_size=2,
        max_run_ms=THREE_BATCHES_MS,
        policy="fixed",
        max_wait_ms=60_000,  # the filling group is never due during the test
    )
    first = asyncio.create_task(batcher.submit([100, 101], group="g"))
    await wait_until(lambda: device.pending == 1)
    full = [asyncio.create_task(batcher.submit([row, row], group="g")) for row in (1, 2)]
    filling = asyncio.create_task(batcher.submit([9], group="h"))
    await wait_until(lambda: batcher.queue_depth == 3)

    device.finish_next()
    await wait_until(lambda: first.done() and device.pending == 1)
    assert batcher.queue_depth == 2  # one full batch taken, alone: "h" is not ready
    device.finish_next()
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    await asyncio.gather(*full)
    assert model.batch_rows == [2, 2, 2]
    assert not filling.done()
    filling.cancel()


async def test_a_batch_that_fails_in_a_run_fails_only_its_culprit_and_the_rest_are_answered(
    make_batcher: BatcherFactory,
) -> None:
    model = PoisonModel(poison=3)
    batcher, device, first = await busy_device(make_batcher, model)
    tickets = [batcher.enqueue([row], group="g") for row in range(1, 7)]
    device.finish_next()
    await device.finish_until(lambda: all(ticket.done for ticket in tickets))

    await first
    for row, ticket in zip(range(1, 7), tickets, strict=True):
        if row == 3:
            with pytest.raises(InferenceError):
                await ticket.wait()
        else:
            assert await ticket.wait() == [[2 * row]]
    # The run stopped at [3, 4]; its halves ran again, then [5, 6], which the run never reached.
    assert model.batches[1:] == [[[1], [2]], [[3], [4]], [[3]], [[4]], [[5], [6]]]


async def test_a_batch_of_a_run_whose_requests_all_went_is_not_computed(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher, device, first = await busy_device(make_batcher, model)
    tickets = [batcher.enqueue([row], group="g") for row in range(1, 7)]
    device.finish_next()
    await wait_until(lambda: first.done() and device.pending == 1 and batcher.queue_depth == 0)
    tickets[2].cancel()  # [3, 4]: both requests gone while the run waits for the device
    tickets[3].cancel()
    device.finish_next()
    await wait_until(lambda: all(ticket.done for ticket in tickets))

    assert model.computed_rows == [100, 1, 2, 5, 6]
    assert [await ticket.wait() for ticket in (tickets[0], tickets[1], tickets[4], tickets[5])] == [
        [[2]],
        [[4]],
        [[10]],
        [[12]],
    ]


async def test_a_run_s_stall_clock_starts_again_at_each_of_its_batches() -> None:
    clock = SteppedClock()
    clock.freeze()
    stalls: list[str] = []
    watch = StallWatch(clock, 10.0, lambda: stalls.append("stalled"))
    run = watch.started(clock.now())
    for _ in range(3):  # three batches of 6 s each: none outlives the timeout
        watch.began(run, clock.now())
        clock.advance(6.0)
        for _ in range(3):
            await asyncio.sleep(0)
    assert stalls == []
    clock.advance(4.0)  # the third has now run 10 s
    for _ in range(3):
        await asyncio.sleep(0)
    assert stalls == ["stalled"]
    watch.finished(run)
    watch.began(run, clock.now())  # a run already finished is not watched again
    watch.close()


async def test_another_model_waiting_for_the_device_is_seen_as_contention() -> None:
    turns = DeviceTurns()
    mine, other = turns.for_model("mine"), turns.for_model("other")
    await mine.acquire()
    assert not mine.contended
    assert not other.contended
    waiting = asyncio.create_task(other.acquire())
    await asyncio.sleep(0)
    assert mine.contended  # "other" waits for the device "mine" holds
    assert not other.contended
    mine.release()
    await waiting
    assert not mine.contended
    other.release()


async def test_nothing_is_queued_behind_a_batch_longer_than_max_run_ms(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    half_a_batch_ms = MEASURED_FORWARD_S * 1e3 / 2
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_run_ms=half_a_batch_ms)
    tickets = [batcher.enqueue([row], group="g") for row in range(1, 7)]
    for handed in range(3):  # a batch at a time, each chosen once the one before is back
        await wait_until(lambda: device.pending == 1)
        for _ in range(10):  # turns of the event loop: the collector would act in them
            await asyncio.sleep(0)
        assert device.pending == 1
        assert batcher.queue_depth == 4 - 2 * handed
        device.finish_next()
    await wait_until(lambda: all(ticket.done for ticket in tickets))
    assert model.batch_rows == [2, 2, 2]


async def test_a_run_whose_first_batch_came_out_empty_keeps_the_collector_serving() -> None:
    """Every head of the ready group is too late to finish even alone when the device frees:
    the batch taken is empty (they are answered 504), and the next requests are served."""
    clock = SteppedClock()
    factory = BatcherFactory(clock)
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = factory(model, executor=device, max_batch_size=2, max_run_ms=THREE_BATCHES_MS)
    try:
        first = asyncio.create_task(batcher.submit([100], group="g"))
        await wait_until(lambda: device.pending == 1)
        soon_s = clock.now() + 0.05
        late = [batcher.enqueue([row], group="g", deadline_s=soon_s) for row in range(1, 5)]
        clock.advance(0.05 - MEASURED_FORWARD_S / 2)  # not expired; too late to run (1 ms)
        device.finish_next()
        await first
        await wait_until(lambda: all(ticket.done for ticket in late))
        for ticket in late:
            with pytest.raises(ServiceError) as refused:
                await ticket.wait()
            assert refused.value.status_code == 504
        after = asyncio.create_task(batcher.submit([7], group="g"))
        await device.finish_until(after.done)
        assert await after == [[14]]
        assert model.computed_rows == [100, 7]
    finally:
        await factory.aclose()


class _BrokenPolicy(AdaptivePolicy):
    """Chooses the first batch, then fails: a mistake in choosing batches."""

    def __init__(self) -> None:
        super().__init__(0.005)
        self.targets = 0

    def target(self, row_limit: int) -> Target:
        self.targets += 1
        if self.targets > 1:
            raise RuntimeError("a bug in the policy")
        return super().target(row_limit)


async def test_a_collector_that_fails_reports_the_batcher_stalled_and_answers_the_queue(
    make_batcher: BatcherFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stalls: list[str] = []
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model,
        executor=device,
        policy=_BrokenPolicy(),
        on_stall=lambda: stalls.append("stalled"),
    )
    first = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: device.pending == 1)
    queued = batcher.enqueue([2], group="g")
    device.finish_next()
    assert await first == [[2]]
    with pytest.raises(ServiceError) as refused:
        await queued.wait()
    assert refused.value.status_code == 503
    assert stalls == ["stalled"]
    assert batcher.stalled
    assert not batcher.accepting
    assert "collector_failed" in caplog.text
