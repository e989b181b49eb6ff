"""DynamicBatcher: batch forming, isolation of failures, cancellation, deadlines, draining.

Time: the batchers read a ``SteppedClock`` that a test moves on (``settle_after``) instead of
sleeping; anything that must *not* wait for a long ``max_wait_ms`` runs under an
``asyncio.timeout`` far shorter than that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from service.engine.batcher import OOM_BACKOFF_S, QUEUE_DEPTH_REFRESH_S, Submission, Ticket
from service.engine.batcher.adaptive import AdaptivePolicy, split_rows, target_rows
from service.engine.batcher.policy import FixedPolicy
from service.engine.device_turns import DeviceTurns
from service.errors import (
    DeadlineExceededError,
    InferenceError,
    InsufficientDeviceMemoryError,
    InvalidInputError,
    NotReadyError,
    OverloadedError,
    QueueFullError,
)
from service.metrics import EngineMetrics
from tests.fixtures import (
    Batcher,
    BatcherFactory,
    CountingThreadExecutor,
    GatedModel,
    ManualExecutor,
    MiscountingModel,
    OutOfMemoryAbove,
    Payload,
    PoisonAnsweringModel,
    PoisonModel,
    RecordingDoubler,
    RecordingSink,
    SteppedClock,
    doubled,
    dropped,
    flatten,
    sample,
    sample_total,
    wait_until,
)

#: Far longer than any test should take: a batch that waits this long is a failure.
LONG_WAIT_MS = 10_000
#: Bound on how long something that must happen "at once" may take.
PROMPTLY_S = 2.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def clock() -> SteppedClock:
    """The batchers' clock, moved on by the test (``clock.advance``) instead of sleeping."""
    return SteppedClock()


@pytest.fixture
async def make_batcher(clock: SteppedClock) -> AsyncIterator[BatcherFactory]:
    """Builds started batchers; afterwards drains them, and fails the test if the event loop
    reported an error (e.g. a future's exception never retrieved) or the collector caught an
    unexpected one (e.g. a future set twice)."""
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    batching_log = logging.getLogger("service.engine.batching")
    records = _Records()
    batching_log.addHandler(records)
    factory = BatcherFactory(clock)
    try:
        yield factory
        await factory.aclose()
        gc.collect()  # "exception was never retrieved" is reported when the future is freed
    finally:
        loop.set_exception_handler(previous_handler)
        batching_log.removeHandler(records)
    assert loop_errors == []
    assert "batch_failed_unexpectedly" not in records.messages


async def settle_after(clock: SteppedClock, seconds: float) -> None:
    """Move the batchers' clock on ``seconds`` (firing the timers due) and let the event loop
    run what that set off: no real time passes."""
    clock.advance(seconds)
    for _ in range(20):
        await asyncio.sleep(0)


async def submit_all(batcher: Any, payloads: list[Payload], group: object = "g") -> list[Any]:
    return await asyncio.gather(
        *(batcher.submit(payload, group=group) for payload in payloads), return_exceptions=True
    )


# --------------------------------------------------------------------------- forming batches


async def test_full_batch_runs_without_waiting_for_max_wait(make_batcher: BatcherFactory) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=LONG_WAIT_MS)

    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [2], [3], [4]])

    assert results == [[[2]], [[4]], [[6]], [[8]]]
    assert model.batches == [[[1], [2], [3], [4]]]


async def test_fixed_policy_runs_a_partial_batch_after_max_wait(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=50, policy="fixed")

    started_s = time.monotonic()
    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [2]])
    elapsed_s = time.monotonic() - started_s

    assert results == [[[2]], [[4]]]
    assert model.batches == [[[1], [2]]]
    assert elapsed_s >= 0.04


async def test_batch_is_collected_only_once_the_device_is_free(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=8, max_wait_ms=50)
    first = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()

    early = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    # Past max_wait: a batcher that closed its next batch before the device was free would
    # have closed it on [1, 2] by now, and run [3, 4, 5] as a third batch.
    await settle_after(clock, 0.12)
    late = [asyncio.create_task(batcher.submit([row], group="g")) for row in (3, 4, 5)]
    await wait_until(lambda: batcher.queue_depth == 5)
    model.release()

    async with asyncio.timeout(PROMPTLY_S):
        results = await asyncio.gather(first, *early, *late)
    assert results == [[doubled([row])] for row in range(6)]
    assert model.batch_rows == [1, 5]
    assert model.batches[1] == [[1], [2], [3], [4], [5]]


async def test_multi_row_request_is_never_split_across_batches(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=50)

    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1, 2], [3, 4, 5]])

    assert results == [[[2, 4]], [[6, 8, 10]]]
    assert model.batches == [[[1, 2]], [[3, 4, 5]]]


async def test_request_larger_than_max_batch_size_is_split_and_reassembled_in_order(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=50)
    rows = list(range(1, 11))

    async with asyncio.timeout(PROMPTLY_S):
        outputs = await batcher.submit(rows, group="g")

    assert model.batch_rows == [4, 4, 2]
    assert outputs == [doubled(rows[0:4]), doubled(rows[4:8]), doubled(rows[8:10])]
    assert flatten(outputs) == doubled(rows)


async def test_groups_are_never_mixed_in_one_batch(make_batcher: BatcherFactory) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=8, max_wait_ms=50)
    group_of_row = {1: "a", 2: "b", 3: "a", 4: "b", 5: "a", 6: ("b", 2)}

    async with asyncio.timeout(PROMPTLY_S):
        results = await asyncio.gather(
            *(batcher.submit([row], group=group) for row, group in group_of_row.items())
        )

    assert results == [[doubled([row])] for row in group_of_row]
    assert sorted(model.computed_rows) == sorted(group_of_row)
    for batch in model.batches:
        groups = {group_of_row[payload[0]] for payload in batch}
        assert len(groups) == 1, f"batch {batch} mixes groups {groups}"
    assert sorted(model.batch_rows) == [1, 2, 3]


# --------------------------------------------------------------------------- cancellation


async def test_request_cancelled_while_queued_is_never_computed(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=4, max_wait_ms=50)
    busy = asyncio.create_task(batcher.submit([100], group="g"))
    await model.wait_started()
    kept_before = asyncio.create_task(batcher.submit([1], group="g"))
    cancelled = asyncio.create_task(batcher.submit([2], group="g"))
    kept_after = asyncio.create_task(batcher.submit([3], group="g"))
    await wait_until(lambda: batcher.queue_depth == 3)

    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert batcher.queue_depth == 2
    assert dropped(metrics, "cancelled") == 1
    model.release()

    async with asyncio.timeout(PROMPTLY_S):
        assert await asyncio.gather(busy, kept_before, kept_after) == [[[200]], [[2]], [[6]]]
        assert await batcher.submit([4], group="g") == [[8]]
    assert 2 not in model.computed_rows
    assert model.batches[1] == [[1], [3]]


async def test_request_cancelled_while_its_batch_runs_leaves_batch_mates_unharmed(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, max_wait_ms=LONG_WAIT_MS)
    cancelled = asyncio.create_task(batcher.submit([1], group="g"))
    mate = asyncio.create_task(batcher.submit([2], group="g"))
    await model.wait_started()

    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    model.release()

    async with asyncio.timeout(PROMPTLY_S):
        assert await mate == [[4]]
        assert await batcher.submit([3, 4], group="g") == [[6, 8]]
    assert model.batches == [[[1], [2]], [[3, 4]]]
    # It was computed, so it is not counted as dropped.
    assert dropped(metrics, "cancelled") == 0


async def test_request_cancelled_just_as_the_device_frees_is_counted_and_never_computed(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, metrics=metrics, executor=device, max_batch_size=1)
    running = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: device.pending == 1)
    leaving = asyncio.create_task(batcher.submit([2], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)

    # The device finishes, and the caller leaves before the collector resumes: the collector
    # then finds the cancelled request at the head of the queue, before its caller cleans up.
    device.finish_next()
    asyncio.get_running_loop().call_soon(leaving.cancel)
    with pytest.raises(asyncio.CancelledError):
        await leaving

    async with asyncio.timeout(PROMPTLY_S):
        assert await running == [[2]]
        await wait_until(lambda: batcher.queue_depth == 0)
    assert device.pending == 0
    assert model.computed_rows == [1]
    assert dropped(metrics, "cancelled") == 1


async def test_cancelling_one_chunk_of_a_split_request_drops_its_queued_chunks(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, max_wait_ms=LONG_WAIT_MS)
    request = asyncio.create_task(batcher.submit([1, 2, 3, 4, 5, 6], group="g"))
    await model.wait_started()
    assert batcher.queue_depth == 2

    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert batcher.queue_depth == 0
    assert dropped(metrics, "cancelled") == 2  # one per never-computed chunk, like queue_depth
    model.release()

    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([7, 8], group="g") == [[14, 16]]
    assert model.batches == [[[1, 2]], [[7, 8]]]


# --------------------------------------------------------------------------- back-pressure


async def test_full_queue_refuses_at_once_with_retry_after(make_batcher: BatcherFactory) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1, max_queue_size=2)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    await wait_until(lambda: batcher.queue_depth == 2)

    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(QueueFullError) as refused:
            await batcher.submit([3], group="g")
    assert not model.released
    assert int(refused.value.headers["Retry-After"]) >= 1
    assert refused.value.status_code == 429
    assert dropped(metrics, "queue_full") == 1
    assert batcher.queue_depth == 2

    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        assert await asyncio.gather(running, *queued) == [[[0]], [[2]], [[4]]]
    assert 3 not in model.computed_rows


async def test_work_ahead_too_long_refuses_any_request_before_its_rows_are_known(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    for _ in range(3):
        batcher.times.record("g", 1, 1.0)  # a row takes 1 s now
    queued = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)
    soon_s = time.monotonic() + 0.5
    assert batcher.refusal_of_any(deadline_s=time.monotonic() + 60) is None
    assert dropped(metrics, "deadline_unreachable") == 0
    refused = batcher.refusal_of_any(deadline_s=soon_s)
    assert isinstance(refused, OverloadedError)
    assert dropped(metrics, "deadline_unreachable") == 1
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, queued)


