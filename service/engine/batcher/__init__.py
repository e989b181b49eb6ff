"""The batcher: many concurrent requests of one model, run in as few forward passes as serve
them in time. Pure asyncio: no torch, no web framework.

Its pieces, each a module with one concern, tested alone:

- ``queue``: what waits for the device (entries by group and priority lane, with running
  totals), the ``Ticket`` each caller holds, and where finished tickets go (``Outbox``).
- ``admission``: what a request is split into (chunks within a batch, a part at a time when
  it comes sorted by length into a part per length bucket), and what is refused at once: the
  queue full (429), the work queued ahead too long for the request's deadline (429 with
  ``Retry-After``), the request too long even alone (422).
- ``policy`` and ``adaptive``: the ``DispatchPolicy`` protocol, and one class per policy
  (``FixedPolicy``, ``AdaptivePolicy``), each owning its own target, refill wait and split.
- ``selection``: which requests the next batch holds (round robin, priority without
  starvation, token budget, time quantum, deadlines): pure functions of the queue and ``now``.
- ``run``: running a batch on the device thread with its guards (failure bisection, the row
  limit after running out of memory, the stall watch) and its spans (``spans``).
- ``clock``: the one clock, and every deadline on one heap with one timer; ``estimates``:
  recent forward durations, by group and size.
- ``collector``: ``DynamicBatcher``, the one task that owns the queue and ties them together.

A new dispatch policy is a class of its own that provides ``DispatchPolicy`` (in a module of
its own, as ``adaptive.py``), named in ``dispatch_policy`` below; nothing else changes. A
generation policy (token by token, iteration-level) is one: each step is a batch, due as soon
as the device is free and a sequence runs or waits (``is_ready``); its target holds every
running sequence plus the chunks of new prompts within the token budget; its ``taken`` and
``answered`` keep the running sequences, which go back in the queue after each step with
their ticket answered once per step through its sink, until they end.
"""

from collections.abc import Callable

from service.config import BatchPolicy
from service.engine.batcher.adaptive import AdaptivePolicy
from service.engine.batcher.admission import Admitted, Part, Submission
from service.engine.batcher.collector import DynamicBatcher
from service.engine.batcher.policy import DispatchPolicy, FixedPolicy
from service.engine.batcher.queue import QUEUE_DEPTH_REFRESH_S, Sink, Ticket
from service.engine.batcher.run import OOM_BACKOFF_S, BatchFunction

__all__ = [
    "OOM_BACKOFF_S",
    "QUEUE_DEPTH_REFRESH_S",
    "Admitted",
    "BatchFunction",
    "DispatchPolicy",
    "DynamicBatcher",
    "Part",
    "Sink",
    "Submission",
    "Ticket",
    "dispatch_policy",
]


def dispatch_policy(
    name: BatchPolicy,
    max_wait_ms: float,
    *,
    expected_requests: Callable[[], int] = lambda: 0,
    instances: int = 1,
) -> DispatchPolicy:
    """The policy the ``batch_policy`` setting names. ``expected_requests``: how many requests
    the front ends hold now; ``instances``: batches that may run at once."""
    if name == "fixed":
        return FixedPolicy(max_wait_ms / 1000.0)
    return AdaptivePolicy(max_wait_ms / 1000.0, expected_requests, instances)
