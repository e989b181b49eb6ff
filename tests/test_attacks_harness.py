"""The goodput attack's bookkeeping (``loadtests.attacks``), without a server."""

from __future__ import annotations

import asyncio

import pytest

from loadtests.attacks import lag_during_s, loop_lags


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