async def test_a_full_queue_refuses_any_request_before_its_rows_are_known(
    make_batcher: BatcherFactory,
) -> None:
    """``refusal_of_any`` (asked before a body is parsed) refuses exactly when a one-row
    request would be refused, and counts the refusal."""
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1, max_queue_size=2)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([1], group="g"))]
    await wait_until(lambda: batcher.queue_depth == 1)
    assert batcher.refusal_of_any() is None  # one more fits
    queued.append(asyncio.create_task(batcher.submit([2], group="g")))
    await wait_until(lambda: batcher.queue_depth == 2)

    refused = batcher.refusal_of_any()
    assert isinstance(refused, QueueFullError)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert dropped(metrics, "queue_full") == 1
    with pytest.raises(QueueFullError) as raised:
        await batcher.submit([3], group="g")
    assert raised.value.message == refused.message

    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, *queued)
    assert batcher.refusal_of_any() is None


async def test_split_request_that_does_not_fit_in_the_queue_is_refused_whole(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, max_queue_size=2)

    with pytest.raises(QueueFullError):
        await batcher.submit([1, 2, 3, 4, 5], group="g")  # three chunks for two places

    assert batcher.queue_depth == 0
    assert model.calls == 0
    assert dropped(metrics, "queue_full") == 1


# --------------------------------------------------------------------------- deadlines


async def test_queued_request_past_its_deadline_is_answered_and_never_computed(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1, request_timeout_ms=100)
    running = asyncio.create_task(batcher.submit([1], group="g"))
    await model.wait_started()

    started_s = time.monotonic()
    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(DeadlineExceededError) as expired:
            await batcher.submit([2], group="g")
    assert time.monotonic() - started_s >= 0.08
    assert expired.value.status_code == 504
    assert expired.value.message == "the request was not answered within 100 ms"
    assert not model.released  # answered while the device was still busy
    assert batcher.queue_depth == 0
    # The running request is past its deadline too, and is answered as well.
    with pytest.raises(DeadlineExceededError):
        await running
    assert dropped(metrics, "expired") == 2
    assert dropped(metrics, "cancelled") == 0

    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([3], group="g") == [[6]]
    assert model.computed_rows == [1, 3]


async def test_result_arriving_after_the_deadline_does_not_crash_the_collector(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, request_timeout_ms=100)
    late = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    await model.wait_started()

    async with asyncio.timeout(PROMPTLY_S):
        for task in late:
            with pytest.raises(DeadlineExceededError):
                await task
    model.release()
    await wait_until(lambda: model.finished_calls == 1)

    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([3, 4], group="g") == [[6, 8]]
    assert model.finished_calls == 2
    assert dropped(metrics, "expired") == 2


async def test_split_request_past_its_deadline_answers_every_chunk(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, request_timeout_ms=100)

    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(DeadlineExceededError):
            await batcher.submit([1, 2, 3, 4, 5, 6], group="g")
    assert not model.released
    assert batcher.queue_depth == 0
    assert dropped(metrics, "expired") == 3  # one per chunk: running, queued, queued
    model.release()

    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([7], group="g") == [[14]]
    assert model.computed_rows == [1, 2, 7]
    # The harness then checks that no chunk's exception was left unretrieved.


# --------------------------------------------------------------------------- failures


async def test_poison_request_is_isolated_by_halving(make_batcher: BatcherFactory) -> None:
    metrics = EngineMetrics()
    model = PoisonModel(poison=-1)
    batcher = make_batcher(model, metrics=metrics, max_batch_size=8, max_wait_ms=50)

    started_s = time.monotonic()
    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [2, 3], [-1, 4], [5]])

    assert results[0] == [[2]]
    assert results[1] == [[4, 6]]
    assert isinstance(results[2], InferenceError)
    assert isinstance(results[2].__cause__, ValueError)
    assert results[3] == [[10]]
    assert model.batches[0] == [[1], [2, 3], [-1, 4], [5]]
    assert [[-1, 4]] in model.batches  # the culprit ran alone
    assert sample(metrics, "batchserve_batch_failures_total") > 0
    # Failed forwards are timed too.
    assert sample(metrics, "batchserve_inference_duration_seconds_count") == model.calls
    assert (
        sample(metrics, "batchserve_inference_duration_seconds_sum") < time.monotonic() - started_s
    )


async def test_model_returning_the_wrong_number_of_outputs_fails_each_request(
    make_batcher: BatcherFactory,
) -> None:
    model = MiscountingModel()
    batcher = make_batcher(model, max_batch_size=2, max_wait_ms=50)

    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [2]])
        assert all(isinstance(result, InferenceError) for result in results)
        # The collector survives: a later request is still answered (with the same error).
        with pytest.raises(InferenceError):
            await batcher.submit([3], group="g")


# --------------------------------------------------------------------------- draining


async def test_drain_finishes_queued_requests_then_refuses_new_ones(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, max_wait_ms=LONG_WAIT_MS)
    running = asyncio.create_task(batcher.submit([0, 0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3)]
    await wait_until(lambda: batcher.queue_depth == 3)

    draining = asyncio.create_task(batcher.drain())
    await wait_until(lambda: not batcher.accepting)
    with pytest.raises(NotReadyError):
        await batcher.submit([9], group="g")
    assert dropped(metrics, "draining") == 1
    assert not draining.done()

    model.release()
    # The last request is a partial batch: draining must not wait LONG_WAIT_MS for it.
    async with asyncio.timeout(PROMPTLY_S):
        await draining
    assert [task.result() for task in (running, *queued)] == [[[0, 0]], [[2]], [[4]], [[6]]]
    assert model.batch_rows == [2, 2, 1]
    with pytest.raises(NotReadyError):
        await batcher.submit([4], group="g")


async def test_submit_before_start_is_refused() -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    with ThreadPoolExecutor(max_workers=1) as executor:
        batcher = Batcher(
            model,
            executor=executor,
            metrics=metrics.for_model("test", "v1"),
            policy=AdaptivePolicy(0.05),
            max_batch_size=4,
            max_queue_size=4,
            request_timeout_ms=1_000,
        )

        with pytest.raises(NotReadyError) as refused:
            await batcher.submit([1], group="g")
    assert refused.value.status_code == 503
    assert "Retry-After" in refused.value.headers
    assert dropped(metrics, "draining") == 1
    assert model.calls == 0


# --------------------------------------------------------------------------- validation


async def test_empty_request_is_rejected_before_queuing(make_batcher: BatcherFactory) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model)

    with pytest.raises(InvalidInputError):
        await batcher.submit([], group="g")
    assert batcher.queue_depth == 0
    assert model.calls == 0


@pytest.mark.parametrize(("max_batch_size", "max_queue_size"), [(0, 1), (1, 0)])
def test_sizes_below_one_are_rejected(max_batch_size: int, max_queue_size: int) -> None:
    with (
        ThreadPoolExecutor(max_workers=1) as executor,
        pytest.raises(ValueError, match=f"got {max_batch_size} and {max_queue_size}"),
    ):
        Batcher(
            RecordingDoubler(),
            executor=executor,
            metrics=EngineMetrics().for_model("test", "v1"),
            policy=AdaptivePolicy(0.05),
            max_batch_size=max_batch_size,
            max_queue_size=max_queue_size,
            request_timeout_ms=1_000,
        )


# --------------------------------------------------------------------------- metrics


async def test_queue_depth_returns_to_zero_and_batch_size_histogram_counts_forwards(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=4, max_wait_ms=50)
    started_s = clock.now()
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    await settle_after(clock, 2 * QUEUE_DEPTH_REFRESH_S)  # the gauge has followed the first one out
    queued = [asyncio.create_task(batcher.submit([row, row], group="g")) for row in (1, 2, 3)]
    await wait_until(lambda: batcher.queue_depth == 3)
    # The gauge follows within QUEUE_DEPTH_REFRESH_S, not at every change.
    await wait_until(lambda: sample(metrics, "batchserve_queue_depth") == 3)
    queued[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued[1]
    await wait_until(lambda: sample(metrics, "batchserve_queue_depth") == 2)

    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, queued[0], queued[2])

    await wait_until(lambda: sample(metrics, "batchserve_queue_depth") == 0)
    assert model.batch_rows == [1, 4]
    assert sample(metrics, "batchserve_batch_size_rows_count") == 2
    assert sample(metrics, "batchserve_batch_size_rows_sum") == 5
    assert sample_total(metrics.registry, "batchserve_batch_size_rows_bucket", {"le": "1.0"}) == 1
    assert sample(metrics, "batchserve_queue_wait_seconds_count") == 3
    assert sample(metrics, "batchserve_inference_duration_seconds_count") == 2
    elapsed_s = clock.now() - started_s
    assert 0 < sample(metrics, "batchserve_queue_wait_seconds_sum") < elapsed_s
    assert 0 < sample(metrics, "batchserve_inference_duration_seconds_sum") < elapsed_s


async def test_the_depth_gauge_is_written_once_after_a_refresh_interval(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    clock.freeze()
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    await wait_until(lambda: batcher.queue_depth == 2)
    await settle_after(clock, 0.0)
    assert sample(metrics, "batchserve_queue_depth") == 0  # not at every change
    await settle_after(clock, QUEUE_DEPTH_REFRESH_S)
    assert sample(metrics, "batchserve_queue_depth") == 2
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, *queued)


async def test_an_answered_request_does_not_expire_at_its_deadline(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    metrics = EngineMetrics()
    batcher = make_batcher(RecordingDoubler(), metrics=metrics, request_timeout_ms=1_000)
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([1], group="g") == [[2]]
    await settle_after(clock, 2.0)
    assert dropped(metrics, "expired") == 0


async def test_adaptive_policy_dispatches_a_lone_request_at_once(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=10_000)

    async with asyncio.timeout(PROMPTLY_S):  # far below max_wait_ms: nothing waited for it
        results = await submit_all(batcher, [[1]])

    assert results == [[[2]]]


async def queue_behind_a_busy_device(
    batcher: Batcher, model: GatedModel, rows: list[int]
) -> list[asyncio.Task[list[Payload]]]:
    """Run a blocker, queue one request per row behind it, release: the next batch holds
    them all (``len(rows)`` rows), which the adaptive policy then expects again."""
    blocker = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in rows]
    await wait_until(lambda: batcher.queue_depth == len(rows))
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(blocker, *queued)
    return queued


