"""The adaptive dispatch policy: a batch goes as soon as it is as large as the load says.

A group goes at once when it holds as many rows as the last batch had, or as the front ends
hold requests (bodies read, not yet answered: ``expected``), never more than the row limit;
otherwise as under ``fixed`` (full, or its oldest has waited ``max_wait_ms``), except that
right after a batch is answered it also waits for the clients that batch answered to come
back (the refill wait, below). A lone client never waits for batch-mates that are not coming
(the last batch had one row), nor for uploads still arriving. With several device instances,
the requests the front ends hold are split into a batch an instance, so that all of them run
at once where one batch of every request would leave the others idle while its clients turn
around.

The refill wait. A closed-loop client sends its next request once its answer is written: its
front end writes the answers of the batch, reads and parses the next requests and sends them
on. With 64 such clients the oldest request has usually waited ``max_wait_ms`` while the
device ran, and dispatching it at once cut the batch at the clients back so far; with front
ends in their own processes the clients came back over a few tens of milliseconds. So the wait
lasts the turnaround measured (``Returns.turnaround_s``: how long the clients of recent batches
took to be all back), at least ``max_wait`` and at most ``REFILL_CAP_FACTOR`` times it; it
ends once every answered client is back (the group is then as large as the last batch:
ready). A client is known by its source, the front end it came through: a request from that
front end after the answer counts as one of its clients back. The wait applies only when no
other group is ready to run instead, never makes the head of a group late for its deadline,
and is skipped where the time quantum would not let the batch grow by a row anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from service.engine.batcher.policy import DispatchReason, Target, waited_at_s, waited_reason
from service.engine.batcher.queue import Entry, Group
from service.engine.batcher.selection import Estimate, Limits, is_full

#: The refill wait never ends later than this many ``max_wait`` after the answer.
REFILL_CAP_FACTOR = 4.0
#: Weight of the newest turnaround in the running estimate.
TURNAROUND_WEIGHT = 0.25


def target_rows(last_batch_rows: int, expected: int, row_limit: int) -> int:
    """Rows at which a batch goes at once: the last batch's or the requests the front ends
    hold, whichever is more, within the row limit."""
    return max(1, min(row_limit, max(last_batch_rows, expected)))


def split_rows(expected: int, row_limit: int, instances: int) -> int:
    """With several ``instances``, the rows of a batch an instance for the ``expected``
    requests the front ends hold: the target, and also the cap, of a batch; 0 where no split
    applies (one instance, or no word from the front ends)."""
    if instances < 2 or expected < 1:
        return 0
    return min(row_limit, -(-expected // instances))


def refill_until_s(
    answered_s: float, outstanding: int, turnaround_s: float, max_wait_s: float
) -> float:
    """When the wait for the clients answered at ``answered_s`` ends: ``max_wait_s`` after it,
    or, while ``outstanding`` of them are still to come back, their ``turnaround_s`` after it,
    within ``REFILL_CAP_FACTOR * max_wait_s``."""
    wait_s = max_wait_s
    if outstanding > 0:
        wait_s = min(max(wait_s, turnaround_s), REFILL_CAP_FACTOR * max_wait_s)
    return answered_s + wait_s


def next_turnaround_s(estimate_s: float, sample_s: float, complete: bool) -> float:
    """The estimate after one batch's clients were all back ``sample_s`` after its answer
    (``complete``), or were not all back yet ``sample_s`` after it, when the next batch was
    answered: only a lower bound, which raises the estimate but never lowers it. The first
    measurement is the estimate."""
    if not complete:  # a lower bound: it may raise the estimate, never lower it
        sample_s = max(sample_s, estimate_s)
    if estimate_s <= 0.0:
        return sample_s
    return estimate_s + TURNAROUND_WEIGHT * (sample_s - estimate_s)


class Returns:
    """Which clients the last batch answered, by source, how many have come back since, and
    how long the clients of a batch take to be all back."""

    __slots__ = ("_owed", "answered_s", "outstanding", "turnaround_s")

    def __init__(self) -> None:
        self._owed: dict[Hashable, int] = {}
        self.answered_s = -float("inf")
        """When the last batch was answered."""
        self.outstanding = 0
        """Its requests whose client has not come back yet."""
        self.turnaround_s = 0.0
        """How long after its answer a batch's clients were all back, lately (estimate)."""

    def answered(self, batch: Iterable[Entry], now_s: float) -> None:
        if self.outstanding > 0:  # the last batch's clients not all back: a lower bound
            self._measured(now_s, complete=False)
        owed: dict[Hashable, int] = {}
        for entry in batch:
            owed[entry.source] = owed.get(entry.source, 0) + 1
        self._owed = owed
        self.outstanding = sum(owed.values())
        self.answered_s = now_s

    def arrived(self, source: Hashable, requests: int, now_s: float) -> None:
        """``requests`` new requests came from ``source``: as many of its clients are back."""
        owed = self._owed.get(source)
        if owed:
            back = min(owed, requests)
            self._owed[source] = owed - back
            self.outstanding -= back
            if self.outstanding == 0:
                self._measured(now_s, complete=True)

    def until_s(self, max_wait_s: float) -> float:
        """When the refill wait ends now (``refill_until_s``)."""
        return refill_until_s(self.answered_s, self.outstanding, self.turnaround_s, max_wait_s)

    def _measured(self, now_s: float, complete: bool) -> None:
        sample_s = now_s - self.answered_s
        self.turnaround_s = next_turnaround_s(self.turnaround_s, sample_s, complete)


