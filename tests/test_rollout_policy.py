"""A rollout step's decision from its window (``service/rollout_policy.py``)."""

from __future__ import annotations

import pytest

from service.rollout_policy import Thresholds, Window, decide

THRESHOLDS = Thresholds(
    min_requests=100, max_error_rate=0.01, max_p99_ratio=1.5, min_agreement=0.99, hold_s=30
)


def window(**figures: float) -> Window:
    base: dict[str, float] = {
        "held_s": 30,
        "requests": 100,
        "errors": 0,
        "candidate_p99_s": 0.010,
        "served_p99_s": 0.010,
        "compared": 100,
        "disagreed": 0,
    }
    base.update(figures)
    return Window(**base)  # type: ignore[arg-type]


def test_a_good_window_promotes() -> None:
    decision = decide(window(), THRESHOLDS)
    assert decision.verdict == "promote"
    assert decision.check is None


@pytest.mark.parametrize(
    "figures", [{"requests": 99}, {"held_s": 29.9}, {"requests": 0, "compared": 0}]
)
def test_a_window_short_of_requests_or_time_holds(figures: dict[str, float]) -> None:
    decision = decide(window(**figures), THRESHOLDS)
    assert decision.verdict == "hold"


def test_a_short_window_holds_even_when_it_looks_bad() -> None:
    assert decide(window(requests=50, errors=50), THRESHOLDS).verdict == "hold"


def test_too_many_errors_roll_back_naming_the_check() -> None:
    decision = decide(window(requests=200, errors=3), THRESHOLDS)
    assert (decision.verdict, decision.check) == ("rollback", "error_rate")
    assert "error rate 0.0150 > 0.01 (3 of 200" in decision.reason
    assert decide(window(requests=200, errors=2), THRESHOLDS).verdict == "promote"


def test_a_slow_candidate_rolls_back_on_its_p99_ratio() -> None:
    decision = decide(window(candidate_p99_s=0.0151), THRESHOLDS)
    assert (decision.verdict, decision.check) == ("rollback", "p99_ratio")
    assert "p99 ratio 1.51 > 1.5" in decision.reason
    assert decide(window(candidate_p99_s=0.015), THRESHOLDS).verdict == "promote"


def test_a_candidate_disagreeing_on_5_percent_rolls_back_on_agreement() -> None:
    decision = decide(window(compared=200, disagreed=10), THRESHOLDS)
    assert (decision.verdict, decision.check) == ("rollback", "agreement")
    assert "agreement 0.9500 < 0.99 (10 of 200 compared requests disagreed)" in decision.reason


def test_the_error_rate_is_checked_before_latency_and_agreement() -> None:
    decision = decide(window(errors=50, candidate_p99_s=1.0, disagreed=50), THRESHOLDS)
    assert decision.check == "error_rate"


def test_unknown_figures_do_not_block_a_promotion() -> None:
    unknown = window(candidate_p99_s=None, served_p99_s=None, compared=0)  # type: ignore[arg-type]
    assert unknown.p99_ratio is None
    assert unknown.agreement is None
    decision = decide(unknown, THRESHOLDS)
    assert decision.verdict == "promote"
    assert "p99 ratio unknown, agreement unknown" in decision.reason


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_requests", 0), ("max_error_rate", 1.5), ("max_p99_ratio", 0), ("min_agreement", -0.1),
     ("hold_s", -1)],
)  # fmt: skip
def test_thresholds_out_of_range_are_refused_quoting_the_value(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field} must be .*, got {value}"):
        Thresholds(**{field: value})  # type: ignore[arg-type]
