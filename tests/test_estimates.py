"""Batch durations: what the deadline decisions are made from."""

from __future__ import annotations

import random

import pytest

from service.engine.batcher import estimates
from service.engine.batcher.estimates import BatchTimes, size_class


def test_size_classes_double() -> None:
    assert [size_class(rows) for rows in (0, 1, 2, 3, 4, 7, 8, 64)] == [1, 1, 2, 2, 3, 3, 4, 7]


def test_an_unmeasured_group_has_no_estimate() -> None:
    times = BatchTimes()
    times.record("a", 4, 0.010)
    assert times.estimate("b", 4) is None


def test_one_slow_batch_does_not_move_the_estimate() -> None:
    times = BatchTimes()
    for seconds in (0.010, 0.011, 0.012, 2.0):
        times.record("g", 4, seconds)
    assert times.estimate("g", 4) == 0.011  # the lower median
    times.record("g", 4, 3.0)
    times.record("g", 4, 3.0)
    assert times.estimate("g", 4) == 2.0  # slower for good: the estimate follows


def test_a_size_not_measured_is_scaled_from_the_nearest_one() -> None:
    times = BatchTimes()
    times.record("g", 1, 0.010)  # class 1
    times.record("g", 16, 0.100)  # class 5
    assert times.estimate("g", 2) == 0.020  # class 2: one class above 1, twice as long
    assert times.estimate("g", 64) == 0.400  # class 7: two classes above 5
    assert times.estimate("g", 8) == 0.100  # class 4: below 5 (nearer than 1), as long at most


def test_durations_are_forgotten_after_a_while() -> None:
    """Refusals stop new measurements: a stale estimate must not go on refusing forever."""
    now = [1000.0]
    times = BatchTimes(lambda: now[0])
    times.record("g", 1, 5.0)
    assert times.estimate("g", 1) == 5.0
    now[0] += estimates.FRESH_FOR_S + 0.1
    assert times.estimate("g", 1) is None
    assert times.fastest("g", 1) == 5.0  # what the forward itself needs is kept


def test_the_estimate_recovers_within_seconds_of_an_overload() -> None:
    """Issue 23, finding 5: five durations slowed by an overload outvoted the first quick
    ones after it (the median of the last five) and refused the shape for up to 30 s."""
    now = [1000.0]
    times = BatchTimes(lambda: now[0])
    for _ in range(5):
        times.record("g", 1, 0.4)  # a refusal storm takes the forward's CPU
        now[0] += 0.1
    now[0] += estimates.FRESH_FOR_S
    times.record("g", 1, 0.06)  # the load ended: one request, measured alone
    assert times.estimate("g", 1) == 0.06
    assert times.fastest("g", 1) == 0.06


def test_the_fastest_duration_is_scaled_like_the_estimate() -> None:
    times = BatchTimes()
    times.record("g", 1, 0.010)
    times.record("g", 1, 0.030)
    assert times.fastest("g", 4) == 0.040  # class 3: two classes above 1
    assert times.fastest("other", 1) is None


def test_one_loaded_measurement_does_not_keep_a_size_looking_slow() -> None:
    """A warm-up beside other work measured 2 rows at 0.5 s where one row takes 0.01 s and
    four 0.03 s: the quickest a size can be is bounded by its neighbours (2 rows: no more
    than one row's doubled, nor than four rows'), so the time quantum does not cut its
    batches to one row while nothing would ever measure 2 rows again."""
    times = BatchTimes()
    times.record("g", 1, 0.010)
    times.record("g", 2, 0.500)
    times.record("g", 4, 0.030)
    assert times.fastest("g", 2) == 0.020
    assert times.fastest("g", 4) == 0.030
    assert times.fastest("g", 8) == 0.060  # beyond what was measured: doubled
    times.record("g", 2, 0.015)  # measured unloaded at last
    assert times.fastest("g", 2) == 0.015


@pytest.mark.parametrize(("seed", "max_rows"), [(7, 300), (8, 3), (9, 5)])
def test_tabled_estimates_read_as_computed_afresh_whatever_the_times_of_reads(
    seed: int, max_rows: int
) -> None:
    """Estimates are tabled per group until a record or a measurement going stale changes
    them: read at any moment, they are those of a ``BatchTimes`` that never read before.
    With few sizes (``max_rows``) most records are of a size still fresh, which keeps the
    table and forgets its values."""
    rng = random.Random(seed)
    now = [1000.0]
    times = BatchTimes(lambda: now[0])
    records: list[tuple[float, str, int, float]] = []
    afresh_now = [0.0]
    for _ in range(300):
        if rng.random() < 0.3:
            group, rows, seconds = rng.choice("gh"), rng.randint(1, max_rows), rng.random()
            times.record(group, rows, seconds)
            records.append((now[0], group, rows, seconds))
        now[0] += rng.choice((0.0, 0.2, 1.0, estimates.FRESH_FOR_S / 2))
        afresh = BatchTimes(lambda: afresh_now[0])
        for at_s, group, rows, seconds in records:
            afresh_now[0] = at_s
            afresh.record(group, rows, seconds)
        afresh_now[0] = now[0]
        for group in "ghx":
            for rows in (1, 2, 3, 5, 64, 200, 2**14, 2**15, 2**16 - 1, 2**16, 70_000):
                assert times.estimate(group, rows) == afresh.estimate(group, rows)


def test_sizes_beyond_the_table_are_scaled_as_within_it() -> None:
    times = BatchTimes(lambda: 1000.0)
    times.record("g", 1, 0.001)
    for rows, size in ((2**14, 15), (2**15, 16), (2**16, 17), (2**17, 18)):
        assert times.estimate("g", rows) == pytest.approx(0.001 * 2 ** (size - 1))
        assert times.fastest("g", rows) == pytest.approx(0.001 * 2 ** (size - 1))


def test_a_duration_counts_for_exactly_fresh_for_s() -> None:
    now = [1000.0]
    times = BatchTimes(lambda: now[0])
    times.record("g", 1, 0.5)
    assert times.estimate("g", 2) == 1.0  # tabled from now on
    now[0] += estimates.FRESH_FOR_S
    assert times.estimate("g", 1) == 0.5
    assert times.estimate("g", 2) == 1.0
    now[0] += 0.001
    assert times.estimate("g", 1) is None
    assert times.estimate("g", 2) is None


def test_between_two_sizes_as_near_the_larger_is_read_unscaled() -> None:
    times = BatchTimes()
    times.record("g", 2, 0.010)  # class 2
    times.record("g", 8, 0.050)  # class 4
    assert times.estimate("g", 4) == 0.050  # class 3: as long as the larger, not 0.020
