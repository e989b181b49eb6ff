"""DynamicBatcher: batch forming, isolation of failures, cancellation, deadlines, draining.

Timing: every wait a test relies on is at least 50 ms, and anything that must *not* wait for
a long ``max_wait_ms`` runs under an ``asyncio.timeout`` far shorter than that wait.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from service.engine.batching import DynamicBatcher
from service.errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    NotReadyError,
    OverloadedError,
    QueueFullError,
)
from service.metrics import EngineMetrics
from tests.fixtures import (
    Batcher,
    BatcherFactory,
    GatedModel,
    ManualExecutor,
    MiscountingModel,
    Payload,
    PoisonModel,
    RecordingDoubler,
    doubled,
    dropped,
    flatten,
    sample,
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
async def make_batcher() -> AsyncIterator[BatcherFactory]:
    """Builds started batchers; afterwards drains them, and fails the test if the event loop
    reported an error (e.g. a future's exception never retrieved) or the collector caught an
    unexpected one (e.g. a future set twice)."""
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    batching_log = logging.getLogger("service.batching")
    records = _Records()
    batching_log.addHandler(records)
    factory = BatcherFactory()
    try:
        yield factory
        await factory.aclose()
        gc.collect()  # "exception was never retrieved" is reported when the future is freed
    finally:
        loop.set_exception_handler(previous_handler)
        batching_log.removeHandler(records)
    assert loop_errors == []
    assert "batch_failed_unexpectedly" not in records.messages


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
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=8, max_wait_ms=50)
    first = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()

    early = [asyncio.create_task(batcher.submit([row], group="g")) for row in (1, 2)]
    # Past max_wait: a batcher that closed its next batch before the device was free would
    # have closed it on [1, 2] by now, and run [3, 4, 5] as a third batch.
    await asyncio.sleep(0.12)
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
        batcher = DynamicBatcher[Payload, Payload](
            model,
            executor=executor,
            metrics=metrics,
            max_batch_size=4,
            max_wait_ms=50,
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
        DynamicBatcher[Payload, Payload](
            RecordingDoubler(),
            executor=executor,
            metrics=EngineMetrics(),
            max_batch_size=max_batch_size,
            max_wait_ms=50,
            max_queue_size=max_queue_size,
            request_timeout_ms=1_000,
        )


# --------------------------------------------------------------------------- metrics


async def test_queue_depth_returns_to_zero_and_batch_size_histogram_counts_forwards(
    make_batcher: BatcherFactory,
) -> None:
    metrics = EngineMetrics()
    model = GatedModel()
    batcher = make_batcher(model, metrics=metrics, max_batch_size=4, max_wait_ms=50)
    running = asyncio.create_task(batcher.submit([0], group="g"))
    await model.wait_started()
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
    assert (
        metrics.registry.get_sample_value("batchserve_batch_size_rows_bucket", {"le": "1.0"}) == 1
    )
    assert sample(metrics, "batchserve_queue_wait_seconds_count") == 3
    assert sample(metrics, "batchserve_inference_duration_seconds_count") == 2


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
) -> None:
    model = GatedModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=10_000)
    await queue_behind_a_busy_device(batcher, model, [1, 2])
    assert model.batch_rows == [1, 2]

    # Two clients came back last time: a lone request waits for the second one.
    first = asyncio.create_task(batcher.submit([3], group="g"))
    await asyncio.sleep(0.1)
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


async def test_batches_known_to_be_quick_run_on_the_loops_thread(
    make_batcher: BatcherFactory,
) -> None:
    model = ThreadNoting()
    batcher = make_batcher(
        model, max_batch_size=4, max_wait_ms=1, inline_below_s=1.0, measured=False
    )
    for rows in ([1], [2], [3, 4]):
        async with asyncio.timeout(PROMPTLY_S):
            assert await batcher.submit(rows, group="g") == [doubled(rows)]
    loop_thread = threading.current_thread().name
    # The group runs in the executor until a duration of it is known, then on the loop's.
    assert model.threads == ["fake-device_0", loop_thread, loop_thread]

    for _ in range(3):
        batcher.times.record("g", 4, 2.0)  # four rows are known to be slow
    async with asyncio.timeout(PROMPTLY_S):
        await batcher.submit([5, 6, 7, 8], group="g")
        await batcher.submit([9], group="g")
    assert model.threads[3:] == ["fake-device_0", loop_thread]


async def test_without_inline_below_every_batch_runs_in_the_executor(
    make_batcher: BatcherFactory,
) -> None:
    model = ThreadNoting()
    batcher = make_batcher(model, max_batch_size=4, max_wait_ms=1)
    for rows in ([1], [2], [3]):
        async with asyncio.timeout(PROMPTLY_S):
            await batcher.submit(rows, group="g")
    assert model.threads == ["fake-device_0"] * 3


# ----------------------------------------------------------------- fairness and deadlines


async def test_a_full_group_does_not_starve_a_request_that_has_waited_max_wait(
    make_batcher: BatcherFactory,
) -> None:
    """The collector took a full group whenever there was one: kept full by new arrivals,
    a long bucket held a short request back until its deadline."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=2, max_wait_ms=50)
    first = [asyncio.create_task(batcher.submit([row], group="long")) for row in (1, 2)]
    await wait_until(lambda: device.pending == 1)  # [1, 2] runs
    short = asyncio.create_task(batcher.submit([100], group="short"))
    await asyncio.sleep(0.01)
    refills = [asyncio.create_task(batcher.submit([row], group="long")) for row in (3, 4, 5, 6)]
    await asyncio.sleep(0.1)  # the short request has waited max_wait_ms: it is due
    for _ in range(4):
        await wait_until(lambda: device.pending == 1)
        device.finish_next()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(*first, short, *refills)
    # After the running batch, the short request (older than the refills) runs next.
    assert model.batches == [[[1], [2]], [[100]], [[3], [4]], [[5], [6]]]


async def test_among_due_groups_the_oldest_request_runs_first(
    make_batcher: BatcherFactory,
) -> None:
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(model, executor=device, max_batch_size=4, max_wait_ms=30)
    blocker = asyncio.create_task(batcher.submit([0], group="x"))
    await wait_until(lambda: device.pending == 1)
    older = asyncio.create_task(batcher.submit([1], group="a"))
    await asyncio.sleep(0.01)
    newer = asyncio.create_task(batcher.submit([2], group="b"))
    await asyncio.sleep(0.1)  # both due now
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
    # A high-priority request goes before the queued normal ones: it fits.
    high = batcher.enqueue([8], group="g", priority="high", deadline_s=time.monotonic() + 1.0)
    assert batcher.estimated_wait_s("high") <= 0.8
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        await asyncio.gather(running, *queued, high.wait())
    assert dropped(metrics, "deadline_unreachable") == 1


async def test_rows_a_batch_would_finish_late_are_answered_504_and_never_computed(
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
    for _ in range(3):
        batcher.times.record("g", 2, 1.0)  # admitted when quick; now a batch takes a second
    model.release()
    async with asyncio.timeout(PROMPTLY_S):
        with pytest.raises(DeadlineExceededError, match="would take about 1000 ms"):
            await soon
        assert await later == [[4]]
        await blocker
    assert model.computed_rows == [0, 2]
    assert dropped(metrics, "deadline_unreachable") == 1
