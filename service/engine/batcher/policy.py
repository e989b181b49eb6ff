"""Dispatch policies: when a group, once the device is free, is worth running as a batch.

The collector asks its ``DispatchPolicy`` at each look at the queue; the policy sees the
requests arrive and the batches go and come back, and keeps whatever state its decisions
need. ``FixedPolicy`` is here; ``AdaptivePolicy`` in ``adaptive.py``.

- ``fixed``: a group goes when full (rows or token budget), or when its oldest request has
  waited ``max_wait_ms``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from service.engine.batcher.queue import Entry, Group
from service.engine.batcher.selection import Estimate, Limits, is_full

#: Why a batch was taken (``batchserve_batch_dispatches``'s ``reason``).
DispatchReason = Literal["full", "target", "waited", "refill", "drain"]


@dataclass(frozen=True, slots=True)
class Target:
    """What the next batch should be, decided as the device frees."""

    rows: int
    """A group holding this many rows goes at once."""
    cap: int
    """The most rows the batch may hold (at most the row limit)."""
    look_again: bool = False
    """Before a group that is not ready goes, let the requests already received (queued
    ahead of the collector on the event loop) join it."""


class DispatchPolicy(Protocol):
    """When a batch goes, and how large it should be."""

    def target(self, row_limit: int) -> Target:
        """The next batch's target, asked once the device is free (``row_limit``: rows a batch
        may hold now)."""
        ...

    def is_ready(self, group: Group, target: Target, limits: Limits) -> bool:
        """Whether ``group`` goes at once."""
        ...

    def due_at_s(
        self, group: Group, target: Target, alone: bool, limits: Limits, estimate: Estimate
    ) -> float:
        """When ``group``, not ready, goes anyway (``alone``: no other group is ready to run
        instead; ``estimate``: recent forward durations)."""
        ...

    def reason(
        self, ready: list[Group], due: list[Group], limits: Limits, due_at_s: dict[Hashable, float]
    ) -> DispatchReason:
        """Why a batch is taken now from ``ready`` or ``due`` groups (neither: draining)."""
        ...

    def arrived(self, source: Hashable, requests: int, now_s: float) -> None:
        """``requests`` new requests came from the front end ``source``."""
        ...

    def taken(self, batch: Sequence[Entry]) -> None:
        """``batch`` was taken out of the queue to run."""
        ...

    def answered(self, batch: Sequence[Entry], now_s: float) -> None:
        """``batch`` came back from the device and was answered."""
        ...


def waited_reason(
    ready: list[Group],
    due: list[Group],
    limits: Limits,
    due_at_s: dict[Hashable, float],
    max_wait_s: float,
) -> DispatchReason:
    """A group full, or else ready (at a policy's target); else a group due later than its
    oldest's ``max_wait`` (what only a wait for the last batch's clients sets: ``refill``);
    else ``waited``; none due: ``drain``."""
    if ready:
        return "full" if any(is_full(group, limits) for group in ready) else "target"
    if not due:
        return "drain"
    for group in due:
        oldest = group.oldest()
        if oldest is not None and due_at_s[group.key] > oldest.arrival_s + max_wait_s:
            return "refill"
    return "waited"


def waited_at_s(group: Group, max_wait_s: float) -> float:
    """When ``group``'s oldest request has waited ``max_wait_s``."""
    oldest = group.oldest()
    return float("inf") if oldest is None else oldest.arrival_s + max_wait_s


class FixedPolicy:
    """A group goes when full, or when its oldest request has waited ``max_wait_s``."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s

    def target(self, row_limit: int) -> Target:
        return Target(row_limit, row_limit)

    def is_ready(self, group: Group, target: Target, limits: Limits) -> bool:
        return is_full(group, limits)

    def due_at_s(
        self, group: Group, target: Target, alone: bool, limits: Limits, estimate: Estimate
    ) -> float:
        return waited_at_s(group, self.max_wait_s)

    def reason(
        self, ready: list[Group], due: list[Group], limits: Limits, due_at_s: dict[Hashable, float]
    ) -> DispatchReason:
        return waited_reason(ready, due, limits, due_at_s, self.max_wait_s)

    def arrived(self, source: Hashable, requests: int, now_s: float) -> None:
        pass

    def taken(self, batch: Sequence[Entry]) -> None:
        pass

    def answered(self, batch: Sequence[Entry], now_s: float) -> None:
        pass
