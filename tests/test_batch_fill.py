"""BatchFiller's refill clock: since when the adaptive policy waits for the clients the last
batch answered (pure state, no event loop)."""

from __future__ import annotations

from service.engine.batch_fill import BatchFiller


def test_the_refill_wait_counts_from_the_callers_turn_not_from_the_device() -> None:
    filler = BatchFiller()
    filler.answered(10.0)
    assert filler.refill_from_s == 10.0
    filler.handed_back(10.03)  # the loop wrote the answers for 30 ms
    assert filler.refill_from_s == 10.03


def test_a_later_turn_without_an_answer_does_not_move_the_refill_wait() -> None:
    filler = BatchFiller()
    filler.handed_back(5.0)  # nothing answered yet: the wait for batch-mates is the oldest's
    assert filler.refill_from_s == -float("inf")
    filler.answered(10.0)
    filler.handed_back(10.01)
    filler.handed_back(12.0)  # the queue emptied and refilled: no answer since
    assert filler.refill_from_s == 10.01
