"""The c=1 harnesses: the batcher alone wakes its collector twice per lone request (enqueue,
answer), and the per-thread table lists each server and the threads that did anything."""

from __future__ import annotations

import asyncio
import cProfile
import pstats

from loadtests import c1_batcher, c1_threads


def test_a_lone_request_resumes_the_collector_exactly_twice() -> None:
    """No sleep(0), no timer, no max_wait for a request that is alone: counted, not timed."""
    resumptions = []
    for requests in (5, 25):
        profile = cProfile.Profile()
        profile.enable()
        times_s = asyncio.run(c1_batcher.closed_loop(requests, max_wait_ms=50.0))
        profile.disable()
        assert len(times_s) == requests
        resumptions.append(c1_batcher._resumptions(pstats.Stats(profile), "_collect_forever"))
    assert (resumptions[1] - resumptions[0]) / 20 == 2.0


def test_the_thread_table_gives_each_server_and_its_busy_or_idle_polling_threads() -> None:
    busy = {
        "ours": {
            ("server", "main"): [(800.0, 900.0, 3.0), (1000.0, 1100.0, 4.0)],
            ("server", "device"): [(600.0, 100.0, 2.0), (600.0, 300.0, 2.0)],
            ("server", "quiet"): [(1.0, 0.0, 0.0), (1.0, 0.0, 0.0)],
        }
    }
    idle = {"ours": {("server", "main"): [0.0, 0.0], ("server", "quiet"): [500.0, 500.0]}}
    lines = c1_threads.table({"ours": [1.0, 3.0]}, busy, idle)
    assert lines[2] == "| ours | 2.00; 1.00, 3.00 | all | 1501 | 1200 | 5.5 | 500 |"
    assert lines[3].startswith("| | | server: main | 900 | 1000 | 3.5 |")
    assert lines[4].startswith("| | | server: device | 600 | 200 | 2.0 |")
    assert lines[5] == "| | | server: quiet | 1 | 0 | 0.0 | 500 |"  # polls while idle


def test_calls_are_counted_apart_in_the_collector_task_and_in_enqueue() -> None:
    """Counted, not timed: a lone request costs both paths some calls, the same each time."""
    calls = c1_batcher.path_calls(40, max_wait_ms=50.0)
    assert set(calls) == {"collector", "enqueue"}
    assert calls["collector"] > 50
    assert calls["enqueue"] > 20
