"""A rollout plan's state, as ``batchserve rollout`` records it through the admin API
(``PUT /admin/models/{name}/rollout``) and reads it back when it is run again.

The record says where the plan stands (``state``, ``step``) and every decision made, with why,
so that a rerun after an engine or front end was restarted (or the CLI itself was killed)
resumes the step it was in, or finishes the rollback it had begun: a plan is never left half
applied.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.rollout_policy import Verdict

PlanState = Literal["running", "rolling_back", "rolled_back", "promoted"]
"""``running``: holding ``step``; ``rolling_back``: decided, weights not yet back (a rerun
finishes it); ``rolled_back`` and ``promoted``: done."""


class RolloutDecision(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    percent: int = Field(ge=0, le=100)
    """The step's share of traffic for the candidate."""
    verdict: Verdict
    check: str | None = None
    """The failed check on a rollback (``error_rate``, ``p99_ratio``, ``agreement``)."""
    reason: str
    at: float
    """Unix time (a record read across processes and restarts, not a duration)."""


class RolloutPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    from_version: str = Field(min_length=1, max_length=128)
    to_version: str = Field(min_length=1, max_length=128)
    steps: tuple[int, ...] = Field(min_length=1)
    """The candidate's share of traffic at each step, percent, increasing; 0 runs a step on
    shadow traffic alone; the last is 100."""
    step: int = Field(default=0, ge=0)
    """The index in ``steps`` of the step being held."""
    state: PlanState = "running"
    started_at: float
    """Unix time the plan began."""
    step_started_at: float
    """Unix time the current step's window began."""
    thresholds: dict[str, float] = Field(default_factory=dict)
    decisions: tuple[RolloutDecision, ...] = ()

    @model_validator(mode="after")
    def _check_steps(self) -> RolloutPlan:
        steps = self.steps
        if any(not 0 <= percent <= 100 for percent in steps):
            raise ValueError(f"every step is a percentage within 0-100, got {list(steps)}")
        if list(steps) != sorted(set(steps)) or steps[-1] != 100:
            raise ValueError(f"steps must increase and end at 100, got {list(steps)}")
        if self.step >= len(steps):
            raise ValueError(f"step {self.step} is past the plan's {len(steps)} steps")
        if self.from_version == self.to_version:
            raise ValueError(f"the plan goes from {self.from_version} to itself")
        return self

    @property
    def percent(self) -> int:
        """The candidate's share of traffic at the current step."""
        return self.steps[self.step]
