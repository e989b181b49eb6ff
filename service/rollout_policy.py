"""Whether a rollout step promotes its candidate, holds, or rolls back: a pure function of the
measurements of one window (``decide``).

A step holds until its window has ``min_requests`` candidate requests and ``hold_s`` has passed;
then every check must pass to promote, and the first one that fails names the rollback. The
checks, in order: the candidate's error rate, its p99 latency against the served version's, and
its agreement with the served version's answers on the shadowed requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["promote", "hold", "rollback"]


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What a candidate must show in one step's window to be promoted."""

    min_requests: int = 100
    """Candidate requests (served a share of traffic, or shadowed) a window needs before it
    decides anything."""
    max_error_rate: float = 0.01
    """Largest share of the candidate's requests that may fail (0-1)."""
    max_p99_ratio: float = 1.5
    """Largest candidate p99 latency over the served version's p99."""
    min_agreement: float = 0.99
    """Smallest share of compared requests on which the candidate agreed (0-1)."""
    hold_s: float = 60.0
    """Shortest time a step lasts, however many requests came."""

    def __post_init__(self) -> None:
        checks = (
            ("min_requests", self.min_requests >= 1, "at least 1"),
            ("max_error_rate", 0.0 <= self.max_error_rate <= 1.0, "within 0-1"),
            ("max_p99_ratio", self.max_p99_ratio > 0, "above 0"),
            ("min_agreement", 0.0 <= self.min_agreement <= 1.0, "within 0-1"),
            ("hold_s", self.hold_s >= 0, "0 or more"),
        )
        for name, valid, accepted in checks:
            if not valid:
                raise ValueError(f"{name} must be {accepted}, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Window:
    """What the server measured since a step began (the candidate's requests, whether served a
    share of traffic or shadowed)."""

    held_s: float
    """Seconds since the step began."""
    requests: int
    """Candidate requests answered or failed."""
    errors: int
    candidate_p99_s: float | None = None
    """None: not measured (no request served by the candidate)."""
    served_p99_s: float | None = None
    compared: int = 0
    """Requests whose candidate answer was compared with the served one (shadowed)."""
    disagreed: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def agreement(self) -> float | None:
        """The share of compared requests that agreed; None when none was compared."""
        return 1.0 - self.disagreed / self.compared if self.compared else None

    @property
    def p99_ratio(self) -> float | None:
        """Candidate p99 over served p99; None when either is unknown."""
        if self.candidate_p99_s is None or not self.served_p99_s:
            return None
        return self.candidate_p99_s / self.served_p99_s


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    check: str | None = None
    """The check that failed (``error_rate``, ``p99_ratio``, ``agreement``) on a rollback."""
    reason: str = ""
    """Why, with the figures, for the plan's record and the CLI's exit message."""


def decide(window: Window, thresholds: Thresholds) -> Decision:
    """Promote, hold or roll back on ``window``. A check whose figure is unknown (no shadowed
    request compared, no served latency) does not block a promotion: the checks that could be
    made decide."""
    full = window.requests >= thresholds.min_requests and window.held_s >= thresholds.hold_s
    if not full:
        return Decision(
            "hold",
            reason=f"{window.requests}/{thresholds.min_requests} requests, "
            f"{window.held_s:.0f}/{thresholds.hold_s:.0f} s",
        )
    if window.error_rate > thresholds.max_error_rate:
        return Decision(
            "rollback",
            "error_rate",
            f"error rate {window.error_rate:.4f} > {thresholds.max_error_rate:g} "
            f"({window.errors} of {window.requests} requests failed)",
        )
    ratio = window.p99_ratio
    if ratio is not None and ratio > thresholds.max_p99_ratio:
        return Decision(
            "rollback",
            "p99_ratio",
            f"p99 ratio {ratio:.2f} > {thresholds.max_p99_ratio:g} (candidate "
            f"{_ms(window.candidate_p99_s)} ms, served {_ms(window.served_p99_s)} ms)",
        )
    agreement = window.agreement
    if agreement is not None and agreement < thresholds.min_agreement:
        return Decision(
            "rollback",
            "agreement",
            f"agreement {agreement:.4f} < {thresholds.min_agreement:g} "
            f"({window.disagreed} of {window.compared} compared requests disagreed)",
        )
    return Decision(
        "promote",
        reason=f"{window.requests} requests, error rate {window.error_rate:.4f}, "
        f"p99 ratio {_figure(ratio)}, agreement {_figure(agreement)}",
    )


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f}"


def _figure(value: float | None) -> str:
    return "unknown" if value is None or math.isnan(value) else f"{value:.4f}"
