"""How late a front end's event loop runs what is due.

One event loop parses, refuses and answers every request of its process (and, serving alone,
batches them): whatever holds it (a costly parse, a handler, a garbage collection) delays every
other request by as much. A task asks to wake every ``TICK_S`` and records how much later it
woke (``batchserve_event_loop_lag_seconds``): ten wake-ups a second, nothing per request.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

TICK_S = 0.1


async def watch_loop_lag(lag: Histogram, tick_s: float = TICK_S) -> None:
    """Until cancelled, observe in ``lag`` how much later than asked the loop woke this task."""
    loop = asyncio.get_running_loop()
    while True:
        asked_s = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        lag.observe(max(0.0, loop.time() - asked_s))