async def test_adaptive_policy_fills_batches_up_to_the_last_batch(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=10_000)
    await queue_behind_a_busy_device(batcher, model, [1, 2])
    assert model.batch_rows == [1, 2]

    # Two clients came back last time: a lone request waits for the second one.
    first = asyncio.create_task(batcher.submit([3], group="g"))
    await settle_after(clock, 0.1)
    assert model.batch_rows == [1, 2], "must wait for a batch as full as the last one"
    second = asyncio.create_task(batcher.submit([4], group="g"))
    async with asyncio.timeout(PROMPTLY_S):
        assert await first == [[6]]
        assert await second == [[8]]
    assert model.batch_rows == [1, 2, 2]


async def test_adaptive_wait_for_batch_mates_is_bounded_by_max_wait(
    make_batcher: BatcherFactory,
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=100)
    await queue_behind_a_busy_device(batcher, model, [1, 2, 3])

    started_s = time.monotonic()
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([4], group="g") == [[8]]
    assert time.monotonic() - started_s >= 0.08  # waited for the batch-mates, then went alone
    assert model.batch_rows == [1, 3, 1]


async def test_batch_cost_budget_limits_rows_per_batch_and_chunks(
    make_batcher: BatcherFactory,
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=8, max_batch_cost=10, max_wait_ms=10_000)

    blocker = asyncio.create_task(batcher.submit([0], group="g", cost_per_row=4))
    await model.wait_started()
    singles = [
        asyncio.create_task(batcher.submit([value], group="g", cost_per_row=4))
        for value in (1, 2, 3)
    ]
    split = asyncio.create_task(batcher.submit([4, 5, 6, 7, 8], group="g", cost_per_row=4))
    costly = asyncio.create_task(batcher.submit([9], group="g", cost_per_row=50))
    await wait_until(lambda: batcher.queue_depth == 7)
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(blocker, *singles, split, costly)

    assert await split == [[8, 10], [12, 14], [16]]  # chunks of 10 // 4 = 2 rows
    assert await costly == [[18]]  # over the whole budget: runs alone
    # Rows per batch: the blocker; [1]+[2] (cost 8, [3] would make 12); [3] (the next chunk
    # would make 12); [4, 5]; [6, 7]; [8] (the costly chunk would exceed); [9] alone.
    assert model.batch_rows == [1, 2, 1, 2, 2, 1, 1]


async def test_high_priority_never_starves_normal_requests(make_batcher: BatcherFactory) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=1, max_wait_ms=10_000)

    blocker = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    normal = [asyncio.create_task(batcher.submit([100 + i], group="g")) for i in range(2)]
    high = [
        asyncio.create_task(batcher.submit([i], group="g", priority="high")) for i in range(1, 8)
    ]
    await wait_until(lambda: batcher.queue_depth == 9)
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(blocker, *normal, *high)

    order = [row for batch in model.batches for payload in batch for row in payload]
    # Three high-priority batches, then the oldest normal one, then three high, then normal.
    assert order == [0, 1, 2, 3, 100, 4, 5, 6, 101, 7]


async def test_a_batch_that_outlives_the_stall_timeout_marks_the_batcher_stalled(
    make_batcher: BatcherFactory,
) -> None:
    model = GatedModel()
    stalls: list[str] = []
    batcher = make_batcher(model, stall_timeout_s=0.1, on_stall=lambda: stalls.append("stalled"))

    running = asyncio.create_task(batcher.submit([1], group="g"))
    await model.wait_started()
    await wait_until(lambda: batcher.stalled)
    assert stalls == ["stalled"]
    assert not batcher.accepting
    with pytest.raises(NotReadyError):
        await batcher.submit([2], group="g")
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        assert await running == [[2]]  # a batch that comes back late is still answered


class ThreadNoting(RecordingDoubler):
    """Doubles, and notes the thread each batch ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self.threads.append(threading.current_thread().name)
        return super().__call__(payloads)


async def test_every_batch_runs_in_the_executor_even_one_known_to_be_quick(
    make_batcher: BatcherFactory,
) -> None:
    """Never on the event loop's thread: a model that hangs there would stop the loop, and
    with it the stall watchdog, the deadlines and the engine's heartbeats."""
    model = ThreadNoting()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=1, measured=False)
    for _ in range(3):
        batcher.times.record("g", 1, 1e-6)
    for rows in ([1], [2], [3]):
        async with asyncio.timeout(PROMPTLY_S):
            assert await batcher.submit(rows, group="g") == [doubled(rows)]
    assert model.threads == ["fake-device_0"] * 3


# ----------------------------------------------------------------- fairness and deadlines


