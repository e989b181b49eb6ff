"""How long a batch will take: recent forward durations by group and size.

The batcher uses the estimate two ways: to give a batch only the requests it can finish
before their deadlines (one that cannot finish even alone is answered 504 at once instead of
being computed for nobody), and to refuse at admission what the queue cannot serve in time
(429 with a ``Retry-After`` from the estimated wait).

Durations are kept per group (shape or length bucket) and per size class (rows rounded up to
a power of two). The estimate is the lower median of the last few durations: one slow batch
(a pause, a neighbour's burst) does not move it. Since refusals stop new measurements, a size
whose newest duration is older than ``FORGET_AFTER_S`` is forgotten rather than kept refusing.
A size not measured lately is estimated from the nearest one of its group, scaled by rows when
larger (forwards rarely grow slower than their rows, so this errs long); a group with no
recent measurement has no estimate, and nothing is refused on its account.

The batcher asks for an estimate on every request, so each is a lookup: the median is taken
when a duration is recorded (once per batch), not when it is read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

#: Durations kept per group and size class.
SAMPLES = 5
#: A size whose newest duration is older than this no longer counts.
FORGET_AFTER_S = 30.0


def size_class(rows: int) -> int:
    """1 for one row, 2 for 2-3 rows, 3 for 4-7 rows...: each class doubles the rows."""
    return max(1, rows).bit_length()


@dataclass
class _Durations:
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    typical_s: float = 0.0
    newest_at_s: float = 0.0


class BatchTimes:
    """Recent forward durations, in seconds, by group and size class."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        """``now``: the batcher's clock (``batch_clock``)."""
        self._now = now
        self._durations: dict[Hashable, dict[int, _Durations]] = {}

    def record(self, group: Hashable, rows: int, seconds: float) -> None:
        by_size = self._durations.setdefault(group, {})
        durations = by_size.setdefault(size_class(rows), _Durations())
        durations.samples.append(seconds)
        ordered = sorted(durations.samples)
        durations.typical_s = ordered[(len(ordered) - 1) // 2]
        durations.newest_at_s = self._now()

    def estimate(self, group: Hashable, rows: int) -> float | None:
        """Seconds a batch of ``rows`` rows of ``group`` should take; None if unknown."""
        by_size = self._durations.get(group)
        if not by_size:
            return None
        forgotten_before_s = self._now() - FORGET_AFTER_S
        size = size_class(rows)
        durations = by_size.get(size)
        if durations is not None and durations.newest_at_s >= forgotten_before_s:
            return durations.typical_s
        recent = {
            measured: known.typical_s
            for measured, known in by_size.items()
            if known.newest_at_s >= forgotten_before_s
        }
        if not recent:
            return None
        nearest = min(recent, key=lambda measured: (abs(measured - size), -measured))
        seconds = recent[nearest]
        return seconds * 2 ** (size - nearest) if size > nearest else seconds
