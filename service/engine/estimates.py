"""How long a batch will take: recent forward durations by group and size.

The batcher uses the estimate three ways: not to start rows that cannot finish before their
deadline (they are answered 504 at once instead of being computed for nobody), to refuse at
admission what the queue cannot serve in time (429 with a ``Retry-After`` from the estimated
wait), and to run batches known to be quick on the event loop's own thread.

Durations are kept per group (shape or length bucket) and per size class (rows rounded up to
a power of two). The estimate is the lower median of the last few durations younger than
``FORGET_AFTER_S``: one slow batch (a pause, a neighbour's burst) does not move it, and since
refusals stop new measurements, an estimate that has gone stale is dropped rather than kept
refusing. A size not measured lately is estimated from the nearest one of its group, scaled
by rows when larger (forwards rarely grow slower than their rows, so this errs long); a group
with no recent measurement has no estimate, and nothing is refused on its account.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable

#: Durations kept per group and size class.
SAMPLES = 5
#: Older durations no longer count.
FORGET_AFTER_S = 30.0


def size_class(rows: int) -> int:
    """1 for one row, 2 for 2-3 rows, 3 for 4-7 rows...: each class doubles the rows."""
    return max(1, rows).bit_length()


class BatchTimes:
    """Recent forward durations, in seconds, by group and size class."""

    def __init__(self) -> None:
        self._samples: dict[Hashable, dict[int, deque[tuple[float, float]]]] = {}

    def record(self, group: Hashable, rows: int, seconds: float) -> None:
        by_size = self._samples.setdefault(group, {})
        samples = by_size.setdefault(size_class(rows), deque(maxlen=SAMPLES))
        samples.append((time.monotonic(), seconds))

    def estimate(self, group: Hashable, rows: int) -> float | None:
        """Seconds a batch of ``rows`` rows of ``group`` should take; None if unknown."""
        by_size = self._samples.get(group)
        if not by_size:
            return None
        fresh_after_s = time.monotonic() - FORGET_AFTER_S
        typical: dict[int, float] = {}
        for size, samples in by_size.items():
            recent = sorted(seconds for at_s, seconds in samples if at_s >= fresh_after_s)
            if recent:
                typical[size] = recent[(len(recent) - 1) // 2]
        if not typical:
            return None
        size = size_class(rows)
        if size in typical:
            return typical[size]
        nearest = min(typical, key=lambda measured: (abs(measured - size), -measured))
        seconds = typical[nearest]
        return seconds * 2 ** (size - nearest) if size > nearest else seconds