@pytest.mark.parametrize("short_first", [True, False], ids=["short-first", "refills-first"])
async def test_a_full_group_does_not_starve_a_request_that_has_waited_max_wait(
    make_batcher: BatcherFactory, clock: SteppedClock, short_first: bool
) -> None:
    """The collector took a full group whenever there was one: kept full by new arrivals,
    a long bucket held a short request back until its deadline. Now the short request runs
    right after the long batch running, whether it came before the long bucket's refills
    (oldest first) or after them (round robin: the group of the last batch goes after the
    other groups due)."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_wait_ms=30)
    first = [asyncio.create_task(batcher.submit([row], group="long")) for row in (1, 2)]
    await wait_until(lambda: device.pending == 1)  # [1, 2] runs
    arrivals: list[asyncio.Task[list[Payload]]] = []
    for group, rows in sorted([("short", [100]), ("long", [3, 4, 5, 6])], reverse=short_first):
        arrivals += [asyncio.create_task(batcher.submit([row], group=group)) for row in rows]
        await settle_after(clock, 0.01)
    await settle_after(clock, 0.1)  # both groups due
    for _ in range(4):
        await wait_until(lambda: device.pending == 1)
        device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*first, *arrivals)
    assert model.batches == [[[1], [2]], [[100]], [[3], [4]], [[5], [6]]]


async def test_requests_already_received_join_a_batch_whose_oldest_waited_max_wait(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    """The oldest request waited past max_wait while the device was busy; as the device
    frees, two more requests have been read and are queued on the event loop ahead of the
    collector. They join its batch rather than the next (at 64 clients in one process this
    kept batches whole: without it they were cut at about half)."""
    model = RecordingDoubler()
    device = ManualExecutor()
    loop = asyncio.get_running_loop()
    armed = [False]
    arrivals: list[Ticket[Payload]] = []

    def expected_requests() -> int:  # called by the collector as it starts each batch
        if armed[0]:
            armed[0] = False
            for row in (3, 4):
                loop.call_soon(lambda row=row: arrivals.append(batcher.enqueue([row], group="g")))
        return 0

    batcher = make_batcher(
        model, executor=device, max_batch_size=8, max_wait_ms=10,
        expected_requests=expected_requests,
    )  # fmt: skip
    first = asyncio.create_task(batcher.submit([1, 5, 6], group="g"))  # a batch of 3 rows
    await wait_until(lambda: device.pending == 1)
    waiting = asyncio.create_task(batcher.submit([2], group="g"))
    await settle_after(clock, 0.05)  # it has waited past max_wait
    armed[0] = True
    device.finish_next()
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(first, waiting, *(ticket.wait() for ticket in arrivals))
    assert model.batches == [[[1, 5, 6]], [[2], [3], [4]]]


async def test_among_due_groups_the_oldest_request_runs_first(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=30)
    blocker = asyncio.create_task(batcher.submit([0], group="x"))
    await wait_until(lambda: device.pending == 1)
    older = asyncio.create_task(batcher.submit([1], group="a"))
    await settle_after(clock, 0.01)
    newer = asyncio.create_task(batcher.submit([2], group="b"))
    await settle_after(clock, 0.1)  # both due now
    for _ in range(3):
        await wait_until(lambda: device.pending == 1)
        device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(blocker, older, newer)
    assert model.computed_rows == [0, 1, 2]


async def test_a_request_needing_longer_than_its_deadline_is_refused_at_once(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, measured=False)
    for _ in range(3):
        batcher.times.record("g", 2, 0.3)  # two rows take 300 ms
    with pytest.raises(InvalidInputError, match="send fewer instances") as refused:
        batcher.enqueue([1, 2, 3, 4], group="g", deadline_s=time.monotonic() + 0.5)
    assert refused.value.status_code == 422
    assert "about 600 ms of compute" in refused.value.message
    assert dropped(metrics, "deadline_unreachable") == 1
    assert batcher.queue_depth == 0
    async with asyncio.timeout(PROMPTLY_S):  # the same with time enough is served
        assert await batcher.submit([1, 2], group="g", deadline_s=time.monotonic() + 5) == [[2, 4]]


async def test_a_request_the_queue_cannot_serve_in_time_is_refused_429_with_the_wait(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=1, measured=False)
    for _ in range(3):
        batcher.times.record("g", 1, 0.4)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3, 4)]
    await wait_until(lambda: batcher.queue_depth == 4)
    assert 1.6 <= batcher.estimated_wait_s() <= 2.0  # four batches and what is left of one
    with pytest.raises(OverloadedError) as refused:
        batcher.enqueue([9], group="g", deadline_s=time.monotonic() + 1.0)
    assert refused.value.status_code == 429
    assert refused.value.headers["Retry-After"] == "2"
    # Before its body is parsed, the same request is refused alike; a high one is not.
    before_body = batcher.refusal_of_any("normal", time.monotonic() + 1.0)
    assert isinstance(before_body, OverloadedError)
    assert before_body.headers["Retry-After"] == "2"
    assert batcher.refusal_of_any("high", time.monotonic() + 1.0) is None
    assert batcher.refusal_of_any("normal", None) is None  # its body may set a later deadline
    # A high-priority request goes before the queued normal ones: it fits.
    high = batcher.enqueue([8], group="g", priority="high", deadline_s=time.monotonic() + 1.0)
    assert batcher.estimated_wait_s("high") <= 0.8
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, *queued, high.wait())
    assert dropped(metrics, "deadline_unreachable") == 2


async def test_rows_that_cannot_finish_even_alone_are_answered_504_and_never_computed(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=2, max_wait_ms=1)
    blocker = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    soon = asyncio.create_task(batcher.submit([1], group="g", deadline_s=time.monotonic() + 0.3))
    later = asyncio.create_task(batcher.submit([2], group="g", deadline_s=time.monotonic() + 5))
    await wait_until(lambda: batcher.queue_depth == 2)
    for rows in (1, 2):
        for _ in range(3):
            batcher.times.record("g", rows, 1.0)  # admitted when quick; now a row takes 1 s
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(DeadlineExceededError) as late:
            await soon
        assert late.value.message == (
            "the request could not be answered within 5000 ms: its rows would take about 1000 ms"
        )
        assert await later == [[4]]
        await blocker
    assert model.computed_rows == [0, 2]
    assert dropped(metrics, "deadline_unreachable") == 1


async def test_a_batch_takes_only_the_requests_it_can_finish_before_their_deadlines(
    make_batcher: BatcherFactory,
) -> None:
    """Overload: one row takes 0.2 s, two or three 0.5 s, four 1 s. Of three queued requests
    the first has 0.8 s left: the batch holds it and the next (2 rows), not the third (4 rows
    would end too late for the first), and the third runs next instead of all being late."""
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=4, max_wait_ms=1)
    blocker = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
    now_s = time.monotonic()
    tight = asyncio.create_task(batcher.submit([1], group="g", deadline_s=now_s + 0.8))
    loose = [
        asyncio.create_task(batcher.submit(rows, group="g", deadline_s=now_s + 5))
        for rows in ([2], [3, 4])
    ]
    await wait_until(lambda: batcher.queue_depth == 3)
    for rows, seconds in ((1, 0.2), (2, 0.5), (4, 1.0)):
        for _ in range(3):
            batcher.times.record("g", rows, seconds)
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        assert await tight == [[2]]
        assert [await task for task in loose] == [[[4]], [[6, 8]]]
        await blocker
    assert model.batches == [[[0]], [[1], [2]], [[3, 4]]]
    assert dropped(metrics, "deadline_unreachable") == 0


async def test_adaptive_policy_waits_for_the_requests_the_front_ends_hold(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    """Two requests are held by the front ends (bodies read, not answered): the first
    waits for the second, though the last batch had one row."""
    model = RecordingDoubler()
    held = [2]
    batcher = make_batcher(
        model, max_batch_size=4, max_wait_ms=10_000, expected_requests=lambda: held[0]
    )
    first = asyncio.create_task(batcher.submit([1], group="g"))
    await settle_after(clock, 0.1)
    assert model.batches == [], "must wait for the second request the front ends hold"
    second = asyncio.create_task(batcher.submit([2], group="g"))
    async with asyncio.timeout(PROMPTLY_S):
        assert await first == [[2]]
        assert await second == [[4]]
    assert model.batches == [[[1], [2]]]


# ----------------------------------------------------------------- tickets


async def test_a_ticket_goes_to_its_sink_once_when_its_last_chunk_is_answered(
    make_batcher: BatcherFactory,
) -> None:
    device = ManualExecutor()
    batcher = make_batcher(RecordingDoubler(), executor=device, max_batch_size=2)
    sink = RecordingSink()
    ticket = batcher.enqueue([1, 2, 3, 4, 5], group="g", sink=sink, tag=7)

    for _ in range(2):
        await wait_until(lambda: device.pending == 1)
        device.finish_next()
    await wait_until(lambda: device.pending == 1)
    await asyncio.sleep(0)  # the answered chunks have been handed out
    assert sink.deliveries == [], "two chunks of three answered"
    device.finish_next()
    await wait_until(lambda: sink.deliveries == [[ticket]])
    assert ticket.outputs() == [[2, 4], [6, 8], [10]]
    assert ticket.tag == 7
    assert ticket.traced_batches() == ()  # not traced: no batch spans to name


async def test_a_batch_hands_each_sink_its_tickets_in_one_delivery(
    make_batcher: BatcherFactory,
) -> None:
    """The bridge answers a front end once per batch: one delivery, one frame."""
    device = ManualExecutor()
    batcher = make_batcher(RecordingDoubler(), executor=device, max_batch_size=4)
    blocker = asyncio.create_task(batcher.submit([0, 0, 0, 0], group="x"))
    await wait_until(lambda: device.pending == 1)
    one, two = RecordingSink(), RecordingSink()
    tickets = [
        batcher.enqueue([row], group="g", sink=sink, source=sink)
        for row, sink in zip((1, 2, 3, 4), (one, two, one, one), strict=True)
    ]
    await device.finish_until(lambda: len(one.deliveries) == 1 and len(two.deliveries) == 1)
    assert one.deliveries == [[tickets[0], tickets[2], tickets[3]]]
    assert two.deliveries == [[tickets[1]]]
    assert [ticket.outputs() for ticket in tickets] == [[[2]], [[4]], [[6]], [[8]]]
    assert await blocker == [[0, 0, 0, 0]]


async def test_a_cancelled_ticket_finishes_and_its_queued_chunks_are_dropped(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, metrics=metrics, executor=device, max_batch_size=2, request_timeout_ms=LONG_WAIT_MS
    )
    sink = RecordingSink()
    ticket = batcher.enqueue([1, 2, 3, 4, 5, 6], group="g", sink=sink)
    await wait_until(lambda: device.pending == 1)  # the first chunk runs

    ticket.cancel()
    assert batcher.queue_depth == 0
    assert dropped(metrics, "cancelled") == 2
    assert sink.deliveries == [[ticket]]  # every chunk answered: cancelled
    with pytest.raises(asyncio.CancelledError):
        ticket.outputs()
    device.finish_next()  # the device takes the handed chunk: all its requests answered
    follow = asyncio.create_task(batcher.submit([7], group="g"))
    await device.finish_until(follow.done)
    assert await follow == [[14]]
    assert model.computed_rows == [7]  # the cancelled chunk was never computed


async def test_once_a_chunk_fails_the_requests_queued_chunks_are_dropped(
    make_batcher: BatcherFactory,
) -> None:
    """The bridge waits on the ticket, not on each chunk: a failed chunk fails the request,
    and what is still queued of it is never computed (withdrawn as the failed batch is
    answered, before the collector takes the next)."""
    metrics = EngineMetrics()
    model = PoisonModel(poison=-1)
    device = ManualExecutor()
    batcher = make_batcher(model, metrics=metrics, executor=device, max_batch_size=2)
    sink = RecordingSink()
    ticket = batcher.enqueue([-1, 2, 3, 4, 5, 6], group="g", sink=sink)

    await wait_until(lambda: device.pending == 1)
    device.finish_next()  # [-1, 2] fails
    await wait_until(lambda: sink.tickets == [ticket])
    with pytest.raises(InferenceError):
        ticket.outputs()
    assert batcher.queue_depth == 0
    assert dropped(metrics, "cancelled") == 2  # [3, 4] and [5, 6]
    assert device.pending == 0
    assert model.computed_rows == [-1, 2]


# ----------------------------------------------------------------- memory


def outcome_of(ticket: Ticket[Payload]) -> object:
    """The ticket's outputs, or the type of its error (not the error, whose traceback would
    hold the ticket's frames)."""
    try:
        return ticket.outputs()
    except BaseException as error:
        return type(error)


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [("answered", [[2]]), ("failed", InferenceError), ("cancelled", asyncio.CancelledError)],
)
async def test_a_finished_request_is_let_go_before_its_deadline(
    make_batcher: BatcherFactory, outcome: str, expected: object
) -> None:
    """Its deadline timer is cancelled with it: a timer left to run would hold the request
    and its payload in memory for the whole ``request_timeout_ms``."""
    device = ManualExecutor()
    batcher = make_batcher(
        PoisonAnsweringModel(poison=-1),
        executor=device,
        max_batch_size=1,
        request_timeout_ms=LONG_WAIT_MS,
    )
    first = asyncio.create_task(batcher.submit([0], group="g"))
    await wait_until(lambda: device.pending == 1)
    payload = np.array([-1 if outcome == "failed" else 1])  # chunks are views: they hold it
    payload_alive = weakref.ref(payload)
    finished = RecordingSink()
    ticket = batcher.enqueue(payload, group="g", sink=finished)  # type: ignore[arg-type]
    del payload
    if outcome == "cancelled":
        ticket.cancel()
    # A last request, so that the collector lets go of the batch before it.
    last = asyncio.create_task(batcher.submit([2], group="g"))
    await device.finish_until(last.done)
    assert await asyncio.gather(first, last) == [[[0]], [[4]]]
    await wait_until(lambda: len(finished.tickets) == 1)

    assert outcome_of(ticket) == expected
    finished.deliveries.clear()
    del ticket
    await asyncio.sleep(0)
    gc.collect()
    assert payload_alive() is None


# ----------------------------------------------------------------- more forming


async def test_fixed_policy_runs_a_batch_once_full_by_rows_or_by_cost(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(
        model, max_batch_size=4, max_batch_cost=10, max_wait_ms=LONG_WAIT_MS, policy="fixed"
    )
    async with asyncio.timeout(PROMPTLY_S):
        assert await submit_all(batcher, [[1], [2], [3], [4]]) == [[[2]], [[4]], [[6]], [[8]]]

    half = asyncio.create_task(batcher.submit([5], group="g", cost_per_row=5))
    await settle_after(clock, 0.1)
    assert model.calls == 1, "half the budget: the batch waits for max_wait_ms"
    async with asyncio.timeout(PROMPTLY_S):  # exactly the budget: full
        assert await batcher.submit([6], group="g", cost_per_row=5) == [[12]]
        assert await half == [[10]]
    assert model.batches == [[[1], [2], [3], [4]], [[5], [6]]]


async def test_drain_runs_the_partial_batches_left_in_every_group(
    make_batcher: BatcherFactory,
) -> None:
    """Also once other groups have emptied, by their batch or by a cancel."""
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=2, max_wait_ms=LONG_WAIT_MS, policy="fixed")
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([1, 2], group="a") == [[2, 4]]
    leaving = asyncio.create_task(batcher.submit([9], group="c"))
    waiting = asyncio.create_task(batcher.submit([3], group="b"))
    await wait_until(lambda: batcher.queue_depth == 2)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving

    async with asyncio.timeout(PROMPTLY_S):
        await batcher.drain()
    assert await waiting == [[6]]
    assert model.batches == [[[1, 2]], [[3]]]


