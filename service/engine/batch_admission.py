"""Admission: what a request is split into, and what is refused at once (pure functions).

From recent forward durations (``estimates.BatchTimes``) a request that cannot be served in
time is refused before it is queued: 422 when it alone needs longer than its deadline even at
its fastest, 429 with ``Retry-After`` when the work queued ahead of it, or a device slowed by
load, would make it late. Groups not measured lately are never refused on an estimate. Under
overload the device thus keeps computing answers someone gets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol, TypeVar

from service.engine.batch_queue import Group
from service.engine.batch_run import Rows
from service.engine.batch_selection import Estimate
from service.errors import DeadlineUnreachableError, OverloadedError, ServiceError
from service.types import Priority

RowsT = TypeVar("RowsT", bound=Rows)


class Durations(Protocol):
    """Forward durations by group and rows (``estimates.BatchTimes``)."""

    def estimate(self, group: Hashable, rows: int) -> float | None:
        """Recent: how long such a batch takes now."""

    def fastest(self, group: Hashable, rows: int) -> float | None:
        """The quickest it was ever measured: the forward itself."""


def chunk_rows(max_batch_size: int, max_batch_cost: int, cost_per_row: int) -> int:
    """Rows per chunk of a request: what fits in one batch by rows and token budget (at
    least one row whatever its cost)."""
    rows = max_batch_size
    if max_batch_cost and cost_per_row:
        rows = max(1, min(rows, max_batch_cost // cost_per_row))
    return rows


def chunks_of(
    payload: RowsT, total_rows: int, max_batch_size: int, max_batch_cost: int, cost_per_row: int
) -> list[RowsT]:
    """``payload`` (of ``total_rows`` rows) in chunks of ``chunk_rows`` rows (itself when it
    fits in one)."""
    rows = chunk_rows(max_batch_size, max_batch_cost, cost_per_row)
    if rows >= total_rows:
        return [payload]
    return [payload[start : start + rows] for start in range(0, total_rows, rows)]


def estimated_wait_s(
    groups: Iterable[Group],
    priority: Priority,
    running_left_s: float,
    row_limit: int,
    max_batch_cost: int,
    estimate: Estimate,
) -> float:
    """How long a request queued now would wait for the device: what is left of the running
    batch, then the queued batches it would not go before (all of them for a normal request;
    the high-priority ones for a high one). Unmeasured groups count 0."""
    wait_s = max(0.0, running_left_s)
    for group in groups:
        rows = group.high_rows if priority == "high" else group.rows
        if rows == 0:
            continue
        per_batch = row_limit
        if max_batch_cost and group.cost:
            per_batch = max(1, min(per_batch, max_batch_cost * group.rows // group.cost))
        full_batches, rest = divmod(rows, per_batch)
        for count, batch_rows in ((full_batches, per_batch), (1 if rest else 0, rest)):
            if count:
                wait_s += count * (estimate(group.key, batch_rows) or 0.0)
    return wait_s


def refusal_of_any(ahead_s: float, left_s: float) -> ServiceError | None:
    """Why any request queued now would be late whatever its rows, before they are known: the
    work queued ahead of it (``ahead_s``, ``estimated_wait_s``) alone outlasts the ``left_s``
    before its deadline (429 with ``Retry-After``). Unlike ``refusal`` it does not wait for
    the request's own group to be measured: the work ahead is what was measured."""
    if ahead_s <= left_s:
        return None
    return OverloadedError(
        f"the queue holds about {ahead_s * 1000:.0f} ms of work, more than the "
        f"{left_s * 1000:.0f} ms left before the request's deadline; retry shortly",
        retry_after_s=max(1, math.ceil(ahead_s)),
    )


def refusal(
    chunks: list[int],
    group: Hashable,
    left_s: float,
    times: Durations,
    wait_s: Callable[[Priority], float],
    priority: Priority,
) -> ServiceError | None:
    """Why a request of ``chunks`` rows each cannot be answered within ``left_s``, from its
    chunks' recent durations (``times.estimate``) and the ``wait_s`` of the work ahead of it
    at ``priority``; None when it can (or when a chunk has no recent estimate: admitted, it is
    measured).

    422 only when the chunks need longer than ``left_s`` even at the fastest they were ever
    measured (``times.fastest``): the forward itself is too long, the client must send less.
    When only the recent durations make it late (a loaded device), or the queue ahead does,
    429 with ``Retry-After``."""
    if len(chunks) == 1:  # the common case, without a comprehension a request
        known_s = times.estimate(group, chunks[0])
        if known_s is None:
            return None
        own_s = known_s
        quickest_s = times.fastest(group, chunks[0]) or 0.0
    else:
        own = [times.estimate(group, rows) for rows in chunks]
        if any(seconds is None for seconds in own):
            return None
        own_s = sum(seconds for seconds in own if seconds is not None)
        quickest_s = sum(times.fastest(group, rows) or 0.0 for rows in chunks)
    needed_s = min(own_s, quickest_s)
    if needed_s > left_s:
        return DeadlineUnreachableError(
            f"these {sum(chunks)} instances need about {needed_s * 1000:.0f} ms of "
            f"compute, more than the {left_s * 1000:.0f} ms left before the request's "
            "deadline; send fewer instances per request"
        )
    ahead_s = wait_s(priority)
    if ahead_s + own_s > left_s:
        return OverloadedError(
            f"the queue holds about {ahead_s * 1000:.0f} ms of work, and this request "
            f"needs {own_s * 1000:.0f} ms more at the device's recent pace: it could not be "
            f"answered within the {left_s * 1000:.0f} ms left before its deadline; retry "
            "shortly",
            retry_after_s=max(1, math.ceil(ahead_s)),
        )
    return None


#: A kind of request of a frame, admitted by one check: its group, priority and chunk rows.
Kind = tuple[Hashable, Priority, int | tuple[int, ...]]

#: No group of any request (a group is compared with ``!=``, so not None, which may be one).
NO_GROUP: Hashable = object()


def keep_tightest(tightest: dict[Kind, float], kind: Kind | None, left_s: float) -> None:
    """Keep in ``tightest`` the least time left of any request of ``kind`` seen (None: none
    seen yet, nothing to keep)."""
    if kind is not None and left_s < tightest.get(kind, float("inf")):
        tightest[kind] = left_s
