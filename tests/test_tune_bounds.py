"""``tuning.bounds`` and ``tuning.comparison``: what ``tune`` says bounds its result, and
when it keeps the defaults. Issue 37, item 1: a winner served ~700 requests/s against a
model limit of 3,622 rows/s and an HTTP ceiling of 3,550 requests/s without a word on why,
and a pick serving 0.92x the defaults in an interleaved check was written."""

from __future__ import annotations

import pytest

from service.server.tuning.bounds import what_bounds_throughput
from service.server.tuning.comparison import SMALLEST_GAIN, compare
from service.server.tuning.search import Context, ModelLimit, Result
from service.server.tuning.space import Candidate, defaults_candidate

#: A model of 4,000 rows/s at batch 8 or more.
LIMIT = ModelLimit(rows_per_s={None: {1: 1000.0, 8: 4000.0, 64: 4000.0}})
PICK = Candidate(max_batch_size=8)


def context(ceiling_rps: float = 3500.0, **changes: object) -> Context:
    values: dict[str, object] = {
        "cores": 2,
        "concurrency": 64,
        "p99_ms": 40.0,
        "limit": LIMIT,
        "weights": {None: 1.0},
        "ceiling_rps": {1: ceiling_rps},
    }
    return Context(**(values | changes))  # type: ignore[arg-type]


def served(rps: float, p99_ms: float = 30.0, candidate: Candidate = PICK) -> Result:
    return Result(candidate, rps, p99_ms / 2, p99_ms)


@pytest.mark.parametrize(
    ("limits", "rps", "kind", "words"),
    [
        ({"ceiling_rps": 9000.0}, 3500.0, "model", "88% of the model limit (4,000 rows/s)"),
        ({"ceiling_rps": 1000.0}, 900.0, "http", "90% of the HTTP ceiling (1,000 requests/s)"),
        ({}, 1700.0, "cores", "their costs per request added up allow about 1,867 requests/s"),
        ({}, 700.0, "latency", "18% of the model limit (4,000 rows/s) and 20% of the HTTP"),
    ],
)
def test_what_bounds_a_result_that_met_the_target(
    limits: dict[str, object], rps: float, kind: str, words: str
) -> None:
    bound = what_bounds_throughput(context(**limits), served(rps), [served(rps)])
    assert bound.kind == kind
    assert words in bound.reason


def test_the_p99_target_bounds_when_a_faster_candidate_missed_it() -> None:
    faster = served(1200.0, p99_ms=55.0, candidate=Candidate(max_batch_size=128))
    bound = what_bounds_throughput(context(), served(700.0), [served(700.0), faster])
    assert bound.kind == "p99 target"
    assert "`batch=128` served 1,200 requests/s in the search, with p99 55.0 ms" in bound.reason


def test_rows_per_request_turn_the_model_limit_into_requests() -> None:
    bound = what_bounds_throughput(
        context(ceiling_rps=9000.0, rows_per_request=4.0), served(900.0), []
    )
    assert bound.kind == "model"
    assert "4,000 rows/s, 1,000 requests/s of 4 rows" in bound.reason


def rounds(rps: list[float], p99_ms: float = 30.0, candidate: Candidate = PICK) -> list[Result]:
    return [served(value, p99_ms, candidate) for value in rps]


def defaults(rps: list[float], p99_ms: float = 30.0) -> list[Result]:
    return rounds(rps, p99_ms, defaults_candidate())


def test_a_pick_serving_less_than_the_defaults_is_not_written() -> None:
    """The issue's digits at 64 clients: 4,956 requests/s against the defaults' 5,401."""
    verdict = compare(rounds([4956.0, 4900.0, 5010.0]), defaults([5401.0, 5350.0, 5420.0]), 40)
    assert not verdict.pick_is_better
    assert verdict.reason == "the pick's median requests/s is 8% worse than the defaults'"


def test_a_gain_within_the_rounds_spread_keeps_the_defaults() -> None:
    verdict = compare(rounds([1100.0, 1300.0]), defaults([1000.0, 1200.0]), 40)
    assert not verdict.pick_is_better
    assert "within the noise" in verdict.reason


def test_a_gain_in_some_rounds_only_keeps_the_defaults() -> None:
    verdict = compare(rounds([1500.0, 1000.0, 1500.0]), defaults([1000.0, 1010.0, 1000.0]), 40)
    assert not verdict.pick_is_better
    assert "not in every round" in verdict.reason


def test_a_small_gain_on_steady_rounds_is_still_noise() -> None:
    small = 1 + SMALLEST_GAIN / 2
    verdict = compare(rounds([1000.0 * small] * 3), defaults([1000.0] * 3), 40)
    assert not verdict.pick_is_better


def test_a_clear_gain_in_every_round_writes_the_pick() -> None:
    verdict = compare(rounds([1260.0, 1300.0, 1280.0]), defaults([1000.0, 1020.0, 990.0]), 40)
    assert verdict.pick_is_better
    assert verdict.reason.startswith("the pick's median requests/s is 28% better")


def test_meeting_the_target_decides_before_throughput() -> None:
    pick_meets = compare(rounds([500.0, 510.0]), defaults([900.0, 910.0], p99_ms=80.0), 40)
    assert pick_meets.pick_is_better
    assert pick_meets.reason == "the pick met p99 40 ms (medians), the defaults did not"
    defaults_meet = compare(rounds([900.0], p99_ms=80.0), defaults([500.0]), 40)
    assert not defaults_meet.pick_is_better


def test_with_neither_meeting_the_lower_p99_wins_beyond_the_noise() -> None:
    verdict = compare(rounds([500.0, 500.0], p99_ms=50.0), defaults([500.0, 500.0], 90.0), 40)
    assert verdict.pick_is_better
    assert "median p99 is 80% better" in verdict.reason