async def test_a_request_taking_a_group_past_the_adaptive_target_is_dispatched_at_once(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=8, max_wait_ms=LONG_WAIT_MS)
    await queue_behind_a_busy_device(batcher, model, [1, 2])  # the target is two rows

    first = asyncio.create_task(batcher.submit([3], group="g"))
    await settle_after(clock, 0.1)
    assert model.batch_rows == [1, 2], "one row of two: waits"
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([4, 5], group="g") == [[8, 10]]
        assert await first == [[6]]
    assert model.batch_rows == [1, 2, 3]


async def test_without_a_budget_costs_limit_nothing(make_batcher: BatcherFactory) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=LONG_WAIT_MS)
    blocker = asyncio.create_task(batcher.submit([0], group="g", cost_per_row=100))
    await model.wait_started()
    queued = [
        asyncio.create_task(batcher.submit(rows, group="g", cost_per_row=100))
        for rows in ([1, 2], [3], [4])
    ]
    await wait_until(lambda: batcher.queue_depth == 3)
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        assert await asyncio.gather(blocker, *queued) == [[[0]], [[2, 4]], [[6]], [[8]]]
    assert model.batch_rows == [1, 4]


async def test_requests_without_a_cost_are_not_held_to_the_budget(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=4, max_batch_cost=2)
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([1, 2, 3, 4], group="g") == [[2, 4, 6, 8]]
        assert await batcher.enqueue([5, 6, 7, 8], group="g").wait() == [[10, 12, 14, 16]]
    assert model.batch_rows == [4, 4]


async def test_a_queue_and_batches_of_one_serve(make_batcher: BatcherFactory) -> None:
    batcher = make_batcher(RecordingDoubler(), max_batch_size=1, max_queue_size=1)
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([1], group="g") == [[2]]


async def test_the_high_priority_streak_counts_from_the_first_batch(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=1, max_wait_ms=LONG_WAIT_MS)
    normal = batcher.submit([100], group="g")
    high = [batcher.submit([row], group="g", priority="high") for row in (1, 2, 3, 4)]
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(normal, *high)  # all queued before the first batch
    assert model.computed_rows == [1, 2, 3, 100, 4]


async def test_among_due_groups_the_oldest_high_priority_request_runs_first(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=100)
    blocker = asyncio.create_task(batcher.submit([0], group="x"))
    await wait_until(lambda: device.pending == 1)
    older = asyncio.create_task(batcher.submit([1], group="a", priority="high"))
    await wait_until(lambda: batcher.queue_depth == 1)
    clock.advance(0.05)
    newer = asyncio.create_task(batcher.submit([2], group="b", priority="high"))
    await wait_until(lambda: batcher.queue_depth == 2)
    clock.advance(0.2)  # both due
    await device.finish_until(lambda: newer.done() and older.done())
    await blocker
    assert model.computed_rows == [0, 1, 2]


# ----------------------------------------------------------------- failures, more


async def test_a_row_the_model_fails_alone_fails_only_its_request(
    make_batcher: BatcherFactory,
) -> None:
    model = PoisonAnsweringModel(poison=-1)
    batcher = make_batcher(model, max_batch_size=4)
    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [-1], [3]])
    assert results[0] == [[2]]
    assert isinstance(results[1], InferenceError)
    assert results[1].message == "row -1 gave no finite output"
    assert results[2] == [[6]]
    assert model.calls == 1  # nothing to isolate: no halving


async def test_a_service_error_the_model_raises_reaches_its_request_unchanged(
    make_batcher: BatcherFactory,
) -> None:
    model = PoisonModel(poison=-1, error=InvalidInputError)
    batcher = make_batcher(model, max_batch_size=4)
    async with asyncio.timeout(PROMPTLY_S):
        results = await submit_all(batcher, [[1], [-1, 2]])
    assert results[0] == [[2]]
    assert isinstance(results[1], InvalidInputError)
    assert results[1].message == "the model cannot handle row -1"


