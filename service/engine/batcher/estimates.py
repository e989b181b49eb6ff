"""How long a batch will take: recent forward durations by group and size.

The batcher uses the estimate two ways: to give a batch only the requests it can finish
before their deadlines (one that cannot finish even alone is answered 504 at once instead of
being computed for nobody), and to refuse at admission what the queue cannot serve in time
(429 with a ``Retry-After`` from the estimated wait).

Durations are kept per group (shape or length bucket) and per size class (rows rounded up to
a power of two). The estimate is the lower median of the durations of the last
``FRESH_FOR_S``: one slow batch (a pause, a neighbour's burst) does not move it, and the
durations of an overload (a forward slowed by a refusal storm taking its CPU) are gone a few
seconds after it ends rather than outvoting the first quick ones after it. Since refusals
stop new measurements, a size with no duration that recent has no estimate: nothing is
refused on its account, so the next request of it is admitted and measured.

A size not measured lately is estimated from the nearest one of its group, scaled by rows when
larger (forwards rarely grow slower than their rows, so this errs long); a group with no
recent measurement has no estimate.

``fastest`` is the quickest a size was ever measured, or less where another size says so (a
batch takes no longer than the fastest larger one, nor than a smaller one's scaled by rows):
what the forward itself needs, whatever the load. A size measured only while the host was
loaded (a warm-up beside other work) is then bounded by its neighbours' quicker measurements,
so one slow measurement cannot keep a size looking slow while nothing runs it again.
Admission answers 422 ``deadline_unreachable`` only when even that exceeds the time left; a
request the recent durations alone make late is refused for load (429 with ``Retry-After``);
the time quantum (``selection.Quantum``) reads it too.

The batcher asks for an estimate on every request and every entry of a batch it plans, so each
is a lookup: the median is taken when a duration is recorded (once per batch), and each
group's estimates of every size class are tabled when first asked after a change (a record
of a size not fresh, or a measurement going stale: the table says until when it holds), not
at each read. A record of a size already fresh updates in place the entries read from it.
"""

from __future__ import annotations

import math
import operator
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

#: Durations kept per group and size class.
SAMPLES = 5
#: Only durations this recent count; a size whose newest is older has no estimate.
FRESH_FOR_S = 3.0
#: Size classes ``fastest`` keeps a table of (up to 65,535 rows); beyond, it doubles per class.
TABLE_SIZES = 16


def size_class(rows: int) -> int:
    """1 for one row, 2 for 2-3 rows, 3 for 4-7 rows...: each class doubles the rows."""
    return rows.bit_length() if rows > 1 else 1


#: A sample's seconds, read in C.
_seconds = operator.itemgetter(1)

#: A size class of a table not asked yet.
_UNKNOWN = -1.0
_ALL_UNKNOWN = [_UNKNOWN] * (TABLE_SIZES + 1)


@dataclass(frozen=True, slots=True)
class _Table:
    """A group's estimates by size class (index 0 unused), each computed when first asked,
    unchanged until ``until_s`` unless a duration is recorded (a batch is planned with a few
    sizes between two records)."""

    until_s: float
    seconds: list[float | None]
    sources: list[int]
    """By size class, the size class measured that its estimate was read from (0: none
    yet), so a record of that class updates the estimate in place."""


#: The table of every group never measured (none is stored for it): no estimate of any size.
_UNMEASURED = _Table(math.inf, [None] * (TABLE_SIZES + 1), [0] * (TABLE_SIZES + 1))


@dataclass
class _Durations:
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    """(measured at, seconds), oldest first."""
    typical_s: float = 0.0
    newest_at_s: float = 0.0
    fastest_s: float = math.inf


