"""A serving process's garbage collector settings, and errors that leave no garbage behind."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from service.errors import QueueFullError, ServiceError, forget_traceback
from service.garbage import YOUNG_COLLECTION_OBJECTS, collect_young_garbage_rarely


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_only_the_young_generations_threshold_is_raised(thresholds: tuple[int, int, int]) -> None:
    collect_young_garbage_rarely()
    assert gc.get_threshold() == (YOUNG_COLLECTION_OBJECTS, *thresholds[1:])


def test_an_answered_error_and_the_errors_it_was_raised_during_let_go_of_their_frames() -> None:
    def refuse() -> None:
        refused = QueueFullError("the queue is full")
        raise refused  # this frame holds it: a cycle through the traceback

    def answer() -> ServiceError:
        try:
            try:
                refuse()
            except QueueFullError:
                raise ServiceError("while refusing") from None
        except ServiceError as error:
            return error
        raise AssertionError("not raised")

    gc.collect()
    gc.disable()
    try:
        error = answer()
        inner = error.__context__
        assert error.__traceback__ is not None
        assert inner is not None
        forget_traceback(error)
        assert error.__traceback__ is None
        assert inner.__traceback__ is None
        del error, inner
        assert gc.collect() == 0
    finally:
        gc.enable()
