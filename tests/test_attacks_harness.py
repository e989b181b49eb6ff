"""The goodput attack's bookkeeping (``loadtests.attacks``), without a server."""

from __future__ import annotations

import asyncio

import pytest

from loadtests.attacks import DEADLINE_MS, Outcome, lag_during_s, late_504s, loop_lags


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


def test_a_late_504_is_split_between_the_load_generator_and_the_server() -> None:
    """A 504 seen late beyond the load generator's own lag was time the server did not see
    (its deadline starts once it has read the headers): each late 504 names both parts."""
    deadline_s = DEADLINE_MS / 1000
    outcomes = [
        Outcome(504, deadline_s + 0.060, sent_s=10.0),
        Outcome(504, deadline_s + 0.002, sent_s=10.0),  # on time: not listed
        Outcome(429, deadline_s + 0.100, sent_s=10.0),
    ]
    lags = [(10.3, 0.010)]
    (line,) = late_504s("in_process, 64 clients", outcomes, lags)
    assert "a 504 60.0 ms late" in line
    assert "lag 10.0 ms" in line
    assert line.endswith("the server's side 50.0 ms")