class BatchTimes:
    """Recent forward durations, in seconds, by group and size class."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        """``now``: the batcher's clock (``clock.py``)."""
        self._now = now
        self._durations: dict[Hashable, dict[int, _Durations]] = {}
        self._fastest: dict[Hashable, list[float]] = {}
        """By group, ``fastest`` by size class (index 0 unused), computed when it changes."""
        self._tables: dict[Hashable, _Table] = {}
        """By group, ``estimate`` of every size class of the table, while it holds."""

    def record(self, group: Hashable, rows: int, seconds: float) -> None:
        by_size = self._durations.setdefault(group, {})
        size = size_class(rows)
        durations = by_size.get(size)
        if durations is None:  # not ``setdefault``: it would build one a record
            durations = by_size[size] = _Durations()
        now_s = self._now()
        # The group's table stays when this size was fresh already (then updated below);
        # one that has expired meanwhile is rebuilt at the next read anyway.
        table = self._tables.get(group)
        kept = table is not None and durations.newest_at_s >= now_s - FRESH_FOR_S
        if table is not None and not kept:
            del self._tables[group]
        samples = durations.samples
        while samples and samples[0][0] < now_s - FRESH_FOR_S:
            samples.popleft()
        samples.append((now_s, seconds))
        ordered = sorted(map(_seconds, samples))
        typical_s = durations.typical_s = ordered[(len(ordered) - 1) // 2]
        durations.newest_at_s = now_s
        if kept and table is not None:
            # A size already fresh: the sizes fresh stay the same, and none goes stale before
            # the table's ``until_s``, so each estimate still comes from the same size. Those
            # read from this one are updated as ``_scaled`` would compute them.
            for at, source in enumerate(table.sources):
                if source == size:
                    table.seconds[at] = typical_s * 2 ** (at - size) if at > size else typical_s
        if seconds < durations.fastest_s:
            durations.fastest_s = seconds
            fastest = {size: known.fastest_s for size, known in by_size.items()}
            self._fastest[group] = [math.inf] + [
                bounded_fastest(fastest, size) for size in range(1, TABLE_SIZES + 1)
            ]

    def estimate(self, group: Hashable, rows: int) -> float | None:
        """Seconds a batch of ``rows`` rows of ``group`` should take now; None if unknown."""
        now_s = self._now()
        table = self._tables.get(group)
        if table is None or now_s > table.until_s:
            table = self._table(group, now_s)
        size = size_class(rows)
        if size > TABLE_SIZES:
            return self._computed(group, size, now_s)
        seconds = table.seconds[size]
        if seconds is _UNKNOWN:  # first asked since the table was made
            seconds = self._tabled(table, group, size, now_s)
        return seconds

    def _table(self, group: Hashable, now_s: float) -> _Table:
        """``group``'s estimates now, and until when they hold: until its first fresh
        measurement goes stale (a record drops the table). Kept for measured groups only."""
        if group not in self._durations:
            return _UNMEASURED
        fresh = [
            known.newest_at_s
            for known in self._durations.get(group, {}).values()
            if known.newest_at_s >= now_s - FRESH_FOR_S
        ]
        until_s = min(fresh) + FRESH_FOR_S if fresh else math.inf
        table = self._tables[group] = _Table(until_s, list(_ALL_UNKNOWN), [0] * (TABLE_SIZES + 1))
        return table

    def _tabled(self, table: _Table, group: Hashable, size: int, now_s: float) -> float | None:
        """The estimate of size class ``size``, computed and kept in ``table`` with the size
        class it comes from."""
        seconds, table.sources[size] = self._computed_from(group, size, now_s)
        table.seconds[size] = seconds
        return seconds

    def _computed(self, group: Hashable, size: int, now_s: float) -> float | None:
        """The estimate of size class ``size`` at ``now_s``, from the durations."""
        return self._computed_from(group, size, now_s)[0]

    def _computed_from(self, group: Hashable, size: int, now_s: float) -> tuple[float | None, int]:
        """The estimate of size class ``size`` at ``now_s``, and the size class measured it
        comes from (0: none)."""
        by_size = self._durations.get(group)
        if not by_size:
            return None, 0
        fresh_since_s = now_s - FRESH_FOR_S
        durations = by_size.get(size)
        if durations is not None and durations.newest_at_s >= fresh_since_s:
            return durations.typical_s, size
        recent = {
            measured: known.typical_s
            for measured, known in by_size.items()
            if known.newest_at_s >= fresh_since_s
        }
        return _scaled(recent, size)

    def fastest(self, group: Hashable, rows: int) -> float | None:
        """The quickest a batch of ``rows`` rows of ``group`` can be, by every size measured
        (``bounded_fastest``); None if the group never was."""
        by_size = self._fastest.get(group)
        if by_size is None:
            return None
        size = size_class(rows)
        if size < len(by_size):
            return by_size[size]
        return by_size[-1] * float(2 ** (size - len(by_size) + 1))  # beyond the table: doubled


def bounded_fastest(fastest: dict[int, float], size: int) -> float:
    """The quickest a batch of size class ``size`` can be, by the quickest measured of each
    class in ``fastest``: no longer than any larger class's, nor than a smaller class's
    doubled for each class above it."""
    return min(
        seconds * 2 ** (size - measured) if measured < size else seconds
        for measured, seconds in fastest.items()
    )


def _scaled(by_size: dict[int, float], size: int) -> tuple[float | None, int]:
    """The duration of ``size`` from those known: its own, else the nearest size's, doubled
    for each class above it; and the size it comes from (0: none)."""
    if not by_size:
        return None, 0
    seconds = by_size.get(size)
    if seconds is not None:
        return seconds, size
    nearest = min(by_size, key=lambda measured: (abs(measured - size), -measured))
    seconds = by_size[nearest]
    return (seconds * 2 ** (size - nearest) if size > nearest else seconds), nearest
