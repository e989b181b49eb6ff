"""How ``tune`` shares its time budget, and its progress lines on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import TextIO

#: A first guess of how long a server takes to start, until one is measured.
FIRST_START_GUESS_S = 8.0
#: The shortest wait for a server to get ready: on a loaded host a start takes seconds.
MIN_READY_TIMEOUT_S = 30.0
MAX_READY_TIMEOUT_S = 120.0
#: Kept for the end: stopping the servers and writing the report (matplotlib imports slowly).
FINISH_S = 6.0


@dataclass(frozen=True)
class Plan:
    """Per-measurement durations, the model limit's share, and the re-measurement rounds."""

    limit_s: float
    measure_s: float
    warmup_s: float
    rounds: int
    ceiling_workers: tuple[int, ...]


def plan_budget(budget_s: float, cores: int) -> Plan:
    """Longer measurements with more budget: 1 s each at 60 s or less, 5 s from 300 s. The
    HTTP ceiling of several front ends is measured only with 2 minutes or more: starting
    gunicorn costs seconds, and the search tries front ends only when it is worth it."""
    measure_s = min(5.0, max(1.0, budget_s / 60))
    several = cores >= 2 and budget_s >= 120
    return Plan(
        limit_s=min(30.0, max(2.0, budget_s * 0.08)),
        measure_s=measure_s,
        warmup_s=min(1.0, max(0.3, measure_s / 4)),
        rounds=3 if budget_s >= 120 else 2,
        ceiling_workers=(1, cores) if several else (1,),
    )


#: Answers a measurement window should hold for its p99 to mean something.
ANSWERS_PER_WINDOW = 200
#: The longest window, as a multiple of the plan's: a slow model gets longer windows.
LONGEST_WINDOW_FACTOR = 2
#: The most of the budget the re-measurement's rounds may take (at least 2 rounds).
REMEASURE_SHARE = 0.3


def window_for(plan: Plan, expected_rps: float) -> Plan:
    """``plan`` with a measurement window long enough for ``ANSWERS_PER_WINDOW`` answers at
    ``expected_rps`` (the lower of the model limit and the HTTP ceiling), within bounds."""
    longest_s = plan.measure_s * LONGEST_WINDOW_FACTOR
    wanted_s = ANSWERS_PER_WINDOW / expected_rps if expected_rps > 0 else longest_s
    measure_s = min(longest_s, max(plan.measure_s, wanted_s))
    return replace(plan, measure_s=measure_s)


def rounds_for(plan: Plan, budget_s: float) -> Plan:
    """``plan`` with as many re-measurement rounds (2 or 3) as ``REMEASURE_SHARE`` of the
    budget holds: longer windows, fewer rounds, more time for the search."""
    round_s = 2 * (plan.warmup_s + plan.measure_s)
    held = int(REMEASURE_SHARE * budget_s / round_s)
    return replace(plan, rounds=max(2, min(plan.rounds, held)))


class Progress:
    """One line per step on ``stream``, with the time spent and left; and the estimates of
    what a trial and the re-measurement still need."""

    def __init__(self, budget_s: float, plan: Plan, stream: TextIO = sys.stderr) -> None:
        self.started_s = time.monotonic()
        self.budget_s = budget_s
        self.plan = plan
        self.stream = stream
        self.start_s = FIRST_START_GUESS_S
        self.trial_s = FIRST_START_GUESS_S + plan.warmup_s + plan.measure_s
        self._started = False
        self._tried = False

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s()

    def ready_timeout_s(self) -> float:
        return max(MIN_READY_TIMEOUT_S, min(MAX_READY_TIMEOUT_S, self.left_s()))

    def started_in(self, seconds: float) -> None:
        """A server took ``seconds`` to get ready: later estimates use the slowest seen."""
        self.start_s = max(self.start_s, seconds) if self._started else seconds
        self._started = True

    def trial_took(self, seconds: float) -> None:
        """A whole trial (start, measure, stop) took ``seconds``: the next may take as long."""
        self.trial_s = max(self.trial_s, seconds) if self._tried else seconds
        self._tried = True

    def measure_s(self) -> float:
        return self.plan.warmup_s + self.plan.measure_s

    def remeasure_s(self) -> float:
        """One more server to start (the defaults' keeps running), then the rounds."""
        return self.start_s + 2 * self.plan.rounds * self.measure_s()

    def time_for_a_trial(self) -> bool:
        return self.left_s() > self.trial_s + self.remeasure_s() + FINISH_S

    def rounds_left(self) -> int:
        """Rounds the time left holds, both servers started (at least one)."""
        room = (self.left_s() - FINISH_S) / (2 * self.measure_s())
        return max(1, min(self.plan.rounds, int(room)))

    def say(self, message: str) -> None:
        elapsed = self.elapsed_s()
        left = max(0.0, self.budget_s - elapsed)
        print(f"[{elapsed:4.0f} s, {left:4.0f} s left] {message}", file=self.stream, flush=True)
