"""Refusals for load held for the connections that resend before their ``Retry-After``.

A 429 for load (the queue is full, or the work queued ahead would make the request late)
costs the front end the request's parse and an answer. Clients that ignore ``Retry-After``
and resend at once turned that into a storm of refusals that took the CPU (and the
interpreter) the forward needed: one process fell to 0.07-0.18x of one client's goodput at 64
such clients (issue 23). So a connection's first refusal is answered at once, and one that
comes back on the same connection before its ``Retry-After`` has passed is held until most of
it has (at most ``refusal_hold_ms``): a client that ignores ``Retry-After`` is made to honour
it, and costs one refusal per ``Retry-After``, not thousands a second. A client that honours it
never waits. How much of it is a draw between ``HELD_FRACTION`` and 1 for each refusal: held
whole, the clients refused together came back together, once a second, and the queue (a
deadline's worth of work) sat empty between their waves. The connections are known by their
address (``scope["client"]`` over HTTP, ``context.peer()`` over gRPC); a client that opens a
new connection for every retry is not held, but pays for a connection each time. A gRPC
connection carries many calls at once: each call refused before the connection's last
``Retry-After`` passed is held (calls refused together wait up to ``refusal_hold_ms`` each),
as one client resending at once. A call with a deadline of its own is answered by
``DEADLINE_SHARE_HELD`` of the time it had left: told it was refused, not that it ran late.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Hashable

from service.errors import OverloadedError, QueueFullError, ServiceError

#: A held refusal waits from this fraction of its ``Retry-After`` to all of it, drawn at random.
HELD_FRACTION = 0.5
#: Connections remembered at most; beyond, those whose ``Retry-After`` has passed are
#: forgotten, and if none has, all are (a flood of connections then goes unheld).
MAX_CONNECTIONS = 4096
#: A held refusal is answered once this share of its caller's time left (a gRPC deadline) has
#: passed, at the latest.
DEADLINE_SHARE_HELD = 0.8


def retry_after_s(error: ServiceError) -> float | None:
    """The ``Retry-After`` of a refusal for load, in seconds; None for any other error."""
    if not isinstance(error, QueueFullError | OverloadedError):
        return None
    try:
        return float(error.headers.get("Retry-After", "1"))
    except ValueError:
        return 1.0


def hold_s(
    retry_at_s: float | None, now_s: float, max_hold_s: float, time_left_s: float | None = None
) -> float:
    """How long a refusal is held: until the connection's last ``Retry-After`` ends
    (``retry_at_s``; None: never refused), at most ``max_hold_s`` and ``DEADLINE_SHARE_HELD``
    of the caller's ``time_left_s`` (None: no deadline of its own)."""
    if retry_at_s is None:
        return 0.0
    seconds = min(max(0.0, retry_at_s - now_s), max_hold_s)
    if time_left_s is not None:
        seconds = min(seconds, max(0.0, time_left_s * DEADLINE_SHARE_HELD))
    return seconds


class RefusalHolds:
    """When each connection refused for load may retry."""

    def __init__(
        self,
        max_hold_ms: float,
        now: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] | None = None,
    ) -> None:
        """``draw``: a number in [0, 1) for the share of each ``Retry-After`` held."""
        self._max_hold_s = max_hold_ms / 1000.0
        self._now = now
        self._draw = draw or random.Random().random
        self._retry_at_s: dict[Hashable, float] = {}

    def __len__(self) -> int:
        """Connections remembered."""
        return len(self._retry_at_s)

    def refused(
        self, connection: Hashable, error: ServiceError, time_left_s: float | None = None
    ) -> float:
        """Seconds to hold ``error`` before it is answered on ``connection`` (0 for an error
        that is not a refusal for load, or with holds off); ``time_left_s``: the caller's
        own deadline, if it set one."""
        retry_s = retry_after_s(error)
        if retry_s is None or not self._max_hold_s:
            return 0.0
        now_s = self._now()
        retry_at_s = self._retry_at_s.pop(connection, None)
        seconds = hold_s(retry_at_s, now_s, self._max_hold_s, time_left_s)
        if len(self._retry_at_s) >= MAX_CONNECTIONS:
            self._forget(now_s)
        share = HELD_FRACTION + (1.0 - HELD_FRACTION) * self._draw()
        self._retry_at_s[connection] = now_s + seconds + retry_s * share
        return seconds

    def _forget(self, now_s: float) -> None:
        live = {key: at_s for key, at_s in self._retry_at_s.items() if at_s > now_s}
        self._retry_at_s = live if len(live) < MAX_CONNECTIONS else {}

    async def hold(
        self, connection: Hashable, error: ServiceError, time_left_s: float | None = None
    ) -> None:
        """Wait before ``error`` is answered on ``connection``, as ``refused`` says."""
        seconds = self.refused(connection, error, time_left_s)
        if seconds > 0:
            await asyncio.sleep(seconds)
