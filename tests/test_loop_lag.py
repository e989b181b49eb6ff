"""A front end's event-loop lag (``batchserve_event_loop_lag_seconds``)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from service.frontend.loop_lag import watch_loop_lag
from service.metrics import FrontendMetrics
from tests.fixtures import sample_total


async def test_a_loop_held_by_one_piece_of_work_shows_as_lag() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    watch = asyncio.create_task(watch_loop_lag(metrics.loop_lag, tick_s=0.01))
    await asyncio.sleep(0.05)  # a few ticks on a free loop
    time.sleep(0.2)  # noqa: ASYNC251 (the loop held, as by a costly parse: no tick can run)
    await asyncio.sleep(0.05)
    watch.cancel()
    ticks = sample_total(registry, "batchserve_event_loop_lag_seconds_count")
    within_100_ms = sample_total(
        registry, "batchserve_event_loop_lag_seconds_bucket", {"le": "0.1"}
    )
    over_100_ms = ticks - within_100_ms
    assert ticks >= 3
    assert over_100_ms >= 1  # the tick that was due during the hold woke 0.19 s late
