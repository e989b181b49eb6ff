"""What the supervisor needs of the processes it starts and of the signals it gets: children
that die with it, and a sleep that a child's exit ends at once."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the children notice a new parent within a second instead


def backoff_s(deaths_in_a_row: int, first_s: float, longest_s: float) -> float:
    """How long to wait before starting a child again after ``deaths_in_a_row`` early deaths:
    at once after the first (a lone crash is the common case, and waiting only lengthens the
    outage), then ``first_s`` doubling up to ``longest_s``, so that a child that fails every
    start does not keep a core busy."""
    if deaths_in_a_row <= 1:
        return 0.0
    return min(longest_s, first_s * 2.0 ** (deaths_in_a_row - 2))


def wake_on_signals() -> int:
    """The read end of a pipe that every signal the supervisor handles writes to, SIGCHLD
    included: an engine's exit ends the supervisor's sleep at once, not at its next poll."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A Python handler, so that SIGCHLD (ignored by default) reaches the wake-up pipe.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    return read_fd


def sleep_until_woken(read_fd: int, longest_s: float) -> None:
    """Sleep up to ``longest_s``; return early once a signal has arrived."""
    readable, _, _ = select.select([read_fd], [], [], longest_s)
    if readable:
        with contextlib.suppress(BlockingIOError):
            while os.read(read_fd, 512):
                pass
