"""What each version of a model answered lately: requests, errors and latency percentiles.

A pure structure of the time it is given (``now_s``, ``time.monotonic()`` in the server), so
that it is tested without a clock: each version keeps its answers of the last ``window_s``
seconds, at most ``max_answers`` of them (the oldest go first). Each engine keeps one, as it
sees every request of every front end (from its receipt to its answer); ``GET
/admin/models/{name}/traffic`` sums the engines' ``TrafficReport``s, and a rollout judges a
version by that.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: How far back a version's answers count, by default.
WINDOW_S = 60.0
#: The most answers a version keeps, by default.
MAX_ANSWERS = 10_000


class _Answer(NamedTuple):
    at_s: float
    latency_s: float
    error: bool


@dataclass(frozen=True)
class VersionStats:
    """One version's answers within the window."""

    requests: int
    errors: int
    """Answers with a 5xx status: the server's failures, not the client's mistakes."""
    p50_ms: float | None
    """None without requests."""
    p99_ms: float | None

    def to_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.errors / self.requests if self.requests else 0.0,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
        }


NO_ANSWERS = VersionStats(requests=0, errors=0, p50_ms=None, p99_ms=None)
"""A version with no answer in the window."""


@dataclass(frozen=True)
class VersionAnswers:
    """One version's answers within one engine's window: its latencies are kept, not their
    percentiles, so that several engines' answers sum to the percentiles of them all."""

    errors: int
    latencies_s: tuple[float, ...]

    def stats(self) -> VersionStats:
        if not self.latencies_s:
            return NO_ANSWERS
        ordered = sorted(self.latencies_s)
        return VersionStats(
            requests=len(ordered),
            errors=self.errors,
            p50_ms=percentile(ordered, 50) * 1000,
            p99_ms=percentile(ordered, 99) * 1000,
        )


@dataclass(frozen=True)
class TrafficReport:
    """What one model's versions answered within the window, on one engine or summed over
    several (``summed``)."""

    window_s: float
    versions: dict[str, VersionAnswers]

    def stats(self) -> dict[str, VersionStats]:
        return {version: answers.stats() for version, answers in self.versions.items()}

    def to_wire(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "versions": {
                version: {"errors": answers.errors, "latencies_s": list(answers.latencies_s)}
                for version, answers in self.versions.items()
            },
        }

    @classmethod
    def from_wire(cls, document: dict[str, Any]) -> TrafficReport:
        return cls(
            window_s=float(document["window_s"]),
            versions={
                str(version): VersionAnswers(
                    int(answers["errors"]), tuple(float(s) for s in answers["latencies_s"])
                )
                for version, answers in document["versions"].items()
            },
        )

    @classmethod
    def summed(cls, reports: Sequence[TrafficReport]) -> TrafficReport:
        """Every report's answers together (the window: the widest)."""
        errors: dict[str, int] = {}
        latencies: dict[str, list[float]] = {}
        for report in reports:
            for version, answers in report.versions.items():
                errors[version] = errors.get(version, 0) + answers.errors
                latencies.setdefault(version, []).extend(answers.latencies_s)
        return cls(
            window_s=max((report.window_s for report in reports), default=WINDOW_S),
            versions={
                version: VersionAnswers(errors[version], tuple(latencies[version]))
                for version in errors
            },
        )


class TrafficWindow:
    """Recent answers by model and version."""

    def __init__(self, window_s: float = WINDOW_S, max_answers: int = MAX_ANSWERS) -> None:
        if window_s <= 0 or max_answers < 1:
            raise ValueError(f"window_s > 0 and max_answers >= 1, got {window_s}, {max_answers}")
        self.window_s = window_s
        self._max_answers = max_answers
        self._answers: dict[tuple[str, str], deque[_Answer]] = {}

    def record(self, model: str, version: str, now_s: float, latency_s: float, status: int) -> None:
        """One answer of ``model@version`` with ``status``, given at ``now_s``."""
        answers = self._answers.get((model, version))
        if answers is None:
            answers = self._answers[model, version] = deque(maxlen=self._max_answers)
        answers.append(_Answer(now_s, latency_s, status >= 500))
        self._forget_before(answers, now_s)

    def stats(self, model: str, now_s: float) -> dict[str, VersionStats]:
        """Each version of ``model`` answered within the window ending at ``now_s``."""
        return self.report(model, now_s).stats()

    def report(self, model: str, now_s: float) -> TrafficReport:
        """Each version of ``model``'s answers within the window ending at ``now_s``."""
        found: dict[str, VersionAnswers] = {}
        for (name, version), answers in list(self._answers.items()):
            if name != model:
                continue
            self._forget_before(answers, now_s)
            if not answers:
                del self._answers[name, version]
                continue
            found[version] = VersionAnswers(
                errors=sum(answer.error for answer in answers),
                latencies_s=tuple(answer.latency_s for answer in answers),
            )
        return TrafficReport(self.window_s, found)

    def _forget_before(self, answers: deque[_Answer], now_s: float) -> None:
        oldest_s = now_s - self.window_s
        while answers and answers[0].at_s < oldest_s:
            answers.popleft()


def percentile(ordered: list[float], percent: float) -> float:
    """The nearest-rank ``percent`` percentile of ``ordered`` (ascending, not empty)."""
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]
