"""Frame admission (``DynamicBatcher.enqueue_frame``): a frame gets what one-by-one submission gets.

Two identical batchers, their device held by a request of another group: one is given the
requests as one frame (``enqueue_frame``), the other one at a time (``enqueue``); the refusals
(which, in which order, with which message) and the answers must be the same.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from service.engine.batcher import Submission
from service.engine.batcher.estimates import size_class
from service.errors import ServiceError
from tests.fixtures import (
    Batcher,
    BatcherFactory,
    ManualExecutor,
    RecordingDoubler,
    SteppedClock,
    wait_until,
)

NOW_S = 1000.0


@pytest.fixture
async def make_batcher() -> AsyncIterator[BatcherFactory]:
    clock = SteppedClock()
    clock.freeze(NOW_S)
    factory = BatcherFactory(clock)
    yield factory
    await factory.aclose()


async def busy_twin(
    make_batcher: BatcherFactory, max_queue_size: int = 64, **options: Any
) -> tuple[Batcher, RecordingDoubler, ManualExecutor]:
    """A batcher whose device runs a request of an unmeasured group; ``g`` is measured at
    0.4 s a batch, ``h`` at 0.1 s."""
    model = RecordingDoubler()
    device = ManualExecutor()
    batcher = make_batcher(
        model,
        executor=device,
        max_batch_size=2,
        max_queue_size=max_queue_size,
        measured=False,
        **options,
    )
    for rows in (1, 2):
        for _ in range(3):
            batcher.times.record("g", rows, 0.4)
            batcher.times.record("h", rows, 0.1)
    batcher.enqueue([0], group="unmeasured")
    await wait_until(lambda: device.pending == 1)
    return batcher, model, device


def one_by_one(batcher: Batcher, submissions: list[Submission]) -> list[Any]:
    outcomes: list[Any] = []
    for submission in submissions:
        try:
            outcomes.append(
                batcher.enqueue(
                    submission.payload,
                    group=submission.group,
                    priority=submission.priority,
                    deadline_s=submission.deadline_s,
                    tag=submission.tag,
                )
            )
        except ServiceError as error:
            outcomes.append(error)
    return outcomes


def described(outcome: Any) -> object:
    """A refusal as its type, status and message; an admitted request as its answer."""
    if isinstance(outcome, ServiceError):
        return (type(outcome).__name__, outcome.status_code, outcome.message, outcome.headers)
    try:
        return ("answered", outcome.outputs())
    except BaseException as error:
        return ("failed", type(error).__name__)


async def answered(batcher: Batcher, device: ManualExecutor) -> None:
    draining = asyncio.ensure_future(batcher.drain())
    await device.finish_until(draining.done)


MIXED = [
    Submission([1], "g", deadline_s=NOW_S + 5),
    Submission([2], "g", deadline_s=NOW_S + 0.6),  # 0.4 s ahead + 0.4 s own: 429
    Submission([3], "h", priority="high", deadline_s=NOW_S + 0.3),
    Submission([4, 5, 6], "g", deadline_s=NOW_S + 0.5),  # two chunks, 0.8 s alone: 422
    Submission([], "g"),  # no rows: 422
    Submission([7], "h"),  # the default deadline
    Submission([8], "g", priority="high", deadline_s=NOW_S + 0.5),  # only high work ahead
    Submission([9, 10, 11], "h", deadline_s=NOW_S + 5),  # two chunks, admitted
]


@pytest.mark.parametrize("max_queue_size", [64, 5])
async def test_a_mixed_frame_gets_the_refusals_and_answers_of_one_by_one_submission(
    make_batcher: BatcherFactory, max_queue_size: int
) -> None:
    framed, framed_model, framed_device = await busy_twin(make_batcher, max_queue_size)
    single, single_model, single_device = await busy_twin(make_batcher, max_queue_size)
    by_frame = framed.enqueue_frame(MIXED, source="fe", sink=None)
    one_at_a_time = one_by_one(single, MIXED)
    refusals = [described(outcome) for outcome in one_at_a_time if isinstance(outcome, Exception)]
    assert {refusal[1] for refusal in refusals} >= {422, 429}  # type: ignore[index]
    if max_queue_size == 5:
        assert "QueueFullError" in {refusal[0] for refusal in refusals}  # type: ignore[index]
    await answered(framed, framed_device)
    await answered(single, single_device)
    assert [described(outcome) for outcome in by_frame] == [
        described(outcome) for outcome in one_at_a_time
    ]
    assert framed_model.batches == single_model.batches


async def test_a_frame_admitted_whole_is_queued_and_answered_as_one_by_one(
    make_batcher: BatcherFactory,
) -> None:
    frame = [
        Submission([row], "gh"[row % 2], priority=("normal", "high")[row % 3 == 0], tag=row)
        for row in range(1, 12)
    ] + [Submission([20, 21, 22], "g", deadline_s=NOW_S + 30)]
    framed, framed_model, framed_device = await busy_twin(make_batcher)
    single, single_model, single_device = await busy_twin(make_batcher)
    by_frame = framed.enqueue_frame(frame, source="fe", sink=None)
    one_at_a_time = one_by_one(single, frame)
    assert framed.queue_depth == single.queue_depth == 13  # the last one in two chunks
    assert framed.estimated_wait_s() == single.estimated_wait_s()
    await answered(framed, framed_device)
    await answered(single, single_device)
    assert [described(outcome) for outcome in by_frame] == [
        described(outcome) for outcome in one_at_a_time
    ]
    assert [outcome.tag for outcome in by_frame] == [submission.tag for submission in frame]
    assert framed_model.batches == single_model.batches


async def test_under_a_time_quantum_a_frame_is_chunked_as_one_by_one(
    make_batcher: BatcherFactory,
) -> None:
    """With ``max_batch_ms`` below a ``g`` batch's 0.4 s, a request of several ``g`` rows runs
    a row a chunk, in a frame as one by one; ``h`` (0.1 s) keeps two rows a chunk."""
    frame = [
        Submission([20, 21, 22], "g", deadline_s=NOW_S + 30, tag="g3"),
        Submission([30, 31, 32], "h", deadline_s=NOW_S + 30, tag="h3"),
        Submission([40], "g", deadline_s=NOW_S + 30, tag="g1"),
        Submission([50, 51], "g", deadline_s=NOW_S + 30, tag="g2"),
    ]
    framed, framed_model, framed_device = await busy_twin(make_batcher, max_batch_ms=300)
    single, single_model, single_device = await busy_twin(make_batcher, max_batch_ms=300)
    by_frame = framed.enqueue_frame(frame, source="fe", sink=None)
    one_at_a_time = one_by_one(single, frame)
    assert framed.queue_depth == single.queue_depth == 3 + 2 + 1 + 2
    await answered(framed, framed_device)
    await answered(single, single_device)
    assert [described(outcome) for outcome in by_frame] == [
        described(outcome) for outcome in one_at_a_time
    ]
    assert framed_model.batches == single_model.batches


async def test_a_frame_to_a_batcher_not_accepting_is_refused_whole(
    make_batcher: BatcherFactory,
) -> None:
    batcher, _, device = await busy_twin(make_batcher)
    draining = asyncio.ensure_future(batcher.drain())
    await asyncio.sleep(0)
    outcomes = batcher.enqueue_frame(MIXED[:3], source="fe", sink=None)
    assert [described(outcome)[1] for outcome in outcomes] == [503, 503, 503]
    await device.finish_until(draining.done)


async def test_a_cancelled_request_of_a_frame_is_never_computed(
    make_batcher: BatcherFactory,
) -> None:
    batcher, model, device = await busy_twin(make_batcher)
    kept, cancelled = batcher.enqueue_frame(
        [Submission([1], "h"), Submission([2], "h")], source="fe", sink=None
    )
    assert not isinstance(cancelled, ServiceError)
    assert not isinstance(kept, ServiceError)
    cancelled.cancel()
    assert batcher.queue_depth == 1
    await answered(batcher, device)
    assert kept.outputs() == [[2]]
    with pytest.raises(asyncio.CancelledError):
        cancelled.outputs()
    assert [2] not in [payload for batch in model.batches for payload in batch]


async def test_cancelling_a_chunked_request_of_a_frame_leaves_its_frame_mates_queued(
    make_batcher: BatcherFactory,
) -> None:
    batcher, model, device = await busy_twin(make_batcher)
    chunked, after, other = batcher.enqueue_frame(
        [Submission([1, 2, 3], "h"), Submission([4], "h"), Submission([5], "h")],
        source="fe",
        sink=None,
    )
    assert not isinstance(chunked, ServiceError)
    chunked.cancel()
    assert batcher.queue_depth == 2
    await answered(batcher, device)
    assert described(after) == ("answered", [[8]])
    assert described(other) == ("answered", [[10]])
    assert [1, 2] not in [payload for batch in model.batches for payload in batch]


async def test_the_requests_of_a_frame_expire_each_at_its_own_deadline(
    make_batcher: BatcherFactory,
) -> None:
    batcher, model, device = await busy_twin(make_batcher)
    clock = make_batcher.clock
    assert clock is not None
    soon, later, default = batcher.enqueue_frame(
        [
            Submission([1], "unmeasured", deadline_s=NOW_S + 1),
            Submission([2], "unmeasured", deadline_s=NOW_S + 3),
            Submission([3], "unmeasured"),  # request_timeout_ms: 5 s
        ],
        source="fe",
        sink=None,
    )
    clock.advance(1.5)
    await wait_until(lambda: batcher.queue_depth == 2)
    assert described(soon) == ("failed", "DeadlineExceededError")
    clock.advance(2)
    await wait_until(lambda: batcher.queue_depth == 1)
    assert described(later) == ("failed", "DeadlineExceededError")
    await answered(batcher, device)
    assert described(default) == ("answered", [[6]])
    assert [1] not in [payload for batch in model.batches for payload in batch]


async def test_a_frames_refusals_leave_no_garbage_for_the_collector(
    make_batcher: BatcherFactory,
) -> None:
    """A refusal kept with its traceback holds the frames it passed through, one of which
    holds the list it is kept in: a reference cycle per refused request, which in a storm of
    refusals makes the garbage collector pause the engine's event loop."""
    batcher, _, device = await busy_twin(make_batcher, max_queue_size=2)
    full = [Submission([row], "h") for row in range(8)]  # two queued, six refused
    batcher.enqueue_frame(full, source="fe", sink=None)  # caches and lazily built parts
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        outcomes = batcher.enqueue_frame(full, source="fe", sink=None)
        assert [type(outcome).__name__ for outcome in outcomes] == ["QueueFullError"] * 8
        del outcomes
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()
    await answered(batcher, device)