async def test_an_unexpected_error_running_a_batch_fails_that_batch_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not through ``make_batcher``, which fails any test that logs such an error."""
    metrics = EngineMetrics()
    batch_sources = metrics.batch_sources.labels("test")  # the series the batcher observes
    observe = batch_sources.observe
    observed: list[float] = []

    def observe_failing_once(value: float) -> None:
        observed.append(value)
        if len(observed) == 1:
            raise RuntimeError("metrics backend gone")
        observe(value)

    monkeypatch.setattr(batch_sources, "observe", observe_failing_once)
    factory = BatcherFactory()
    try:
        batcher = factory(RecordingDoubler(), metrics=metrics)
        async with asyncio.timeout(PROMPTLY_S):
            with pytest.raises(InferenceError, match="internal error while running the batch"):
                await batcher.submit([1], group="g")
            assert await batcher.submit([2], group="g") == [[4]]
    finally:
        await factory.aclose()


async def test_a_batch_back_in_time_does_not_mark_the_batcher_stalled(
    make_batcher: BatcherFactory,
    clock: SteppedClock,
) -> None:
    stalls: list[str] = []
    batcher = make_batcher(
        RecordingDoubler(), stall_timeout_s=0.1, on_stall=lambda: stalls.append("stalled")
    )
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([1], group="g") == [[2]]
    await settle_after(clock, 0.2)  # past the stall timeout of the batch that came back
    assert stalls == []
    assert batcher.accepting


async def test_batches_count_the_front_ends_they_serve(make_batcher: BatcherFactory) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=4)
    tickets = [batcher.enqueue([row], group="g", source=source) for row, source in enumerate("aab")]
    async with asyncio.timeout(PROMPTLY_S):
        assert [await ticket.wait() for ticket in tickets] == [[[0]], [[2]], [[4]]]
    assert model.calls == 1
    assert sample(metrics, "batchserve_batch_frontends_count") == 1
    assert sample(metrics, "batchserve_batch_frontends_sum") == 2


# ----------------------------------------------------------------- out of device memory


async def test_out_of_memory_caps_batches_at_half_then_the_cap_doubles_back(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    metrics = EngineMetrics()
    model = OutOfMemoryAbove(max_rows=4)
    device = ManualExecutor()
    batcher = make_batcher(model, metrics=metrics, executor=device, max_batch_size=8)

    def effective() -> float:
        return sample(metrics, "batchserve_effective_max_batch_size")

    async def run_behind_a_blocker(rows: int) -> list[int]:
        """A blocker (alone, it waits up to max_wait_ms for as many rows as the last batch
        had), then ``rows`` one-row requests queued behind it; the rows of each forward."""
        calls = model.calls
        blocker = asyncio.create_task(batcher.submit([0], group="g"))
        await wait_until(lambda: device.pending == 1)
        queued = [asyncio.create_task(batcher.submit([row], group="g")) for row in range(rows)]
        await wait_until(lambda: batcher.queue_depth == rows)
        await device.finish_until(lambda: all(task.done() for task in (blocker, *queued)))
        assert [task.result() for task in queued] == [[[2 * row]] for row in range(rows)]
        return model.batch_rows[calls:]

    assert (batcher.row_limit, effective()) == (8, 8)
    # Seven rows run out of memory: retried by halves, and batches capped at 7 // 2.
    assert await run_behind_a_blocker(7) == [1, 7, 3, 4]
    assert (batcher.row_limit, effective()) == (3, 3)
    assert sample(metrics, "batchserve_out_of_memory_total") == 1

    clock.advance(OOM_BACKOFF_S - 1)
    assert await run_behind_a_blocker(6) == [1, 3, 3]
    assert batcher.row_limit == 3

    model.max_rows = 8  # memory freed
    clock.advance(2)  # the cap doubles after the blocker's batch
    assert await run_behind_a_blocker(8) == [1, 6, 2]
    assert (batcher.row_limit, effective()) == (6, 6)

    clock.advance(OOM_BACKOFF_S - 1)
    assert await run_behind_a_blocker(8) == [1, 6, 2]
    clock.advance(2)
    assert await run_behind_a_blocker(8) == [1, 8]
    assert (batcher.row_limit, effective()) == (8, 8)
    assert sample(metrics, "batchserve_out_of_memory_total") == 1


async def test_a_row_out_of_memory_alone_is_503_and_batches_keep_one_row(
    make_batcher: BatcherFactory,
) -> None:
    model = OutOfMemoryAbove(max_rows=0)
    batcher = make_batcher(model, max_batch_size=4)
    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(InsufficientDeviceMemoryError) as refused:
            await batcher.submit([1], group="g")
    assert refused.value.status_code == 503
    assert refused.value.message == (
        "out of device memory for this request's 1 instance(s) even alone; retry later or with "
        "fewer instances"
    )
    assert batcher.row_limit == 1
    model.max_rows = 4
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([2], group="g") == [[4]]


async def test_the_cap_doubles_once_exactly_oom_backoff_has_passed(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    clock.freeze()
    model = OutOfMemoryAbove(max_rows=1)
    batcher = make_batcher(model, max_batch_size=2)
    async with asyncio.timeout(PROMPTLY_S):
        assert await submit_all(batcher, [[1], [2]]) == [[[2]], [[4]]]
    assert model.batch_rows == [2, 1, 1]
    assert batcher.row_limit == 1

    model.max_rows = 2
    clock.advance(OOM_BACKOFF_S)
    async with asyncio.timeout(PROMPTLY_S):
        assert await batcher.submit([3], group="g") == [[6]]
    await wait_until(lambda: batcher.row_limit == 2)  # after the batch that followed


# ----------------------------------------------------------------- estimates and admission


async def test_a_request_that_would_finish_exactly_at_its_deadline_is_served(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """Admitted (its own batch and the work ahead fit exactly), and run when collected."""
    clock.freeze()
    model = RecordingDoubler()
    batcher = make_batcher(model, max_batch_size=1, measured=False)
    for _ in range(3):
        batcher.times.record("g", 1, 2.0)
    ticket = batcher.enqueue([1], group="g", deadline_s=clock.monotonic() + 2.0)
    async with asyncio.timeout(PROMPTLY_S):
        assert await ticket.wait() == [[2]]
    assert model.computed_rows == [1]


async def test_the_estimated_wait_counts_the_batches_queued_ahead(
    make_batcher: BatcherFactory,
) -> None:
    device = ManualExecutor()
    batcher = make_batcher(
        RecordingDoubler(),
        executor=device,
        max_batch_size=4,
        max_batch_cost=10,
        max_wait_ms=LONG_WAIT_MS,
        measured=False,
    )
    for group, seconds in (("g", 0.1), ("c", 0.1), ("x", 0.3)):
        for _ in range(3):
            for rows, factor in ((1, 1.0), (2, 1.5), (4, 2.0)):
                batcher.times.record(group, rows, seconds * factor)
    assert batcher.estimated_wait_s() == 0.0  # nothing running, nothing queued
    blocker = asyncio.create_task(batcher.submit([0], group="unmeasured"))
    await wait_until(lambda: device.pending == 1)
    assert batcher.estimated_wait_s() == 0.0  # a running batch of unknown duration counts 0

    plain = [batcher.enqueue([row], group="g") for row in (1, 2, 3)]  # no cost
    high = batcher.enqueue([4, 4], group="g", priority="high")
    costly = [batcher.enqueue([row], group="c", cost_per_row=5) for row in (5, 6, 7)]
    alone = batcher.enqueue([8], group="x", cost_per_row=50)  # over the budget: a batch alone
    unknown = batcher.enqueue([9], group="u")
    # g: five rows, a batch of four and one of one (0.2 + 0.1); c: 15 of cost, two rows per
    # batch (0.15 + 0.1); x: one batch (0.3); u: unmeasured (0). High priority: g's two rows.
    assert batcher.estimated_wait_s() == pytest.approx(0.85)
    assert batcher.estimated_wait_s("high") == pytest.approx(0.15)

    plain[0].cancel()  # g: four rows, one batch
    assert batcher.estimated_wait_s() == pytest.approx(0.75)
    high.cancel()  # g: two rows
    assert batcher.estimated_wait_s() == pytest.approx(0.7)
    assert batcher.estimated_wait_s("high") == 0.0

    draining = asyncio.ensure_future(batcher.drain())
    await device.finish_until(draining.done)
    await blocker
    for ticket in (*plain[1:], *costly, alone, unknown):
        assert len(ticket.outputs()) == 1


async def test_the_estimated_wait_counts_what_is_left_of_the_running_batch(
    make_batcher: BatcherFactory,
) -> None:
    device = ManualExecutor()
    batcher = make_batcher(RecordingDoubler(), executor=device, measured=False)
    for _ in range(3):
        batcher.times.record("g", 1, 10.0)
    running = asyncio.create_task(batcher.submit([1], group="g", deadline_s=time.monotonic() + 60))
    await wait_until(lambda: device.pending == 1)
    assert 9.0 < batcher.estimated_wait_s() <= 10.0
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        assert await running == [[2]]
    assert batcher.estimated_wait_s() == 0.0


async def test_a_request_is_refused_when_the_work_ahead_and_its_own_end_past_its_deadline(
    make_batcher: BatcherFactory,
) -> None:
    device = ManualExecutor()
    batcher = make_batcher(RecordingDoubler(), executor=device, max_batch_size=1, measured=False)
    for _ in range(3):
        batcher.times.record("g", 1, 0.4)
    blocker = asyncio.create_task(batcher.submit([0], group="unmeasured"))
    await wait_until(lambda: device.pending == 1)
    ahead = batcher.enqueue([1], group="g")  # 0.4 s of work ahead
    with pytest.raises(OverloadedError) as refused:  # 0.4 + 0.4 > 0.6
        batcher.enqueue([2], group="g", deadline_s=time.monotonic() + 0.6)
    assert refused.value.headers["Retry-After"] == "1"
    served = batcher.enqueue([3], group="g", deadline_s=time.monotonic() + 5)
    draining = asyncio.ensure_future(batcher.drain())
    await device.finish_until(draining.done)
    await blocker
    assert ahead.outputs() == [[2]]
    assert served.outputs() == [[6]]


# ----------------------------------------------------------------- the collector's clock


async def test_a_request_is_due_once_it_has_waited_exactly_max_wait(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    clock.freeze()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, executor=device, max_batch_size=4, max_wait_ms=500, policy="fixed"
    )
    blocker = asyncio.create_task(batcher.submit([0, 0, 0, 0], group="x"))  # full: runs
    await wait_until(lambda: device.pending == 1)
    waiting = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)
    clock.advance(0.5)
    device.finish_next()
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        assert await asyncio.gather(blocker, waiting) == [[[0, 0, 0, 0]], [[2]]]


async def test_max_wait_counts_from_the_oldest_request_of_either_priority(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model,
        executor=device,
        max_batch_size=4,
        max_wait_ms=100_000,
        policy="fixed",
        request_timeout_ms=600_000,
    )
    blocker = asyncio.create_task(batcher.submit([0, 0, 0, 0], group="x"))  # full: runs
    await wait_until(lambda: device.pending == 1)
    normal = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)
    clock.advance(50)
    high = asyncio.create_task(batcher.submit([2], group="g", priority="high"))
    await wait_until(lambda: batcher.queue_depth == 2)
    clock.advance(50.5)  # the normal request has waited max_wait, the high one half of it

    device.finish_next()
    await wait_until(lambda: device.pending == 1)  # due now, not in another 50 s
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        assert await asyncio.gather(blocker, normal, high) == [[[0, 0, 0, 0]], [[2]], [[4]]]
    assert model.batches[1] == [[2], [1]]


async def test_the_collector_wakes_when_the_oldest_of_several_groups_is_due(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, executor=device, max_batch_size=4, max_wait_ms=1_000, policy="fixed"
    )
    blocker = asyncio.create_task(batcher.submit([0, 0, 0, 0], group="x"))  # full: runs
    await wait_until(lambda: device.pending == 1)
    older = asyncio.create_task(batcher.submit([1], group="a"))
    await wait_until(lambda: batcher.queue_depth == 1)
    clock.advance(0.9)
    newer = asyncio.create_task(batcher.submit([2], group="b"))
    await wait_until(lambda: batcher.queue_depth == 2)

    device.finish_next()  # the collector waits for "a": 0.1 s more, not the 1 s "b" has left
    async with asyncio.timeout(0.6):
        await wait_until(lambda: device.pending == 1)
    device.finish_next()
    assert model.computed_rows == [0, 0, 0, 0, 1]
    draining = asyncio.ensure_future(batcher.drain())
    await device.finish_until(draining.done)
    assert await asyncio.gather(blocker, older, newer) == [[[0, 0, 0, 0]], [[2]], [[4]]]


async def test_a_waiting_collector_sleeps_instead_of_polling(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    batcher = make_batcher(RecordingDoubler(), max_wait_ms=LONG_WAIT_MS, policy="fixed")
    waiting = asyncio.create_task(batcher.submit([1], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)
    reads = clock.reads
    await settle_after(clock, 0)
    assert clock.reads - reads < 10, "the collector polls the clock while it waits"
    async with asyncio.timeout(PROMPTLY_S):
        await batcher.drain()
    assert await waiting == [[2]]


# ----------------------------------------------------------------- batch fill after an answer


async def test_after_a_batch_the_adaptive_policy_waits_for_the_clients_it_answered(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """At 64 closed-loop clients in one process the requests back first had waited
    max_wait while the device ran, so the next batch was cut at once at about 40 of 64 rows
    (batches of 40 and 63, alternately). Now the collector also waits, up to max_wait from
    the answer, for the clients the last batch answered."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=100)
    first = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3, 4)]
    await wait_until(lambda: device.pending == 1)  # full: runs, and sets the target to 4
    back = [asyncio.create_task(batcher.submit([row], group="g")) for row in (5, 6)]
    await wait_until(lambda: batcher.queue_depth == 2)
    await settle_after(clock, 0.2)  # they have waited past max_wait while the device ran
    device.finish_next()
    await settle_after(clock, 0.05)
    assert device.pending == 0, "the clients just answered are not back yet: wait for them"
    rest = [asyncio.create_task(batcher.submit([row], group="g")) for row in (7, 8)]
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*first, *back, *rest)
    assert model.batch_rows == [4, 4]


async def test_the_wait_for_the_clients_answered_is_bounded_by_max_wait(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=100)
    first = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3, 4)]
    await wait_until(lambda: device.pending == 1)
    back = [asyncio.create_task(batcher.submit([row], group="g")) for row in (5, 6)]
    await wait_until(lambda: batcher.queue_depth == 2)
    await settle_after(clock, 0.2)
    device.finish_next()
    await settle_after(clock, 0.05)
    assert device.pending == 0
    await settle_after(clock, 0.06)  # max_wait since the answer: the others are not coming
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*first, *back)
    assert model.batch_rows == [4, 2]


def submitted(batcher: Batcher, rows: Sequence[int], source: str) -> list[Any]:
    """One request of one row for each of ``rows``, from front end ``source``, group "g"."""
    return [asyncio.create_task(batcher.submit([row], group="g", source=source)) for row in rows]


async def answered_with_turnaround(
    batcher: Batcher, device: ManualExecutor, clock: SteppedClock
) -> list[Any]:
    """A batch of 1-4 answered, its clients back 0.2 s later (5-8), their batch running."""
    first = submitted(batcher, (1, 2, 3, 4), "a")
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    await settle_after(clock, 0.2)  # the clients come back 0.2 s after their answer
    second = submitted(batcher, (5, 6, 7, 8), "a")
    await wait_until(lambda: device.pending == 1)
    return [*first, *second]


