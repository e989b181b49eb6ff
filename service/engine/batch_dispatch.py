"""Dispatch policies: when a group, once the device is free, is worth running as a batch.

- ``fixed``: when full (rows or token budget), or when its oldest request has waited
  ``max_wait_ms``.
- ``adaptive``: as soon as it holds as many rows as the last batch had, or as the front ends
  hold requests (bodies read, not yet answered: ``expected``), never more than the row limit;
  otherwise as ``fixed``, except that right after a batch is answered it also waits
  (``batch_refill``) for the clients that batch answered to come back: at 64 closed-loop
  clients the oldest request has usually waited ``max_wait_ms`` while the device ran, and
  dispatching at once cut the batch at the 40 clients back so far (batches of 40 and 63,
  alternately). A lone client never waits for batch-mates that are not coming (the last batch
  had one row), nor for uploads still arriving. With several device instances, the requests
  the front ends hold are split into a batch an instance, so that all of them run at once.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

from service.config import BatchPolicy
from service.engine.batch_queue import Group
from service.engine.batch_selection import Limits, is_full

#: Why a batch was taken (``batchserve_batch_dispatches``'s ``reason``).
DispatchReason = Literal["full", "target", "waited", "refill", "drain"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    policy: BatchPolicy
    max_wait_s: float
    adaptive: bool = field(init=False)
    """``policy == "adaptive"``, kept: it is read several times a batch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "adaptive", self.policy == "adaptive")

    def target_rows(self, last_batch_rows: int, expected: int, row_limit: int) -> int:
        """Rows a batch should have before it is dispatched without waiting (one instance;
        several: ``split_rows``)."""
        if not self.adaptive:
            return row_limit
        return max(1, min(row_limit, max(last_batch_rows, expected)))

    def split_rows(self, expected: int, row_limit: int, instances: int) -> int:
        """With several ``instances``, the rows of a batch an instance for the ``expected``
        requests the front ends hold (adaptive: the batcher passes 0 otherwise): the target,
        and also the cap, of a batch, so that all instances run at once where one batch of
        every request would leave the others idle while its clients turn around; 0 where no
        split applies (one instance, or no word from the front ends)."""
        if instances < 2 or expected < 1:
            return 0
        return max(1, min(row_limit, -(-expected // instances)))

    def is_ready(self, group: Group, target_rows: int, limits: Limits) -> bool:
        """Full, or (adaptive) holding as many rows as the batch should have."""
        return is_full(group, limits) or (self.adaptive and group.rows >= target_rows)

    def due_at_s(
        self, group: Group, refill_until_s: float, refill: bool, run_s: float = 0.0
    ) -> float:
        """When ``group``, not ready, becomes due anyway: its oldest request has waited
        ``max_wait_s``, and (adaptive, ``refill``: no other group is ready to run instead) the
        wait for the last batch's clients is over at ``refill_until_s``; that wait never
        starts a batch of ``run_s`` seconds too late for the deadline of a head of ``group``."""
        oldest = group.oldest()
        if oldest is None:
            return float("inf")
        due_s = oldest.arrival_s + self.max_wait_s
        if refill and self.adaptive and refill_until_s > due_s:
            heads = [lane[0].deadline_s for lane in group.lanes.values() if lane]
            due_s = max(due_s, min(refill_until_s, min(heads) - run_s))
        return due_s

    def reason(
        self, ready: list[Group], due: list[Group], limits: Limits, due_at_s: dict[Hashable, float]
    ) -> DispatchReason:
        """Why a batch is taken now from ``ready`` or ``due`` groups (neither: draining): a
        group full, or at the adaptive target; else a group due (``due_at_s``, by group key)
        later than its oldest's ``max_wait``, which only the wait for the last batch's
        clients sets (``refill``); else ``waited``."""
        if ready:
            return "full" if any(is_full(group, limits) for group in ready) else "target"
        if not due:
            return "drain"
        for group in due:
            oldest = group.oldest()
            if oldest is not None and due_at_s[group.key] > oldest.arrival_s + self.max_wait_s:
                return "refill"
        return "waited"