async def test_a_request_without_a_cost_is_one_chunk_under_a_token_budget(
    make_batcher: BatcherFactory,
) -> None:
    batcher, _, device = await busy_twin(make_batcher, max_batch_cost=1)
    [ticket] = batcher.enqueue_frame([Submission([1, 2], "h")], source="fe", sink=None)
    assert batcher.queue_depth == 1
    await answered(batcher, device)
    assert described(ticket) == ("answered", [[2, 4]])


async def test_a_frame_asks_each_batch_duration_once_per_group_and_size_class(
    make_batcher: BatcherFactory,
) -> None:
    """The durations do not change while a frame is admitted: its alike requests ask them
    once, not once a request (each request's own and the work queued ahead of it)."""
    batcher, _, device = await busy_twin(make_batcher)
    asked: list[tuple[object, int]] = []
    estimate = batcher.times.estimate

    def counted(group: object, rows: int) -> float | None:
        asked.append((group, rows))
        return estimate(group, rows)

    batcher.times.estimate = counted  # type: ignore[method-assign]
    frame = [Submission([row], "g", deadline_s=NOW_S + 30) for row in range(16)]
    outcomes = batcher.enqueue_frame(frame, source="fe", sink=None)
    batcher.times.estimate = estimate  # type: ignore[method-assign]
    assert not any(isinstance(outcome, ServiceError) for outcome in outcomes)
    assert asked
    assert len(asked) == len({(group, size_class(rows)) for group, rows in asked})
    await answered(batcher, device)