async def test_the_wait_for_the_clients_answered_lasts_their_turnaround_measured(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """``--workers 2`` at 64 clients: a front end in its own process took longer than
    max_wait to send its answered clients' next requests, so the wait ended with half of
    them back and batches were cut at 26-40 rows of 64. Now the wait lasts as long as the
    clients of the last batches took to be all back (here 0.2 s, max_wait 0.1 s)."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=100)
    earlier = await answered_with_turnaround(batcher, device, clock)
    others = submitted(batcher, (9, 10), "b")
    await wait_until(lambda: batcher.queue_depth == 2)
    await settle_after(clock, 0.2)  # these have waited past max_wait while the device ran
    device.finish_next()
    await settle_after(clock, 0.15)  # past max_wait since the answer, within the turnaround
    assert device.pending == 0, "the clients just answered are still coming back: wait"
    back = submitted(batcher, (11, 12), "a")
    await wait_until(lambda: device.pending == 1)
    await device.finish_until(lambda: all(task.done() for task in [*earlier, *others, *back]))
    assert model.batch_rows == [4, 4, 4]


async def test_the_wait_for_clients_answered_ends_at_their_turnaround_if_some_never_come(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=100)
    earlier = await answered_with_turnaround(batcher, device, clock)
    device.finish_next()
    await settle_after(clock, 0.05)
    back = submitted(batcher, (9, 10), "a")
    await settle_after(clock, 0.1)  # max_wait since the answer: two are still out
    assert device.pending == 0
    await settle_after(clock, 0.06)  # the turnaround (0.2 s) has passed: they are not coming
    await wait_until(lambda: device.pending == 1)
    await device.finish_until(lambda: all(task.done() for task in [*earlier, *back]))
    assert model.batch_rows == [4, 4, 2]


async def test_no_wait_for_clients_answered_when_the_quantum_would_not_let_the_batch_grow(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """The overload soak (textenc, 512 tokens, one row a batch by the quantum, front ends
    holding more than the queue): every batch waited for the refill, the device idle, though
    the queue held more rows than the next batch could take."""
    model = RecordingDoubler()

    def sixty_ms_a_row(payloads: list[Payload]) -> Sequence[Payload | Exception]:
        clock.advance(0.06 * len(payloads))  # the quantum (0.1 s) allows one row a batch
        return model(payloads)

    device = ManualExecutor()
    batcher = make_batcher(
        sixty_ms_a_row,
        executor=device,
        max_batch_size=4,
        max_wait_ms=100,
        max_batch_ms=100,
        measured=False,
        expected_requests=lambda: 8,
    )
    for rows in range(1, 5):
        for _ in range(3):
            batcher.times.record("g", rows, 0.06 * rows)
    tasks = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3)]
    await wait_until(lambda: device.pending == 1)
    await settle_after(clock, 0.2)  # the queued ones have waited past max_wait
    device.finish_next()
    await settle_after(clock, 0.01)
    assert device.pending == 1, "the next row goes at once: no wait for the client answered"
    await device.finish_until(lambda: all(task.done() for task in tasks))
    assert model.batch_rows == [1, 1, 1]


async def test_each_batch_is_counted_by_why_it_was_taken(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """``batchserve_batch_dispatches_total{reason}``: how --workers 2's early cuts were found
    (the wait for the last batch's clients over: ``refill``)."""
    metrics = EngineMetrics()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, metrics=metrics, executor=device, max_batch_size=4, max_wait_ms=100
    )
    first = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3, 4)]
    await wait_until(lambda: device.pending == 1)  # full
    back = [asyncio.create_task(batcher.submit([row], group="g")) for row in (5, 6)]
    await wait_until(lambda: batcher.queue_depth == 2)
    await settle_after(clock, 0.2)
    device.finish_next()
    await settle_after(clock, 0.11)  # the wait for the 4 clients answered is over
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    await settle_after(clock, 0.05)
    alone = asyncio.create_task(batcher.submit([7], group="g"))
    await settle_after(clock, 0.11)  # two answered, one back: max_wait from its arrival, later
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*first, *back, alone)
    assert model.batch_rows == [4, 2, 1]
    counted = {
        reason: sample_total(
            metrics.registry, "batchserve_batch_dispatches_total", {"reason": reason}
        )
        for reason in ("full", "target", "waited", "refill", "drain")
    }
    assert counted == {"full": 1, "target": 0, "waited": 1, "refill": 1, "drain": 0}


async def test_under_the_fixed_policy_batches_are_counted_full_or_waited(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    metrics = EngineMetrics()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, metrics=metrics, executor=device, max_batch_size=2, max_wait_ms=100, policy="fixed"
    )
    full = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    alone = asyncio.create_task(batcher.submit([3], group="g"))
    await wait_until(lambda: batcher.queue_depth == 1)
    await settle_after(clock, 0.11)
    await wait_until(lambda: device.pending == 1)
    device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*full, alone)
    assert model.batch_rows == [2, 1]
    counted = {
        reason: sample_total(
            metrics.registry, "batchserve_batch_dispatches_total", {"reason": reason}
        )
        for reason in ("full", "target", "waited", "refill", "drain")
    }
    assert counted == {"full": 1, "target": 0, "waited": 1, "refill": 0, "drain": 0}


async def test_with_two_instances_two_batches_run_at_once(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """Instances per device: the batcher feeds two device threads, so a second batch is
    collected while the first runs (one instance waits for the device to be free)."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, instances=2)
    tasks = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2, 3, 4, 5)]
    await wait_until(lambda: device.pending == 2)  # [1, 2] and [3, 4] running together
    assert batcher.queue_depth == 1
    await settle_after(clock, 1.0)  # [5] is due, but no instance is free
    assert device.pending == 2
    await device.finish_until(lambda: all(task.done() for task in tasks))
    assert [task.result() for task in tasks] == [[[2 * row]] for row in (1, 2, 3, 4, 5)]
    assert model.batch_rows[:2] == [2, 2]


async def test_with_two_instances_the_clients_held_are_split_into_a_batch_for_each(
    make_batcher: BatcherFactory,
) -> None:
    """Adaptive, two instances, the front ends holding 8 requests: batches of 4 (8 split
    between the instances), both running at once, not one batch of 8 with an instance idle
    while its clients turn around."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model,
        executor=device,
        max_batch_size=8,
        max_wait_ms=10_000,
        instances=2,
        expected_requests=lambda: 8,
    )
    tasks = [asyncio.create_task(batcher.submit([row], group="g")) for row in range(8)]
    await wait_until(lambda: device.pending == 2)
    assert batcher.queue_depth == 0
    await device.finish_until(lambda: all(task.done() for task in tasks))
    assert [task.result() for task in tasks] == [[[2 * row]] for row in range(8)]
    assert model.batch_rows == [4, 4]


def test_the_adaptive_target_splits_the_requests_held_between_the_instances() -> None:
    assert target_rows(64, 64, 64) == 64  # one instance: every client in one batch
    assert split_rows(64, 64, instances=1) == 0
    assert split_rows(64, 64, instances=2) == 32
    assert split_rows(5, 64, instances=2) == 3  # rounded up: none left over
    assert split_rows(64, 16, instances=2) == 16  # never over the row limit
    assert split_rows(0, 64, instances=2) == 0  # nothing said: no split, and
    assert target_rows(7, 0, 64) == 7  # the target is the last batch's rows
    held = [64]
    adaptive = AdaptivePolicy(0.005, lambda: held[0], instances=2)
    assert (adaptive.target(64).rows, adaptive.target(64).cap) == (32, 32)
    held[0] = 0
    adaptive.taken([])  # an empty batch counts as one row
    assert (adaptive.target(64).rows, adaptive.target(64).cap) == (1, 64)
    assert FixedPolicy(0.005).target(64).rows == 64  # fixed: only a full batch goes at once
    # Only the adaptive policy lets requests already received join a batch not yet full.
    assert adaptive.target(64).look_again
    assert not FixedPolicy(0.005).target(64).look_again


# ----------------------------------------------------------------- a batch's answers settled


async def test_one_batch_settles_front_ends_in_process_callers_chunks_failures_and_cancels(
    make_batcher: BatcherFactory,
) -> None:
    """A batch answered without a method chain per request (``settle_batch``) still answers
    each of its kinds of request as ``resolve`` and ``reject`` would: two front ends' requests
    (one delivery each, with exactly their tickets), an in-process caller awaiting ``wait()``
    (and a front end's request awaited in process too),
    the last chunk of a request in several, a request the model fails alone, and one
    cancelled while its batch ran (not answered again, not delivered twice)."""
    device = ManualExecutor()
    model = PoisonAnsweringModel(poison=-1)
    batcher = make_batcher(model, executor=device, max_batch_size=8)
    blocker = asyncio.create_task(batcher.submit([0] * 8, group="x"))
    await wait_until(lambda: device.pending == 1)
    one, two = RecordingSink(), RecordingSink()
    first = batcher.enqueue([1], group="g", sink=one, source=one, tag="first")
    waited = asyncio.create_task(batcher.submit([2], group="g"))
    await asyncio.sleep(0)  # its caller awaits its ticket now
    second = batcher.enqueue([3], group="g", sink=two, source=two, tag="second")
    failing = batcher.enqueue([-1], group="g", sink=one, source=one, tag="failing")
    leaving = batcher.enqueue([5], group="g", sink=two, source=two, tag="leaving")
    both = batcher.enqueue([7], group="g", sink=two, source=two, tag="both")
    awaiting_both = asyncio.create_task(both.wait())  # a sink's, awaited in process too
    chunked = batcher.enqueue(list(range(10, 20)), group="g", sink=one, source=one)
    last = batcher.enqueue([6], group="g", sink=one, source=one, tag="last")
    device.finish_next()  # the blocker
    await wait_until(lambda: device.pending == 1)  # first .. leaving and 3 rows of chunks
    leaving.cancel()  # while its batch runs
    assert two.deliveries == [[leaving]]
    await device.finish_until(lambda: len(one.tickets) == 4 and len(two.deliveries) == 2)

    assert await blocker == [[0] * 8]
    assert await waited == [[4]]
    async with asyncio.timeout(PROMPTLY_S):
        assert await awaiting_both == [[14]]
    assert [ticket.outputs() for ticket in (first, second, last)] == [[[2]], [[6]], [[12]]]
    with pytest.raises(InferenceError):
        failing.outputs()
    with pytest.raises(asyncio.CancelledError):
        leaving.outputs()
    assert flatten(chunked.outputs()) == [2 * row for row in range(10, 20)]
    assert two.deliveries == [[leaving], [second, both]]
    # The first batch's requests of front end one, in one delivery, in queue order.
    assert one.deliveries[0] == [first, failing]
    assert one.deliveries[1:] == [[chunked, last]]  # its last chunk's batch finished both
    assert 5 in model.computed_rows  # computed, but answered as cancelled: nobody asked


