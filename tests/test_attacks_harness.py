"""The goodput attack's bookkeeping (``loadtests.attacks``), without a server."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from pathlib import Path

import pytest

from loadtests import sched_sampler
from loadtests.attacks import DEADLINE_MS, Outcome, lag_during_s, late_504s, loop_lags
from loadtests.sched_sampler import Sample, lock_wait_s, on_cpu_s, parse, runqueue_wait_s


def test_a_requests_share_of_the_load_generators_lag_is_that_of_the_ticks_it_overlapped() -> None:
    lags = [(10.000, 0.0), (10.001, 0.020), (10.022, 0.0), (10.5, 0.004)]
    assert lag_during_s(lags, 10.010, 10.3) == pytest.approx(0.020)  # inside the long tick
    assert lag_during_s(lags, 10.030, 10.3) == 0.0  # after it
    assert lag_during_s(lags, 10.030, 10.6) == pytest.approx(0.004)
    assert lag_during_s([], 10.0, 11.0) == 0.0


def test_a_blocked_load_generator_shows_as_lag() -> None:
    async def blocks() -> str:
        await asyncio.sleep(0.005)
        blocked_until_s = asyncio.get_running_loop().time() + 0.05
        while asyncio.get_running_loop().time() < blocked_until_s:
            pass  # the loop cannot tick
        await asyncio.sleep(0.005)
        return "done"

    result, lags = asyncio.run(loop_lags(blocks()))
    assert result == "done"
    assert max(lag for _, lag in lags) >= 0.04


def test_a_threads_waits_for_a_core_and_for_a_lock_are_read_between_samples() -> None:
    samples = [
        Sample(10.000, 0, 1_000_000, "ep_poll"),
        Sample(10.005, 0, 1_000_000, "futex_wait_queue"),
        Sample(10.010, 0, 31_000_000, "0"),  # 30 ms runnable, no core
        Sample(10.015, 0, 31_000_000, "ep_poll"),
    ]
    assert runqueue_wait_s(samples, 10.006, 10.012) == pytest.approx(0.030)
    assert runqueue_wait_s(samples, 10.011, 10.014) == 0.0
    assert runqueue_wait_s([], 10.0, 11.0) == 0.0
    assert lock_wait_s(samples, 10.0, 10.015, interval_s=0.005) == pytest.approx(0.005)
    ran = samples_of((10.0, 1_000_000, 0, "0"), (10.01, 9_000_000, 0, "ep_poll"))
    assert on_cpu_s(ran, 10.002, 10.008) == pytest.approx(0.008)
    assert parse("10.0 1 2 ep_poll\n10.005 3 4 futex_wait_queue\n10.01 5") == samples_of(
        (10.0, 1, 2, "ep_poll"), (10.005, 3, 4, "futex_wait_queue")
    )


def samples_of(*rows: tuple[float, int, int, str]) -> list[Sample]:
    return [Sample(*row) for row in rows]


def test_a_late_504_is_split_between_the_load_generator_and_the_servers_loop() -> None:
    """Issue 23: a 504 seen 50 ms late beyond the load generator's own lag was time the server
    did not see (its deadline starts once it has read the headers). Each late 504 is split:
    the load generator's lag, and what the server's loop did in the request's first ``late``
    ms, before it can have read it."""
    deadline_s = DEADLINE_MS / 1000
    outcomes = [
        Outcome(504, deadline_s + 0.060, sent_s=10.0),
        Outcome(504, deadline_s + 0.002, sent_s=10.0),  # on time: not listed
        Outcome(429, deadline_s + 0.100, sent_s=10.0),
    ]
    lags = [(10.3, 0.010)]
    samples = samples_of(
        (10.0, 0, 0, "ep_poll"),
        (10.06, 5_000_000, 40_000_000, "ep_poll"),  # its first 60 ms: no core for 40
        (10.3, 9_000_000, 90_000_000, "ep_poll"),
    )
    (line,) = late_504s("in_process, 64 clients", outcomes, lags, samples)
    assert "a 504 60.0 ms late" in line
    assert "lag 10.0 ms" in line
    assert "waited for a core 40.0 ms" in line
    assert "ran 5.0 ms" in line
    assert line.endswith("left 5.0 ms")


def test_the_sampler_reads_a_live_thread_of_another_process(tmp_path: Path) -> None:
    out = tmp_path / "sched.txt"
    sampler = sched_sampler.start(os.getpid(), threading.get_native_id(), out)
    try:
        waited_s = 0.0
        while len(parse(out.read_text() if out.exists() else "")) < 3 and waited_s < 60:
            time.sleep(0.1)  # the sampler's file is flushed as it fills: wait for its end
            waited_s += 0.1
    finally:
        sched_sampler.stop(sampler)
    samples = parse(out.read_text())
    assert len(samples) >= 3
    assert all(a.at_s < b.at_s for a, b in itertools.pairwise(samples))
    assert samples[-1].on_cpu_ns >= samples[0].on_cpu_ns
