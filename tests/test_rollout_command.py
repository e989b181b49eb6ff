"""``batchserve rollout``'s resume rules (``server/rollout_command.py``) against a fake admin
API: a rerun finishes a rollback it had decided, marks a promotion it had applied, refuses a
plan for another version, and a window survives its engine's counts starting again."""

from __future__ import annotations

import argparse
from typing import Any

from service.rollout_plan import RolloutDecision, RolloutPlan
from service.rollout_policy import Thresholds
from service.server.cli import build_parser
from service.server.rollout_command import (
    EXIT_PROMOTED,
    EXIT_REFUSED,
    EXIT_ROLLED_BACK,
    AdminError,
    Rollout,
    ShadowCounts,
)


class FakeAdmin:
    """The admin routes ``batchserve rollout`` calls, over one model's state; every call
    recorded. Each ``tick`` (the command's poll sleep) adds ``per_tick`` compared copies,
    ``disagreeing`` of them disagreeing."""

    def __init__(self, serving: str, plan: RolloutPlan | None = None) -> None:
        self.serving = serving
        self.plan = plan
        self.weights: dict[str, int] = {serving: 100}
        self.shadow: dict[str, int] | None = None
        self.calls: list[tuple[str, str]] = []
        self.per_tick = 50
        self.disagreeing = 0
        self.restart_at_tick: int | None = None
        self.ticks = 0

    def call(self, method: str, path: str, body: Any = None) -> Any:
        self.calls.append((method, path.rsplit("/", 1)[-1]))
        route = path.split("/admin/models/m/", 1)[1]
        if route == "versions":
            return {"serving": self.serving}
        if route == "rollout":
            if method == "PUT":
                self.plan = RolloutPlan.model_validate(body)
                return body
            if self.plan is None:
                raise AdminError(404, "no rollout plan was recorded for m")
            return self.plan.model_dump(mode="json")
        if route == "traffic":
            if method == "PUT":
                self.weights = dict(body["weights"])
                if self.weights.get(self.serving, 0) == 0:
                    self.serving = max(self.weights, key=self.weights.__getitem__)
            return {"weights": self.weights, "versions": {}}
        if route == "shadow":
            if method == "PUT":
                self.shadow = self.shadow or {"compared": 0, "failed": 0, "disagreed": 0}
            elif self.shadow is None:
                raise AdminError(404, "m has no shadow")
            report = dict(self.shadow)
            if method == "DELETE":
                self.shadow = None
            return report
        if route.endswith("/load"):
            self.serving = route.split("/")[1]
            self.weights = {self.serving: 100}
            return {}
        raise AssertionError(path)

    def tick(self, _seconds: float) -> None:
        self.ticks += 1
        if self.ticks == self.restart_at_tick:
            self.shadow = None  # its engine restarted: no shadow, no counts
        if self.shadow is not None:
            self.shadow["compared"] += self.per_tick
            self.shadow["disagreed"] += self.disagreeing


def arguments(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(
        ["rollout", "--url", "http://fake", "--token", "t", "--model", "m", "--to", "new",
         "--steps", "10,100", "--hold-s", "0", "--min-requests", "100", *extra]
    )  # fmt: skip


def run(admin: FakeAdmin, *extra: str) -> tuple[int, list[str]]:
    lines: list[str] = []
    args = arguments(*extra)
    thresholds = Thresholds(min_requests=args.min_requests, hold_s=args.hold_s)
    rollout = Rollout(admin, args, thresholds, lines.append, sleep=admin.tick)  # type: ignore[arg-type]
    return rollout.run(), lines


def plan(**changes: Any) -> RolloutPlan:
    base = RolloutPlan(
        model="m", from_version="old", to_version="new", steps=(10, 100), started_at=1.0,
        step_started_at=1.0,
    )  # fmt: skip
    return base.model_copy(update=changes)


def test_a_candidate_that_agrees_is_promoted_through_every_step() -> None:
    admin = FakeAdmin("old")
    status, lines = run(admin)
    assert status == EXIT_PROMOTED, lines
    assert admin.serving == "new"
    assert admin.shadow is None
    assert admin.plan is not None
    assert admin.plan.state == "promoted"
    assert [decision.verdict for decision in admin.plan.decisions] == ["promote"]


def test_a_rerun_finishes_a_rollback_that_was_decided() -> None:
    decided = RolloutDecision(
        percent=10, verdict="rollback", check="agreement", reason="agreement 0.9", at=2.0
    )
    admin = FakeAdmin("old", plan(state="rolling_back", decisions=(decided,)))
    admin.weights = {"old": 90, "new": 10}
    admin.shadow = {"compared": 10, "failed": 0, "disagreed": 1}
    status, lines = run(admin)
    assert status == EXIT_ROLLED_BACK
    assert lines[-1] == ("rolled back: m serves old; failed check: agreement (agreement 0.9)")
    assert (admin.weights, admin.shadow) == ({"old": 100}, None)
    assert admin.plan is not None
    assert admin.plan.state == "rolled_back"


def test_a_rerun_marks_a_promotion_that_was_applied() -> None:
    admin = FakeAdmin("new", plan(step=1))
    status, _ = run(admin)
    assert status == EXIT_PROMOTED
    assert admin.plan is not None
    assert admin.plan.state == "promoted"
    assert ("PUT", "traffic") not in admin.calls  # nothing applied again


def test_a_plan_for_another_version_is_refused_naming_it() -> None:
    admin = FakeAdmin("old", plan(to_version="other"))
    status, lines = run(admin)
    assert status == EXIT_REFUSED
    assert "--to other" in lines[0]
    assert admin.calls == [("GET", "versions"), ("GET", "rollout")]


def test_a_shadow_lost_with_its_engine_is_started_again_and_counted_from_then() -> None:
    """Mid-step the shadow is gone (its engine restarted): the command starts it again and
    the window counts from zero, never negative; the copies after the restart decide."""
    admin = FakeAdmin("old")
    admin.shadow = {"compared": 500, "failed": 0, "disagreed": 0}  # from an earlier shadow
    admin.restart_at_tick = 2
    admin.disagreeing = 5  # 10 % of every tick's copies
    status, lines = run(admin)
    assert status == EXIT_ROLLED_BACK, lines
    assert "agreement 0.9000 < 0.99 (10 of 100 compared" in lines[-1]
    assert admin.calls.count(("PUT", "shadow")) == 2


def test_counts_that_fall_are_counted_from_zero_again() -> None:
    counts = ShadowCounts({"compared": 500, "failed": 10, "disagreed": 5})
    counts.read({"compared": 540, "failed": 10, "disagreed": 6})
    assert counts.since_start() == (40, 0, 1)
    counts.read({"compared": 30, "failed": 1, "disagreed": 2})  # an engine lost its counts
    assert counts.since_start() == (30, 1, 2)