async def test_when_every_group_is_ready_the_oldest_runs_first_counted_full(
    make_batcher: BatcherFactory,
) -> None:
    """Every group full at once (the collector takes them without their due times): the
    oldest request's group first, each batch counted ``full``, none mixed."""
    metrics = EngineMetrics()
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, metrics=metrics, executor=device, max_batch_size=2)
    blocker = asyncio.create_task(batcher.submit([0, 0], group="x"))
    await wait_until(lambda: device.pending == 1)
    queued = [asyncio.create_task(batcher.submit([row], group="b")) for row in (1, 2)]
    await wait_until(lambda: batcher.queue_depth == 2)
    queued += [asyncio.create_task(batcher.submit([row], group="a")) for row in (3, 4)]
    await wait_until(lambda: batcher.queue_depth == 4)
    queued += [asyncio.create_task(batcher.submit([row], group="b")) for row in (5, 6)]
    await wait_until(lambda: batcher.queue_depth == 6)
    for _ in range(4):
        await wait_until(lambda: device.pending == 1)
        device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(blocker, *queued)
    assert model.batches == [[[0, 0]], [[1], [2]], [[3], [4]], [[5], [6]]]
    counted = {
        reason: sample_total(
            metrics.registry, "batchserve_batch_dispatches_total", {"reason": reason}
        )
        for reason in ("full", "target", "waited", "refill", "drain")
    }
    assert counted == {"full": 4, "target": 0, "waited": 0, "refill": 0, "drain": 0}


async def test_a_batch_waiting_for_the_device_never_runs_once_the_collector_is_cancelled() -> None:
    """The hand-off to the device thread: a batch queued behind other work there is not run
    for nobody when the collector is cancelled (as ``run_in_executor``'s future did)."""
    device = CountingThreadExecutor("fake-device")
    busy = threading.Event()
    device.submit(busy.wait, 5.0)  # another model's batch, running
    model = RecordingDoubler()
    batcher = Batcher(
        model, policy=AdaptivePolicy(0.001), executor=device,
        metrics=EngineMetrics().for_model("test", "v1"), max_batch_size=4, max_queue_size=8,
        request_timeout_ms=5_000,
    )  # fmt: skip
    batcher.start()
    request = asyncio.create_task(batcher.submit([1], group="g"))
    collector = next(t for t in asyncio.all_tasks() if t.get_name() == "batchserve-collector")
    await wait_until(lambda: device.submitted == 2)  # handed to the device, behind the busy call
    collector.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await collector
    busy.set()
    device.shutdown(wait=True)
    assert model.batches == []
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request


# ----------------------------------------------------------------- the collector's own steps


async def test_draining_with_two_instances_waits_for_both_batches_running(
    make_batcher: BatcherFactory,
) -> None:
    device = ManualExecutor()
    batcher = make_batcher(RecordingDoubler(), executor=device, max_batch_size=1, instances=2)
    tickets = [batcher.enqueue([row], group="g") for row in (1, 2)]
    await wait_until(lambda: device.pending == 2)
    draining = asyncio.create_task(batcher.drain())
    device.finish_next()
    await wait_until(lambda: tickets[0].done)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not draining.done()  # the other batch still runs
    await device.finish_until(draining.done)
    assert [ticket.outputs() for ticket in tickets] == [[[2]], [[4]]]


async def test_a_drained_batcher_leaves_no_timer_armed(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """Its deadlines' timer, the stall watch's and the one it slept on are cancelled."""
    batcher = make_batcher(
        RecordingDoubler(),
        max_wait_ms=LONG_WAIT_MS,
        stall_timeout_s=60.0,
        expected_requests=lambda: 2,
    )
    max_wait_ends_s = clock.now() + LONG_WAIT_MS / 1000

    def max_wait_armed() -> bool:
        return any(abs(when_s - max_wait_ends_s) < 1.0 for when_s in clock.armed)

    first = batcher.enqueue([1], group="g")  # the batch should have two rows: it waits
    await settle_after(clock, 0.0)
    assert max_wait_armed()
    second = batcher.enqueue([2], group="g")  # now it has: it goes, and stops waiting
    async with asyncio.timeout(PROMPTLY_S):
        assert [await first.wait(), await second.wait()] == [[[2]], [[4]]]
    assert not max_wait_armed()
    await batcher.drain()
    await settle_after(clock, QUEUE_DEPTH_REFRESH_S)  # the depth gauge's last refresh
    assert clock.armed == []


async def test_a_frame_wakes_an_idle_collector(make_batcher: BatcherFactory) -> None:
    sink = RecordingSink()
    batcher = make_batcher(RecordingDoubler())
    await asyncio.sleep(0)  # the collector sleeps on an empty queue, with no timer
    [ticket] = batcher.enqueue_frame([Submission([1], "g")], source=sink, sink=sink)
    await wait_until(lambda: sink.tickets == [ticket])
    assert ticket.outputs() == [[2]]


async def test_the_adaptive_policy_hears_of_every_request_from_its_front_end(
    make_batcher: BatcherFactory,
) -> None:
    policy = AdaptivePolicy(0.05)
    batcher = make_batcher(RecordingDoubler(), policy=policy)
    async with asyncio.timeout(PROMPTLY_S):
        await batcher.enqueue([1], group="g", source="fe").wait()
        await batcher.enqueue([2], group="g", source="fe").wait()
    await wait_until(lambda: policy.returns.outstanding == 1)  # the second's client
    batcher.enqueue([3], group="g", source="fe")
    assert policy.returns.outstanding == 0
    policy.answered([*(entry_of("fe") for _ in range(3))], now_s=0.0)
    batcher.enqueue_frame([Submission([4], "g"), Submission([5], "g")], source="fe")
    assert policy.returns.outstanding == 1


def entry_of(source: str) -> Any:
    """An answered request of ``source``, as the policy counts it."""
    from service.engine.batcher.queue import Entry

    return Entry(
        None, 0, None, rows=1, cost=0, group="g", priority="normal", arrival_s=0.0,
        deadline_s=1.0, source=source,
    )  # fmt: skip


async def test_requests_read_as_the_collector_first_looks_join_a_batch_already_due(
    make_batcher: BatcherFactory, clock: SteppedClock
) -> None:
    """The collector looks once more, after the requests already received are queued, before
    a batch that is not ready goes: here its oldest request is past its max_wait (it waited
    while nothing woke the collector)."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model, executor=device, max_batch_size=8, max_wait_ms=10, expected_requests=lambda: 2
    )
    await asyncio.sleep(0)  # the collector sleeps on an empty queue
    first = batcher.enqueue([1], group="g")  # wakes it
    clock.advance(0.05)  # past max_wait before it looks
    later: list[Ticket[Payload]] = []
    asyncio.get_running_loop().call_soon(lambda: later.append(batcher.enqueue([2], group="g")))
    await wait_until(lambda: device.pending == 1)
    await device.finish_until(lambda: first.done and bool(later) and later[0].done)
    assert model.batches == [[[1], [2]]]


async def test_quantum_chunks_are_bounded_by_a_quarter_of_the_queue(
    make_batcher: BatcherFactory,
) -> None:
    model = GatedModel()
    batcher = make_batcher(
        model, max_batch_size=8, max_queue_size=8, max_batch_ms=100, measured=False
    )
    for rows in range(1, 9):
        batcher.times.record("g", rows, 0.2)  # any batch of "g" is over the quantum
    blocker = asyncio.create_task(batcher.submit([0], group="other"))
    await model.wait_started()
    ticket = batcher.enqueue(list(range(1, 9)), group="g")
    assert batcher.queue_depth == 2  # chunks of 4: at most 8 // 4 of them
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await blocker
        assert flatten(await ticket.wait()) == doubled(list(range(1, 9)))


async def test_a_model_whose_queue_emptied_while_it_waited_for_the_device_hands_it_on(
    make_batcher: BatcherFactory,
) -> None:
    turns = DeviceTurns()
    other = GatedModel()
    waiting = make_batcher(RecordingDoubler(), turns=turns.for_model("a"))
    holding = make_batcher(other, turns=turns.for_model("b"))
    running = asyncio.create_task(holding.submit([1], group="g"))
    await other.wait_started()
    leaving = asyncio.create_task(waiting.submit([2], group="g"))
    for _ in range(20):  # its collector asks for the device, which "b" holds
        await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    other.release()
    async with asyncio.timeout(PROMPTLY_S):
        await running
        assert await holding.submit([3], group="g") == [[6]]


async def test_a_model_with_nothing_due_once_it_has_the_device_hands_it_on(
    make_batcher: BatcherFactory,
) -> None:
    turns = DeviceTurns()
    other = GatedModel()
    waiting = make_batcher(
        RecordingDoubler(), turns=turns.for_model("a"), policy="fixed", max_batch_size=2,
        max_wait_ms=LONG_WAIT_MS,
    )  # fmt: skip
    holding = make_batcher(other, turns=turns.for_model("b"))
    running = asyncio.create_task(holding.submit([1], group="g"))
    await other.wait_started()
    full = asyncio.create_task(waiting.submit([2, 3], group="g"))  # due: full
    not_due = asyncio.create_task(waiting.submit([4], group="h"))  # due after LONG_WAIT_MS
    for _ in range(20):
        await asyncio.sleep(0)
    full.cancel()
    with pytest.raises(asyncio.CancelledError):
        await full
    other.release()
    async with asyncio.timeout(PROMPTLY_S):
        await running
        assert await holding.submit([5], group="g") == [[10]]
    not_due.cancel()


async def test_each_batch_that_runs_is_measured(make_batcher: BatcherFactory) -> None:
    batcher = make_batcher(RecordingDoubler(), measured=False)
    assert batcher.times.estimate("g", 1) is None
    async with asyncio.timeout(PROMPTLY_S):
        await batcher.submit([1], group="g")
    assert batcher.times.estimate("g", 1) is not None
