"""An engine's heartbeat while it starts: a thread that touches its heartbeat file.

From its first instant to the end of its models' load, an engine is busy with work that says
nothing to the supervisor: importing torch and the engine (seconds, tens of seconds on a
loaded host), then loading and warming up its models. The supervisor must still tell such an
engine, slow but progressing, from one that will never serve (stopped, wedged): it kills a
starting engine whose heartbeat file goes untouched for ``engine_start_heartbeat_timeout_s``.
So the engine touches the file from this thread, which runs whenever the interpreter does
(a stopped process touches nothing), until its event loop has loaded the models: from then on
the loop's own heartbeat, held to ``engine_heartbeat_timeout_s``, proves that the loop serves.

Light on purpose (no torch, no engine): it starts before those imports.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


class StartingHeartbeat:
    """Touches ``path`` every ``interval_s`` from a daemon thread, from ``start`` to ``stop``;
    does nothing without a path (an engine started by hand, without a supervisor)."""

    def __init__(self, path: Path | None, interval_s: float) -> None:
        self.path = path
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StartingHeartbeat:
        """Touch the file now, then keep touching it until ``stop``."""
        if self.path is None or self._thread is not None:
            return self
        self._touch()
        self._thread = threading.Thread(
            target=self._beat, name="engine-starting-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """The engine's event loop beats from now on (or the engine exits); returns once the
        thread has ended (it wakes at once)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def beating(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._touch()

    def _touch(self) -> None:
        assert self.path is not None
        # The run folder goes when the server stops: nothing left to tell.
        with contextlib.suppress(OSError):
            os.utime(self.path)
