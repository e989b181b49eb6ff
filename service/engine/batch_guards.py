"""Guards around running batches: the row limit after running out of device memory, the
stall watch, and what a request is answered when the model fails on it.

A batch that raises is retried by halves (``batch_run.py``), so only the request that causes
the error fails. A batch that runs out of device memory is retried by halves too, and for
``OOM_BACKOFF_S`` batches are capped at half the rows that failed; the cap doubles back each
``OOM_BACKOFF_S`` without a new failure. A batch that runs longer than ``stall_timeout_s``
marks the batcher stalled: it refuses new work and calls ``on_stall`` so the process can be
replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from service.engine.batch_clock import Clock, Timer
from service.errors import (
    DeviceOutOfMemoryError,
    InferenceError,
    InsufficientDeviceMemoryError,
    ServiceError,
)

logger = logging.getLogger("service.engine.batching")

#: After running out of device memory, batches stay capped this long before the cap doubles.
OOM_BACKOFF_S = 30.0


class RowLimit:
    """Rows per batch now: ``max_batch_size``, or less for a while after an OOM."""

    def __init__(self, max_batch_size: int, on_change: Callable[[int], None]) -> None:
        self.max_batch_size = max_batch_size
        self.rows = max_batch_size
        self._until_s = 0.0
        self._on_change = on_change

    def shrink(self, failed_rows: int, now_s: float) -> None:
        """Out of device memory: cap batches at half the rows that failed, for a while."""
        self.rows = max(1, min(self.rows, failed_rows // 2))
        self._until_s = now_s + OOM_BACKOFF_S
        self._on_change(self.rows)
        logger.warning("device_out_of_memory", extra={"rows": failed_rows, "row_limit": self.rows})

    def restore(self, now_s: float) -> None:
        """Double the capped limit each ``OOM_BACKOFF_S`` without a new failure."""
        if self.rows < self.max_batch_size and now_s >= self._until_s:
            self.rows = min(self.max_batch_size, self.rows * 2)
            self._until_s = now_s + OOM_BACKOFF_S
            self._on_change(self.rows)


class StallWatch:
    """Marks the batcher stalled (once) when a batch outlives ``stall_timeout_s``.

    One timer watches every running batch, armed when none is: when it fires it looks at the
    oldest batch still running, and reports it or waits for its turn. A batch costs two dict
    writes, not a timer of its own armed and cancelled (at c=1, once a request)."""

    def __init__(
        self, clock: Clock, stall_timeout_s: float, on_stall: Callable[[], None] | None
    ) -> None:
        self._clock = clock
        self.stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self.stalled = False
        self._started_s: dict[int, float] = {}
        """When each batch running now started, by its number."""
        self._batches = 0
        self._timer: Timer | None = None

    def started(self, now_s: float) -> int:
        """A batch started at ``now_s``; pass what this returns to ``finished``."""
        self._batches += 1
        if self.stall_timeout_s > 0:
            self._started_s[self._batches] = now_s
            if self._timer is None:
                self._timer = self._clock.call_at(now_s + self.stall_timeout_s, self._check)
        return self._batches

    def finished(self, batch: int) -> None:
        """The batch numbered ``batch`` came back (or failed)."""
        self._started_s.pop(batch, None)

    def close(self) -> None:
        """Stop watching (the collector has stopped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if not self._started_s or self.stalled:
            return
        due_s = min(self._started_s.values()) + self.stall_timeout_s
        if self._clock.now() >= due_s:
            self._report()
        else:  # the batch it was armed for came back: watch the oldest still running
            self._timer = self._clock.call_at(due_s, self._check)

    def _report(self) -> None:
        if self.stalled:
            return
        self.stalled = True
        logger.error("model_stalled", extra={"stall_timeout_s": self.stall_timeout_s})
        if self._on_stall is not None:
            self._on_stall()


def failure_for(rows: int, request_id: str, error: Exception) -> ServiceError:
    """What a request that fails alone is answered: its own ``ServiceError``, 507 when it
    does not fit in device memory even alone, otherwise 500 naming the error's type."""
    if isinstance(error, ServiceError):
        return error
    logger.error(
        "inference_failed",
        extra={"request_id": request_id, "error": f"{type(error).__name__}: {error}"},
    )
    failure: ServiceError
    if isinstance(error, DeviceOutOfMemoryError):
        failure = InsufficientDeviceMemoryError(
            f"out of device memory for this request's {rows} instance(s) even alone; "
            "retry later or with fewer instances"
        )
    else:
        failure = InferenceError(
            f"the model failed on this request's input ({type(error).__name__})"
        )
    failure.__cause__ = error
    return failure
