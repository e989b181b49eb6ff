"""What each version of a model answered lately: requests, errors and latency percentiles.

A pure structure of the time it is given (``now_s``, ``time.monotonic()`` in the server), so
that it is tested without a clock: each version keeps its answers of the last ``window_s``
seconds, at most ``max_answers`` of them (the oldest go first). ``GET
/admin/models/{name}/traffic`` reads it, and a rollout judges a version by it. Each front end
keeps its own: with several, each reports the requests it answered.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

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
        found: dict[str, VersionStats] = {}
        for (name, version), answers in list(self._answers.items()):
            if name != model:
                continue
            self._forget_before(answers, now_s)
            if not answers:
                del self._answers[name, version]
                continue
            latencies = sorted(answer.latency_s for answer in answers)
            found[version] = VersionStats(
                requests=len(answers),
                errors=sum(answer.error for answer in answers),
                p50_ms=percentile(latencies, 50) * 1000,
                p99_ms=percentile(latencies, 99) * 1000,
            )
        return found

    def _forget_before(self, answers: deque[_Answer], now_s: float) -> None:
        oldest_s = now_s - self.window_s
        while answers and answers[0].at_s < oldest_s:
            answers.popleft()


def percentile(ordered: list[float], percent: float) -> float:
    """The nearest-rank ``percent`` percentile of ``ordered`` (ascending, not empty)."""
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]
