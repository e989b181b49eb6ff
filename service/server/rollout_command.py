"""``batchserve rollout``: move a model from the version it serves to another in steps, through
the admin API, promoting on the server's own measurements or rolling back.

Each step but the last gives the candidate its share of traffic (``PUT .../traffic``; a step
of 0 leaves traffic alone) and shadows it (``PUT .../shadow``: a copy of the served version's
requests, compared answer by answer), holds until the window has enough requests and
``--hold-s`` has passed, and decides (``service/rollout_policy.py``). The last step (100) is
the promotion: the candidate is loaded as the only version, as ``POST .../load`` does, so a
rollback afterwards goes back to the old one. A failed check sets the traffic back to the old
version alone, stops the shadow, and exits 1 naming the check.

The plan's state is recorded on the server (``PUT .../rollout``, beside the published version
record) before each change. Run again with the same ``--to`` after an engine, a front end or
this command was killed, it resumes: a plan decided for rollback is rolled back (again: every
change is idempotent); a plan that had switched already is marked promoted; a plan in a step
holds that step again from a fresh window (the measurements of an engine that restarted are
gone). Never half-applied.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from service.rollout_plan import RolloutDecision, RolloutPlan
from service.rollout_policy import Decision, Thresholds, Window, decide
from service.server.admin_client import AdminApi, AdminError

EXIT_PROMOTED = 0
EXIT_ROLLED_BACK = 1
EXIT_REFUSED = 2
"""The server refused a step, or another plan is under way."""


def add_rollout_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rollout = commands.add_parser(
        "rollout",
        help="move a model to another version in steps, promoting or rolling back on the "
        "server's own measurements",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rollout.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    rollout.add_argument("--token", required=True, help="BATCHSERVE_ADMIN_TOKEN")
    rollout.add_argument("--model", required=True)
    rollout.add_argument("--to", required=True, dest="to_version", help="the candidate version")
    rollout.add_argument(
        "--steps",
        default="10,50,100",
        type=_steps,
        help="the candidate's share of traffic at each step, percent, increasing, ending at 100 "
        "(the promotion); 0: a step on shadow traffic alone (default 10,50,100)",
    )
    rollout.add_argument("--hold-s", type=float, default=60.0, help="each step's shortest time")
    rollout.add_argument("--min-requests", type=int, default=100)
    rollout.add_argument("--min-agreement", type=float, default=0.99)
    rollout.add_argument("--max-error-rate", type=float, default=0.01)
    rollout.add_argument("--max-p99-ratio", type=float, default=1.5)
    rollout.add_argument(
        "--shadow-percent",
        type=int,
        default=100,
        help="share of the old version's requests copied to the candidate (default 100)",
    )
    rollout.add_argument("--poll-s", type=float, default=2.0, help="how often to read the window")
    rollout.add_argument(
        "--step-timeout-s",
        type=float,
        default=3600.0,
        help="roll back when a step's window has not filled in this long",
    )


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(part) for part in text.split(","))
    except ValueError as error:
        message = f"steps are comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from error
    if list(steps) != sorted(set(steps)) or steps[-1] != 100 or steps[0] < 0:
        raise argparse.ArgumentTypeError(f"steps increase within 0-100 and end at 100, got {text}")
    return steps


def run_rollout(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    api = AdminApi(args.url, args.token)
    try:
        thresholds = Thresholds(
            min_requests=args.min_requests,
            max_error_rate=args.max_error_rate,
            max_p99_ratio=args.max_p99_ratio,
            min_agreement=args.min_agreement,
            hold_s=args.hold_s,
        )
    except ValueError as error:
        out(f"batchserve rollout: {error}")
        return EXIT_REFUSED
    rollout = Rollout(api, args, thresholds, out)
    try:
        return rollout.run()
    except AdminError as error:
        out(f"batchserve rollout: the server refused: {error}")
        return EXIT_REFUSED


class Rollout:
    """One run of ``batchserve rollout``: a new plan, or the one recorded, carried on."""

    def __init__(
        self,
        api: AdminApi,
        args: argparse.Namespace,
        thresholds: Thresholds,
        out: Callable[[str], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._api = api
        self._args = args
        self._thresholds = thresholds
        self._out = out
        self._sleep = sleep
        self._model = str(args.model)
        self._to = str(args.to_version)

    def run(self) -> int:
        serving = self._serving()
        plan = self._recorded()
        if plan is not None and plan.state in ("running", "rolling_back"):
            if plan.to_version != self._to:
                self._out(
                    f"a rollout of {self._model} to {plan.to_version} is under way (step "
                    f"{plan.percent} %); run it again with --to {plan.to_version} to finish it"
                )
                return EXIT_REFUSED
            self._out(f"resuming the rollout of {self._model} to {self._to} ({plan.state})")
            if plan.state == "rolling_back":
                return self._roll_back(plan, plan.decisions[-1])
            if serving == self._to:  # switched before the record said so
                self._record(plan.model_copy(update={"state": "promoted"}))
                self._out(f"promoted: {self._model} serves {self._to}")
                return EXIT_PROMOTED
        else:
            if serving == self._to:
                self._out(f"{self._model} serves {self._to} already")
                return EXIT_PROMOTED
            now = time.time()
            plan = self._record(
                RolloutPlan(
                    model=self._model,
                    from_version=serving,
                    to_version=self._to,
                    steps=self._args.steps,
                    started_at=now,
                    step_started_at=now,
                    thresholds={
                        "min_requests": self._thresholds.min_requests,
                        "max_error_rate": self._thresholds.max_error_rate,
                        "max_p99_ratio": self._thresholds.max_p99_ratio,
                        "min_agreement": self._thresholds.min_agreement,
                        "hold_s": self._thresholds.hold_s,
                    },
                )
            )
        while plan.percent < 100:
            plan = self._record(plan.model_copy(update={"step_started_at": time.time()}))
            decision = self._hold(plan)
            self._out(f"step {plan.percent} %: {decision.verdict}: {decision.reason}")
            entry = _entry(plan.percent, decision)
            if decision.verdict == "rollback":
                plan = self._record(
                    plan.model_copy(
                        update={"state": "rolling_back", "decisions": (*plan.decisions, entry)}
                    )
                )
                return self._roll_back(plan, entry)
            plan = self._record(
                plan.model_copy(
                    update={"step": plan.step + 1, "decisions": (*plan.decisions, entry)}
                )
            )
        return self._promote(plan)

    def _hold(self, plan: RolloutPlan) -> Decision:
        """Apply the step, then read the window until it decides (or times out). An engine
        restarting meanwhile (503) is waited for; one that came back without the shadow (404)
        is given it again, and the window counts from then."""
        model, percent = self._model, plan.percent
        if percent > 0:
            weights = {plan.from_version: 100 - percent, plan.to_version: percent}
            self._api.call("PUT", f"/admin/models/{model}/traffic", {"weights": weights})
        counts = ShadowCounts(self._start_shadow(plan))
        started_s = time.monotonic()
        while True:
            self._sleep(self._args.poll_s)
            held_s = time.monotonic() - started_s
            try:
                counts.read(self._api.call("GET", f"/admin/models/{model}/shadow"))
                window = self._window(plan, counts, held_s)
            except AdminError as error:
                if error.status == 404:
                    counts = ShadowCounts(self._start_shadow(plan))
                elif error.status != 503:
                    raise
                window = Window(held_s=held_s, requests=0, errors=0)
            decision = decide(window, self._thresholds)
            if decision.verdict != "hold":
                return decision
            if held_s > self._args.step_timeout_s:
                return Decision(
                    "rollback",
                    "timeout",
                    f"the window did not fill in {self._args.step_timeout_s:g} s "
                    f"({decision.reason})",
                )

    def _start_shadow(self, plan: RolloutPlan) -> dict[str, Any]:
        body = {"version": plan.to_version, "percent": self._args.shadow_percent}
        report: dict[str, Any] = self._api.call("PUT", f"/admin/models/{self._model}/shadow", body)
        return report

    def _window(self, plan: RolloutPlan, counts: ShadowCounts, held_s: float) -> Window:
        """The step's window: the shadow's counts since the step began, and the traffic
        split's own window of the candidate's requests when it has a share."""
        compared, failed, disagreed = counts.since_start()
        requests, errors = compared + failed, failed
        candidate_p99_s = served_p99_s = None
        if plan.percent > 0:
            traffic = self._api.call("GET", f"/admin/models/{self._model}/traffic")
            candidate = _version_window(traffic, plan.to_version)
            served = _version_window(traffic, plan.from_version)
            requests += candidate.get("requests", 0)
            errors += candidate.get("errors", 0)
            candidate_p99_s = _p99_s(candidate)
            served_p99_s = _p99_s(served)
        return Window(
            held_s=held_s,
            requests=requests,
            errors=errors,
            candidate_p99_s=candidate_p99_s,
            served_p99_s=served_p99_s,
            compared=compared,
            disagreed=disagreed,
        )

    def _roll_back(self, plan: RolloutPlan, decision: RolloutDecision) -> int:
        model = self._model
        if any(percent > 0 for percent in plan.steps[: plan.step + 1]):
            weights = {plan.from_version: 100}
            self._api.call("PUT", f"/admin/models/{model}/traffic", {"weights": weights})
        self._stop_shadow()
        self._record(plan.model_copy(update={"state": "rolled_back"}))
        self._out(
            f"rolled back: {model} serves {plan.from_version}; failed check: "
            f"{decision.check} ({decision.reason})"
        )
        return EXIT_ROLLED_BACK

    def _promote(self, plan: RolloutPlan) -> int:
        self._stop_shadow()
        self._api.call("POST", f"/admin/models/{self._model}/versions/{self._to}/load")
        self._record(plan.model_copy(update={"state": "promoted"}))
        self._out(f"promoted: {self._model} serves {self._to}")
        return EXIT_PROMOTED

    def _stop_shadow(self) -> None:
        try:
            self._api.call("DELETE", f"/admin/models/{self._model}/shadow")
        except AdminError as error:
            if error.status != 404:  # none (any more): nothing to stop
                raise

    def _serving(self) -> str:
        listed = self._api.call("GET", f"/admin/models/{self._model}/versions")
        serving = listed.get("serving")
        if not serving:
            raise AdminError(404, f"{self._model} is not served; load it first")
        return str(serving)

    def _recorded(self) -> RolloutPlan | None:
        try:
            document = self._api.call("GET", f"/admin/models/{self._model}/rollout")
        except AdminError as error:
            if error.status == 404:
                return None
            raise
        return RolloutPlan.model_validate(document)

    def _record(self, plan: RolloutPlan) -> RolloutPlan:
        document = plan.model_dump(mode="json")
        self._api.call("PUT", f"/admin/models/{self._model}/rollout", document)
        return plan


class ShadowCounts:
    """A shadow's counts (summed over engines) since a step began. They only grow, unless an
    engine restarted and lost its own: then the window counts from what was read last."""

    _KEYS = ("compared", "failed", "disagreed")

    def __init__(self, start: dict[str, Any]) -> None:
        self._base = [int(start[key]) for key in self._KEYS]
        self._last = list(self._base)

    def read(self, report: dict[str, Any]) -> None:
        now = [int(report[key]) for key in self._KEYS]
        if now[0] + now[1] < self._last[0] + self._last[1]:
            self._base = [0, 0, 0]  # counted again from zero by a restarted engine
        self._last = now

    def since_start(self) -> tuple[int, int, int]:
        compared, failed, disagreed = (
            now - base for now, base in zip(self._last, self._base, strict=True)
        )
        return compared, failed, disagreed


def _entry(percent: int, decision: Decision) -> RolloutDecision:
    return RolloutDecision(
        percent=percent,
        verdict=decision.verdict,
        check=decision.check,
        reason=decision.reason,
        at=time.time(),
    )


def _version_window(traffic: dict[str, Any], version: str) -> dict[str, Any]:
    """One version's window in ``GET .../traffic``'s answer (empty when it has none)."""
    windows = traffic.get("versions") or traffic.get("windows") or {}
    if isinstance(windows, list):
        return next((each for each in windows if each.get("version") == version), {})
    found = windows.get(version, {})
    return found if isinstance(found, dict) else {}


def _p99_s(window: dict[str, Any]) -> float | None:
    if window.get("p99_s") is not None:
        return float(window["p99_s"])
    if window.get("p99_ms") is not None:
        return float(window["p99_ms"]) / 1000
    return None