class AdaptivePolicy:
    """Batches as large as the last one or the load the front ends report, at once."""

    def __init__(
        self,
        max_wait_s: float,
        expected_requests: Callable[[], int] = lambda: 0,
        instances: int = 1,
    ) -> None:
        """``expected_requests``: how many requests the front ends hold now; ``instances``:
        batches that may run at once."""
        self.max_wait_s = max_wait_s
        self._expected_requests = expected_requests
        self._instances = instances
        self.last_batch_rows = 1
        self.returns = Returns()

    def target(self, row_limit: int) -> Target:
        expected = self._expected_requests()
        split = split_rows(expected, row_limit, self._instances)
        rows = split or target_rows(self.last_batch_rows, expected, row_limit)
        return Target(rows, split or row_limit, look_again=True)

    def is_ready(self, group: Group, target: Target, limits: Limits) -> bool:
        return group.rows >= target.rows or is_full(group, limits)

    def due_at_s(
        self, group: Group, target: Target, alone: bool, limits: Limits, estimate: Estimate
    ) -> float:
        """Its oldest has waited ``max_wait``, or (``alone``) the refill wait is over, but never
        so late that a batch of the target's rows would end past a head's deadline."""
        due_s = waited_at_s(group, self.max_wait_s)
        grown_cost = group.cost + group.cost // group.rows
        if not alone or not limits.quantum.allows(group.key, group.rows + 1, grown_cost):
            return due_s
        run_s = estimate(group.key, target.rows) or 0.0
        earliest_deadline_s = min(lane[0].deadline_s for lane in group.lanes.values() if lane)
        until_s = self.returns.until_s(self.max_wait_s)
        return max(due_s, min(until_s, earliest_deadline_s - run_s))

    def reason(
        self, ready: list[Group], due: list[Group], limits: Limits, due_at_s: dict[Hashable, float]
    ) -> DispatchReason:
        return waited_reason(ready, due, limits, due_at_s, self.max_wait_s)

    def arrived(self, source: Hashable, requests: int, now_s: float) -> None:
        self.returns.arrived(source, requests, now_s)

    def taken(self, batch: Sequence[Entry]) -> None:
        self.last_batch_rows = max(1, sum(entry.rows for entry in batch))

    def answered(self, batch: Sequence[Entry], now_s: float) -> None:
        self.returns.answered(batch, now_s)
