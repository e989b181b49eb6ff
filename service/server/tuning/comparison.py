"""Whether the search's pick beats the defaults, from interleaved rounds of both.

One measurement window per candidate is a noisy sample on a shared host, so the pick is
measured again beside the defaults, round after round, and written only when it is better
beyond that noise: better in every round, and by more than the rounds' own spread (at
least ``SMALLEST_GAIN``). Otherwise the defaults are within the noise of the best, and
they are written: settings that are not clearly better are not worth changing.

"Better" is the search's rule on the medians: meeting the p99 target when the other does
not; with both meeting it, more requests/s; with neither, a lower p99.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.server.tuning.search import Result

#: The smallest gain over the defaults that counts, however steady the rounds.
SMALLEST_GAIN = 0.05


def median_of(results: Sequence[Result]) -> tuple[float, float]:
    """Median throughput and median p99 over rounds."""
    if not results:
        return 0.0, math.inf
    return (
        statistics.median(result.throughput_rps for result in results),
        statistics.median(result.p99_ms for result in results),
    )


def spread(values: Sequence[float]) -> float:
    """How far rounds of one configuration differ: (largest - smallest) / median."""
    finite = [value for value in values if math.isfinite(value)]
    if len(finite) < len(values) or not finite:
        return math.inf
    middle = statistics.median(finite)
    return (max(finite) - min(finite)) / middle if middle > 0 else math.inf


@dataclass(frozen=True)
class Comparison:
    """The verdict on the pick against the defaults, and its figures."""

    pick_is_better: bool
    reason: str
    gain: float
    """The pick's gain over the defaults by the deciding figure (requests/s, or p99 when
    neither meets the target): 0.1 is 10 % better."""
    noise: float
    """The largest spread of the rounds of either configuration by that figure."""


def compare(pick: Sequence[Result], defaults: Sequence[Result], p99_ms: float) -> Comparison:
    """Whether ``pick`` beats ``defaults`` beyond the noise (round i of each measured side
    by side)."""
    pick_meets = _meets(pick, median_of(pick)[1], p99_ms)
    defaults_meet = _meets(defaults, median_of(defaults)[1], p99_ms)
    if pick_meets != defaults_meet:
        met, missed = ("the pick", "the defaults") if pick_meets else ("the defaults", "the pick")
        return Comparison(
            pick_meets,
            f"{met} met p99 {p99_ms:g} ms (medians), {missed} did not",
            math.inf if pick_meets else -math.inf,
            0.0,
        )
    if pick_meets:
        figure, gain, noise, every_round = "requests/s", *_by(pick, defaults, _throughput)
    else:
        figure, gain, noise, every_round = "p99", *_by(pick, defaults, _inverse_p99)
    needed = max(SMALLEST_GAIN, noise)
    better = every_round and gain > needed
    if gain >= 0:
        verdict = f"the pick's median {figure} is {_percent(gain)} better than the defaults'"
    else:
        verdict = f"the pick's median {figure} is {_percent(-gain)} worse than the defaults'"
    if better:
        reason = f"{verdict}, in every round, beyond the rounds' spread of {_percent(noise)}"
    elif gain > 0 and not every_round:
        reason = f"{verdict}, but not in every round: within the noise"
    elif gain > 0:
        reason = (
            f"{verdict}, within the noise ({_percent(needed)}: the rounds' spread, at least "
            f"{SMALLEST_GAIN:.0%})"
        )
    else:
        reason = verdict
    return Comparison(better, reason, gain, noise)


def _throughput(result: Result) -> float:
    return result.throughput_rps


def _inverse_p99(result: Result) -> float:
    """Answers a second per client, as a p99 allows: higher is better, as throughput."""
    return 1000 / result.p99_ms if result.p99_ms > 0 else math.inf


def _by(
    pick: Sequence[Result], defaults: Sequence[Result], figure: Callable[[Result], float]
) -> tuple[float, float, bool]:
    """By ``figure`` (higher is better): the pick's gain on the medians, the largest
    spread of either's rounds, and whether the pick did better in every round."""
    picked, default = [figure(r) for r in pick], [figure(r) for r in defaults]
    middle = statistics.median(default)
    gain = statistics.median(picked) / middle - 1 if middle > 0 else math.inf
    noise = max(spread(picked), spread(default))
    every_round = all(p > d for p, d in zip(picked, default, strict=True))
    return gain, noise, every_round


def _meets(results: Sequence[Result], median_p99_ms: float, p99_ms: float) -> bool:
    return (
        bool(results)
        and median_p99_ms <= p99_ms
        and all(result.errors == 0 and result.throughput_rps > 0 for result in results)
    )


def _percent(share: float) -> str:
    return f"{share:.0%}" if math.isfinite(share) else "infinitely"
