"""Running a handler's preprocessing without holding the event loop, within the deadline.

A version's handler (tokenizing, decoding images) and the parse of a large tensor body run in
the front end's handler threads, so one costly request never delays ``/healthz`` or another
model's requests. The wait for them ends at the request's deadline with 504: work still
queued for a thread is dropped, and the handlers check the deadline between images and
between groups of texts (``HandlerRequest.check_deadline``), so a thread is freed soon after.
A small tensor body is parsed inline: below ``INLINE_PARSE_MAX_BYTES`` the parse costs less
than the hop to a thread (docs/bench/protocols.md), and at most about 10 ms.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from service.errors import DeadlineExceededError

T = TypeVar("T")

#: Tensor bodies up to this size are parsed on the event loop: JSON parses at about 40 µs a
#: KiB on a loaded 2-core machine, so 256 KiB is about 10 ms.
INLINE_PARSE_MAX_BYTES = 256 * 1024
#: ``handler_threads = 0`` gives one thread per CPU core within these bounds: two keep one
#: request's decoding from queueing every other behind it; more than four buys little when
#: the front end's own loop needs a core too.
MIN_AUTO_THREADS, MAX_AUTO_THREADS = 2, 4


def handler_thread_count(configured: int) -> int:
    """The handler threads of a front end: ``configured``, or (0) one per core, 2 to 4."""
    if configured > 0:
        return configured
    return max(MIN_AUTO_THREADS, min(MAX_AUTO_THREADS, os.cpu_count() or 1))


def cheap_to_parse(body: bytes) -> bool:
    """Whether a tensor body is small enough to parse on the event loop."""
    return len(body) <= INLINE_PARSE_MAX_BYTES


def check_deadline(deadline_s: float, what: str) -> None:
    """504 once ``deadline_s`` (``time.monotonic()``) has passed, naming what was cut short."""
    late_s = time.monotonic() - deadline_s
    if late_s >= 0:
        raise DeadlineExceededError(
            f"the request's deadline passed {late_s * 1000:.0f} ms ago while {what}; send "
            "smaller requests or a longer timeout"
        )


async def off_the_loop(
    pool: Executor, deadline_s: float, step: Callable[..., T], *args: object
) -> T:
    """``step(*args)`` in ``pool``, awaited until ``deadline_s`` at most: past it, 504.

    A step still queued at the deadline is cancelled before it starts; one already running
    goes on in its thread (Python cannot stop it) until it checks the deadline itself."""
    check_deadline(deadline_s, "it waited for its body")
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(pool, _unless_late, deadline_s, step, *args)
    try:
        async with asyncio.timeout_at(loop.time() + deadline_s - time.monotonic()):
            return await future
    except TimeoutError:
        raise DeadlineExceededError(
            "the request's deadline passed while its body was being preprocessed "
            "(decoded, tokenized or parsed); send smaller requests or a longer timeout"
        ) from None


def _unless_late(deadline_s: float, step: Callable[..., T], *args: object) -> T:
    """In a handler thread: a request that waited past its deadline for a thread is dropped."""
    check_deadline(deadline_s, "it waited for a handler thread")
    return step(*args)
