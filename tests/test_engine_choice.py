"""Which engine of a device a front end sends requests to, with warm standbys
(``bridge/engines.py``): pure functions of the engines' statuses, tested without processes."""

from __future__ import annotations

import pytest

from service.bridge.engines import (
    ActiveEngines,
    Takeovers,
    active_indices,
    change_targets,
    roles,
)
from service.bridge.interface import EngineStatus, ModelInfo, Phase
from service.config import BUNDLED_MODEL_REPOSITORY
from service.manifest import Manifest

DIGITS = next((BUNDLED_MODEL_REPOSITORY / "digits").glob("*/manifest.json"))
MODEL = ModelInfo(
    manifest=Manifest.model_validate_json(DIGITS.read_text()),
    device="cpu",
    precision="float32",
    compiled=False,
    length_edges=(),
)


def engine(generation: int, phase: Phase = "ready", pid: int | None = None) -> EngineStatus:
    models = (MODEL,) if phase == "ready" else ()
    return EngineStatus(
        phase=phase, models=models, device="cpu", pid=pid or 100 + generation, generation=generation
    )


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_ready_engine_started_first_is_active_on_each_device() -> None:
    devices = ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    statuses = [engine(3), engine(1), engine(2, "loading"), engine(4)]
    assert active_indices(devices, statuses) == [1, 3]


def test_a_standby_takes_over_only_once_the_active_engine_is_not_ready() -> None:
    devices = ["cpu", "cpu"]
    assert active_indices(devices, [engine(0), engine(1)]) == [0]
    for phase in ("down", "stalled", "draining", "failed", "connecting"):
        assert active_indices(devices, [engine(0, phase), engine(1)]) == [1]
    # The replacement started after the failover is younger: it stands by, never takes back.
    assert active_indices(devices, [engine(2), engine(1)]) == [1]
    assert active_indices(devices, [engine(0, "down"), engine(1, "down")]) == []


def test_roles_name_the_active_engine_and_the_ready_standbys() -> None:
    statuses = [engine(0), engine(1), engine(2, "failed")]
    named = roles(statuses, active_indices(["cpu"] * 3, statuses))
    assert [status.role for status in named] == ["active", "standby", None]


def test_an_admin_change_skips_only_a_standby_that_failed_to_load() -> None:
    statuses = [engine(0), engine(1, "failed"), engine(2, "loading"), engine(3, "down")]
    assert change_targets(statuses) == [0, 2, 3]


def test_a_failover_is_timed_from_when_the_lost_engine_was_last_heard_from() -> None:
    """Its status last changed long before (when it became ready); its heartbeats, repeating
    that status, said it was there until just before it was lost."""
    taken: list[tuple[str, float, bool]] = []
    clock = Clock()
    choice = ActiveEngines(["cpu", "cpu"], lambda *call: taken.append(call), clock)
    statuses = [engine(0), engine(1)]
    assert choice.changed(statuses, [0.0, 0.0]) == [0]
    clock.now_s = 41.2
    statuses[0] = engine(0, "down")
    assert choice.changed(statuses, [41.0, 41.1]) == [1]
    assert taken == [("cpu", pytest.approx(0.2), True)]


def test_a_restart_without_a_standby_is_a_takeover_not_a_failover() -> None:
    taken: list[tuple[str, float, bool]] = []
    clock = Clock()
    takeovers = Takeovers(lambda *call: taken.append(call), clock)
    devices = ["cpu"]
    takeovers.update(devices, [engine(0)], [0], [0.0])
    clock.now_s = 0.5
    takeovers.update(devices, [engine(0, "down")], [], [0.4])
    assert taken == []
    clock.now_s = 9.0
    takeovers.update(devices, [engine(1)], [0], [9.0])
    assert taken == [("cpu", pytest.approx(8.6), False)]  # since its last status, at 0.4 s


def test_a_better_engine_becoming_ready_is_no_failover() -> None:
    """At start-up the standby may be ready first; the engine started first then becomes
    active without anything having been lost."""
    taken: list[tuple[str, float, bool]] = []
    takeovers = Takeovers(lambda *call: taken.append(call), Clock())
    devices = ["cpu", "cpu"]
    takeovers.update(devices, [engine(0, "loading"), engine(1)], [1], [0.0, 0.0])
    takeovers.update(devices, [engine(0), engine(1)], [0], [0.0, 0.0])
    assert taken == []
