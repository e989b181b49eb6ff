"""The supervisor's restart policy, and its wake-up on a child's exit, without servers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from service.server.child_processes import sleep_until_woken, wake_on_signals
from service.server.supervisor import FIRST_BACKOFF_S, LONGEST_BACKOFF_S, restart_delay_s


def test_an_engine_that_had_been_serving_is_restarted_at_once() -> None:
    assert restart_delay_s(0) == 0.0


def test_the_first_young_death_is_restarted_at_once() -> None:
    """A lone crash soon after a start (a restart, or a kill during a test) is the common
    case: waiting would only lengthen the outage."""
    assert restart_delay_s(1) == 0.0


def test_repeated_young_deaths_wait_longer_each_time_up_to_the_longest() -> None:
    waits = [restart_delay_s(deaths) for deaths in range(2, 12)]
    assert waits[0] == FIRST_BACKOFF_S
    assert waits == sorted(waits)
    assert waits[1] == 2 * FIRST_BACKOFF_S
    assert waits[-1] == LONGEST_BACKOFF_S


@pytest.fixture
def woken() -> Iterator[int]:
    previous = signal.getsignal(signal.SIGCHLD)
    read_fd = wake_on_signals()
    try:
        yield read_fd
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, previous)


def test_a_child_exit_ends_the_sleep_long_before_its_limit(woken: int) -> None:
    longest_s = 30.0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started_s = time.monotonic()
    sleep_until_woken(woken, longest_s)
    assert time.monotonic() - started_s < longest_s / 2
    assert child.wait() == 0


def test_without_a_signal_the_sleep_lasts_its_limit(woken: int) -> None:
    started_s = time.monotonic()
    sleep_until_woken(woken, 0.2)
    assert time.monotonic() - started_s >= 0.2
