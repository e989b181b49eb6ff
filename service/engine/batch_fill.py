"""Taking one batch out of the queue (and answering what it skipped), and what the next
choice remembers of it: the group of the last batch (round robin), how many batches
high-priority requests have led in a row (anti-starvation), and the rows of the last batch (the
adaptive policy's target). The choice itself is ``batch_selection``'s pure functions; this
applies it to the queue.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable, Hashable

from service.engine.batch_queue import BatchQueue, Entry, Group
from service.engine.batch_selection import (
    Estimate,
    Limits,
    Plan,
    lead_priority,
    pick_group,
    plan_batch,
)
from service.errors import DeadlineExceededError
from service.metrics import DropReason, ModelMetrics
from service.types import Priority


class BatchFiller:
    def __init__(self) -> None:
        self.last_batch_rows = 1
        self.high_streak = 0
        self.last_group: Hashable | None = None

    def take(
        self,
        queue: BatchQueue,
        candidates: list[Group],
        limits: Limits,
        estimate: Estimate,
        now_s: float,
    ) -> Plan:
        """Pop the next batch (and the entries it skipped: caller gone, or too late even
        alone) from the best of ``candidates``, the groups due."""
        normal_waiting = queue.normal_waiting()
        lead = lead_priority(self.high_streak, normal_waiting)
        if lead == "normal":
            candidates = list(queue)
        group = pick_group(candidates, lead, self.last_group)
        order: tuple[Priority, ...] = ("high", "normal") if lead == "high" else ("normal", "high")
        plan = plan_batch(group, order, limits, estimate, now_s, _caller_gone)
        for priority, taken in plan.taken.items():
            if taken:
                queue.pop_heads(group, priority, taken)
        self.last_batch_rows = max(1, sum(map(_rows, plan.batch)))
        self.last_group = group.key
        led_by_high = bool(plan.batch) and plan.batch[0].priority == "high"
        self.high_streak = self.high_streak + 1 if led_by_high and normal_waiting else 0
        return plan


#: Whether an entry's caller has gone (``Entry.abandoned``), read without a call of ours.
_caller_gone: Callable[[Entry], bool] = operator.attrgetter("abandoned")
_rows = operator.attrgetter("rows")


def answer_skipped(
    plan: Plan, metrics: ModelMetrics, estimate: Estimate, request_timeout_s: float
) -> None:
    """Answer what filling a batch skipped, uncomputed: entries whose caller has gone
    (cancelled), and entries that cannot finish by their deadline even alone (504)."""
    for entry in plan.gone:
        metrics.dropped(DropReason.CANCELLED).inc()
        entry.reject(asyncio.CancelledError())
    for entry in plan.late:
        seconds = estimate(entry.group, entry.rows) or 0.0
        metrics.dropped(DropReason.DEADLINE_UNREACHABLE).inc()
        entry.reject(
            DeadlineExceededError(
                f"the request could not be answered within {request_timeout_s * 1e3:.0f}"
                f" ms: its rows would take about {seconds * 1000:.0f} ms"
            )
        )
