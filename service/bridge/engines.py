"""Which engine of each device takes a front end's requests, and when that changes.

With ``standby_engines`` a device has several engine processes: one active, the others warm
standbys that have loaded every model but take no batches. Each front end decides alone, by
one rule that every front end applies alike, so they agree without talking to each other:
of the ready engines of a device, the one the supervisor started first (the lowest
``generation``) is the active one. A standby is started after the engine it stands by for, so
it takes over only once that one is no longer ready (dead, hung, draining), and the new
standby started after a failover never takes the work back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from service.bridge.interface import EngineStatus, Role

logger = logging.getLogger("service.bridge.client")


def active_indices(devices: Sequence[str], statuses: Sequence[EngineStatus]) -> list[int]:
    """The index of each device's active engine, for the devices that have a ready one."""
    best: dict[str, int] = {}
    for index, (device, status) in enumerate(zip(devices, statuses, strict=True)):
        if not status.ready:
            continue
        current = best.get(device)
        if current is None or status.generation < statuses[current].generation:
            best[device] = index
    return list(best.values())


def roles(statuses: Sequence[EngineStatus], active: Sequence[int]) -> list[EngineStatus]:
    """``statuses`` with each engine's role: the active ones, the other ready ones (standbys),
    and no role for an engine that is not ready."""
    chosen = set(active)
    return [
        replace(status, role=_role(index in chosen, status.ready))
        for index, status in enumerate(statuses)
    ]


def _role(active: bool, ready: bool) -> Role | None:
    if active:
        return "active"
    return "standby" if ready else None


def change_targets(statuses: Sequence[EngineStatus]) -> list[int]:
    """The engines an admin change must reach: every one but a standby that failed to load,
    which serves nothing, and reads what to serve from the published record when the
    supervisor starts it again."""
    return [index for index, status in enumerate(statuses) if status.phase != "failed"]


@dataclass
class _Lost:
    since_s: float
    pid: int | None


class Takeovers:
    """Notices a device's active engine stop being ready and what replaces it: a ready
    standby at once (a failover), or later an engine that was not ready yet (a restart).
    ``on_takeover(device, seconds, failover)`` is called once the device has an active engine
    again (this front end's next request goes to it), with the seconds since this front end
    last heard from the lost one (any frame: an answer, or a heartbeat, which comes every
    ``engine_heartbeat_interval_s`` even when it repeats the status): how long the device was
    without an engine, to within one heartbeat interval."""

    def __init__(
        self,
        on_takeover: Callable[[str, float, bool], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_takeover = on_takeover
        self._clock = clock
        self._active: dict[str, tuple[int, int, int | None]] = {}
        """Per device: the index, generation and pid of the active engine last seen."""
        self._lost: dict[str, _Lost] = {}

    def update(
        self,
        devices: Sequence[str],
        statuses: Sequence[EngineStatus],
        active: Sequence[int],
        heard_s: Sequence[float],
    ) -> None:
        """After any status change: ``active`` as ``active_indices`` gives it; ``heard_s``,
        when each engine last sent anything (the clock's time)."""
        now_s = self._clock()
        chosen = {devices[index]: index for index in active}
        for device in dict.fromkeys(devices):
            before = self._active.pop(device, None)
            index = chosen.get(device)
            if before is not None and (index, _generation(statuses, index)) != before[:2]:
                was, generation, pid = before
                if not (statuses[was].ready and statuses[was].generation == generation):
                    self._lost.setdefault(device, _Lost(heard_s[was], pid))
            if index is None:
                continue
            self._active[device] = (index, statuses[index].generation, statuses[index].pid)
            lost = self._lost.pop(device, None)
            if lost is None:
                continue
            seconds = max(0.0, now_s - lost.since_s)
            failover = before is not None  # a standby was ready when the active was lost
            logger.warning(
                "engine_failover" if failover else "engine_takeover",
                extra={
                    "device": device,
                    "from_pid": lost.pid,
                    "to_pid": statuses[index].pid,
                    "takeover_s": round(seconds, 4),
                },
            )
            self._on_takeover(device, seconds, failover)


def _generation(statuses: Sequence[EngineStatus], index: int | None) -> int | None:
    return None if index is None else statuses[index].generation


class ActiveEngines:
    """One front end's choice of engines, kept current as their statuses change."""

    def __init__(
        self,
        devices: Sequence[str],
        on_takeover: Callable[[str, float, bool], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``devices``: each engine's device, in the order of the statuses given later."""
        self.devices = list(devices)
        self.active: list[int] = []
        """The index of each device's active engine."""
        self._takeovers = Takeovers(on_takeover, clock)

    def changed(self, statuses: Sequence[EngineStatus], heard_s: Sequence[float]) -> list[int]:
        """An engine sent a new status, or was lost: the active engines now. ``heard_s``: when
        each engine last sent anything (the clock's time): a repeated status, which is not a
        change, still says the engine was there."""
        self.active = active_indices(self.devices, statuses)
        self._takeovers.update(self.devices, statuses, self.active, heard_s)
        return self.active