def queued_work(batcher: Batcher) -> list[object]:
    """Every queued entry, by group and lane in queue order, as what selection reads of it."""
    return [
        (
            group.key,
            priority,
            [
                (entry.payload, entry.rows, entry.cost, entry.arrival_s, entry.deadline_s)
                for entry in lane
            ],
        )
        for group in batcher._queue
        for priority, lane in group.lanes.items()
    ]


@pytest.mark.parametrize("max_queue_size", [64, 5])
async def test_a_frame_leaves_the_queue_as_one_by_one_submission_does(
    make_batcher: BatcherFactory, max_queue_size: int
) -> None:
    """The differential check of a frame admitted at once: refused and admitted requests,
    priorities, deadlines and chunked requests leave the same entries in the same lanes, in
    the same order, with the same totals and estimated wait."""
    framed, _, framed_device = await busy_twin(make_batcher, max_queue_size)
    single, _, single_device = await busy_twin(make_batcher, max_queue_size)
    frame = [*MIXED, *(Submission([row], "gh"[row % 2], tag=row) for row in range(12, 20))]
    by_frame = framed.enqueue_frame(frame, source="fe", sink=None)
    one_at_a_time = one_by_one(single, frame)
    assert [type(outcome) for outcome in by_frame] == [type(outcome) for outcome in one_at_a_time]
    assert queued_work(framed) == queued_work(single)
    assert [(group.rows, group.cost, group.high_rows) for group in framed._queue] == [
        (group.rows, group.cost, group.high_rows) for group in single._queue
    ]
    assert framed.queue_depth == single.queue_depth
    for priority in ("normal", "high"):
        assert framed.estimated_wait_s(priority) == single.estimated_wait_s(priority)
    await answered(framed, framed_device)
    await answered(single, single_device)


async def test_the_requests_of_a_frame_arrive_at_one_instant() -> None:
    """They arrived together: one arrival for them all (what their queue waits and their
    default deadlines count from), read once, not one clock read each on a clock that runs."""
    factory = BatcherFactory(SteppedClock())  # not frozen: each read is later
    try:
        batcher, _, device = await busy_twin(factory)
        frame = [Submission([row], "gh"[row % 2]) for row in range(16)]  # the default deadline
        frame.append(Submission([16, 17, 18], "g"))  # chunked
        outcomes = batcher.enqueue_frame(frame, source="fe", sink=None)
        assert not any(isinstance(outcome, ServiceError) for outcome in outcomes)
        entries = [entry for _, _, lane in queued_work(batcher) for entry in lane]  # type: ignore[misc]
        assert len(entries) == 18
        assert len({arrival_s for _, _, _, arrival_s, _ in entries}) == 1
        await answered(batcher, device)
    finally:
        await factory.aclose()
