"""The adaptive policy's refill wait: after a batch is answered, how long the next one waits
for the clients that batch answered to come back.

A closed-loop client sends its next request once its answer is written: its front end writes
the answers of the batch, reads and parses the next requests and sends them on. Waiting
``max_wait_ms`` from the answer was enough in one process, where the batcher shares the front
end's event loop; with front ends in their own processes (``--workers 2``, 2 cores shared with
the load generator) the first client came back 10 ms after the answer and the last 15-40 ms,
so the wait ended with half of them back: batches of 26-40 rows of 64
(``docs/bench/engines.md``).

So the wait lasts the turnaround measured: how long the clients of recent batches took to be
all back (``turnaround_s``), at least ``max_wait`` and at most ``REFILL_CAP_FACTOR`` times it;
it ends once every answered client is back (the batch is then as large as the last: ready). A
client is known by its source, the front end it came through: a request from that front end
after the answer counts as one of its clients back. Where not all come back (connections
closed, open-loop traffic), the wait is the turnaround measured, capped.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from service.engine.batch_queue import Entry

#: The refill wait never ends later than this many ``max_wait`` after the answer.
REFILL_CAP_FACTOR = 4.0
#: Weight of the newest turnaround in the running estimate.
TURNAROUND_WEIGHT = 0.25


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
    if not complete and sample_s <= estimate_s:
        return estimate_s
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
