"""Which requests the next batch holds: pure functions of the queue, the limits and ``now``,
and the ``Selector`` that applies them.

Fairness: a group whose oldest request is due (full, as full as the dispatch policy wants, or
waited long enough) competes for the next batch by the age of its oldest request, except the
group of the last batch, which goes after the others (round robin); so a request waits at most
``max_wait_ms``, the batch running, and one batch of each other group due, however full
another group keeps.

Priority: high-priority requests lead a batch, unless they have led
``HIGH_PRIORITY_STREAK_LIMIT`` batches in a row while normal ones waited: then the
longest-waiting normal requests do, so normal traffic is never starved.

Deadlines, the token budget and the time quantum: a batch takes only the requests it can
finish before every deadline in it (the others wait for the next batch), within the row limit,
the token budget and the quantum (``Quantum``: a short request waits for one quantum of a long
group, not for a whole batch of it, before round robin gives its group the device); the first
request of a batch is not asked (a chunk larger than the limits runs alone), but one that
cannot finish by its deadline even alone is answered 504 at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from service.engine.batcher.estimates import size_class
from service.engine.batcher.queue import BatchQueue, Entry, Group
from service.types import Priority

#: After this many batches led by high-priority requests while normal ones wait, the next
#: batch is filled with normal requests first.
HIGH_PRIORITY_STREAK_LIMIT = 3

#: Seconds a batch of ``rows`` rows of a group takes, or None when never measured; as
#: ``estimates.BatchTimes``'s, it depends on ``rows`` through its size class only
#: (``estimates.size_class``): one plan asks each size class once (``_BySizeClass``).
Estimate = Callable[[Hashable, int], "float | None"]


@dataclass(frozen=True, slots=True)
class Quantum:
    """The time quantum (``max_batch_ms``): a batch's expected forward stays under it, so a
    group that keeps the device busy holds it this long at most before round robin gives
    another group its turn. Expected from the fastest duration measured (``batch_seconds``):
    the forward itself, not a load that slows it.

    A batch of at most ``floor_cost`` padded positions (one row of the longest bucket) is
    never cut: a short request waits for a whole longest row anyway (a batch holds at least
    one row), so cutting a shorter bucket's batches below that buys it nothing, and a warm-up
    that a loaded host slowed cannot make such a bucket run one row a batch."""

    max_batch_s: float
    """0: no quantum."""
    batch_seconds: Estimate
    max_chunks: int = 1 << 30
    """Most chunks the quantum splits a request into (a part of the queue's capacity: a
    request split finer would find the queue too full for it)."""
    floor_cost: int = 0
    """Padded positions a batch always may hold (0: no floor, as for fixed shapes)."""

    def allows(self, group: Hashable, rows: int, cost: int = 0) -> bool:
        """Whether a batch of ``rows`` rows of ``group`` costing ``cost`` padded positions
        may run: within the floor, or expected to end within the quantum (unmeasured: yes)."""
        if not self.max_batch_s or 0 < cost <= self.floor_cost:
            return True
        seconds = self.batch_seconds(group, rows)
        return seconds is None or seconds <= self.max_batch_s

    def floor_rows(self, cost_per_row: int) -> int:
        """Rows of ``cost_per_row`` padded positions within the floor (at least one)."""
        return max(1, self.floor_cost // cost_per_row) if cost_per_row > 0 else 1

    def rows(self, group: Hashable, total_rows: int, max_rows: int, cost_per_row: int = 0) -> int:
        """Rows per chunk of a request of ``total_rows`` rows: the most, up to ``max_rows``,
        whose batch the quantum allows, at least the floor's (``cost_per_row``: padded
        positions per row) and enough for ``max_chunks`` chunks (``max_rows`` with no quantum
        or no measurement). A request of many long rows then runs a quantum at a time, and
        other groups' requests go between its chunks."""
        rows = min(total_rows, max_rows)
        if not self.max_batch_s or rows <= 1:
            return max_rows
        fewest = min(rows, max(-(-total_rows // self.max_chunks), self.floor_rows(cost_per_row)))
        for size in range(size_class(rows), 0, -1):
            fitting = min(rows, (1 << size) - 1)  # the most rows of this size class
            seconds = self.batch_seconds(group, fitting)
            if seconds is None:
                return max_rows
            if seconds <= self.max_batch_s:
                return max(fitting, fewest)
        return fewest


NO_QUANTUM = Quantum(0.0, lambda group, rows: None)


@dataclass(frozen=True, slots=True)
class Limits:
    row_limit: int
    max_batch_cost: int
    """Padded tokens per batch (0: no budget)."""
    quantum: Quantum = NO_QUANTUM


def is_full(group: Group, limits: Limits) -> bool:
    return group.rows >= limits.row_limit or (
        limits.max_batch_cost > 0 and group.cost >= limits.max_batch_cost
    )


def lead_priority(high_streak: int, normal_waiting: bool) -> Priority:
    """Who leads the next batch: high, unless it has led too long while normal waited."""
    if high_streak >= HIGH_PRIORITY_STREAK_LIMIT and normal_waiting:
        return "normal"
    return "high"


def pick_group(candidates: list[Group], lead: Priority, last_group: Hashable | None) -> Group:
    """The group the next batch comes from: the one whose oldest request of the ``lead``
    priority came first (or oldest of any priority when none has one), the group of the last
    batch going after the others."""
    others = [group for group in candidates if group.key != last_group] or candidates
    with_lead = [group for group in others if group.head(lead) is not None]
    if with_lead:
        return min(with_lead, key=lambda group: _arrival(group.head(lead)))
    return min(others, key=lambda group: _arrival(group.oldest()))


def _arrival(entry: Entry | None) -> float:
    return math.inf if entry is None else entry.arrival_s


def finishes_late(
    entry: Entry, rows: int, finish_by_s: float, estimate: Estimate, now_s: float
) -> bool:
    """Whether a batch of ``rows`` rows holding ``entry``, started at ``now_s``, is estimated
    to end after ``entry``'s deadline or ``finish_by_s``. Unmeasured: not late."""
    seconds = estimate(entry.group, rows)
    if seconds is None:
        return False
    return now_s + seconds > min(finish_by_s, entry.deadline_s)


def caller_gone(entry: Entry) -> bool:
    """Whether ``entry``'s in-process caller has left (``Entry.abandoned``)."""
    return entry.abandoned


@dataclass(slots=True)
class Plan:
    """How many heads of each priority lane to take, and what becomes of each."""

    batch: list[Entry] = field(default_factory=list)
    gone: list[Entry] = field(default_factory=list)
    """Their caller has left: dropped uncomputed."""
    late: list[Entry] = field(default_factory=list)
    """Cannot finish by their deadline even alone: answered 504 uncomputed."""
    taken: dict[Priority, int] = field(default_factory=dict)
    """Entries popped from the head of each lane (the batch's and the others)."""


def plan_batch(
    group: Group,
    order: Iterable[Priority],
    limits: Limits,
    estimate: Estimate,
    now_s: float,
    gone: Callable[[Entry], bool] = caller_gone,
) -> Plan:
    """Fill one batch from ``group``'s lanes in ``order``, each in arrival order, stopping a
    lane at its first entry that does not fit; skip the entries whose caller is ``gone``.
    Reads the queue; changes nothing.

    An entry fits a batch when the larger batch stays within the row limit, the token budget
    and the time quantum (``Quantum.allows``), and is still estimated to end before every
    deadline in it (``finishes_late``). Each estimate is asked once per size class."""
    plan = Plan()
    batch = plan.batch
    estimate = _BySizeClass(estimate)
    quantum = dataclasses.replace(
        limits.quantum, batch_seconds=_BySizeClass(limits.quantum.batch_seconds)
    )
    row_limit, max_cost = limits.row_limit, limits.max_batch_cost
    rows = cost = 0
    finish_by_s = math.inf  # the earliest deadline in the batch
    for priority in order:
        taken = 0
        for entry in group.lanes[priority]:
            if gone(entry):
                plan.gone.append(entry)
            elif not batch and finishes_late(entry, entry.rows, math.inf, estimate, now_s):
                plan.late.append(entry)
            else:
                grown_rows, grown_cost = rows + entry.rows, cost + entry.cost
                if batch and (
                    grown_rows > row_limit
                    or (max_cost and grown_cost > max_cost)
                    or not quantum.allows(entry.group, grown_rows, grown_cost)
                    or finishes_late(entry, grown_rows, finish_by_s, estimate, now_s)
                ):
                    break
                batch.append(entry)
                rows, cost = grown_rows, grown_cost
                finish_by_s = min(finish_by_s, entry.deadline_s)
            taken += 1
        plan.taken[priority] = taken
    return plan


class _BySizeClass:
    """An ``Estimate`` of one group asked once per size class: a plan's entries are of one
    group, and a batch's rows grow through a few size classes as it fills."""

    __slots__ = ("_estimate", "_known")

    def __init__(self, estimate: Estimate) -> None:
        self._estimate = estimate
        self._known: dict[int, float | None] = {}

    def __call__(self, group: Hashable, rows: int) -> float | None:
        size = size_class(rows)
        if size not in self._known:
            self._known[size] = self._estimate(group, rows)
        return self._known[size]


class Selector:
    """Takes one batch out of the queue (and answers what it skipped), remembering what the
    next choice depends on: the group of the last batch (round robin) and how many batches
    high-priority requests have led in a row (anti-starvation)."""

    def __init__(self) -> None:
        self.high_streak = 0
        self.last_group: Hashable | None = None

    def take(
        self,
        queue: BatchQueue,
        candidates: list[Group],
        limits: Limits,
        estimate: Estimate,
        now_s: float,
    ) -> list[Entry]:
        """Pop the next batch from the best of ``candidates``, the groups due, and answer the
        entries it skipped (caller gone, or too late even alone)."""
        normal_waiting = queue.normal_waiting()
        lead = lead_priority(self.high_streak, normal_waiting)
        if lead == "normal":
            candidates = list(queue)
        group = pick_group(candidates, lead, self.last_group)
        order: tuple[Priority, ...] = ("high", "normal") if lead == "high" else ("normal", "high")
        plan = plan_batch(group, order, limits, estimate, now_s)
        for priority, taken in plan.taken.items():
            if taken:
                queue.pop_heads(group, priority, taken)
        queue.skipped(plan.gone, plan.late, estimate)
        self.last_group = group.key
        led_by_high = bool(plan.batch) and plan.batch[0].priority == "high"
        self.high_streak = self.high_streak + 1 if led_by_high and normal_waiting else 0
        return plan.batch
