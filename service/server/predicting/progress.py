"""Progress of ``batchserve predict`` on stderr: a bar redrawn in place on a terminal, a line
every ``LOG_INTERVAL_S`` otherwise (a log keeps every line)."""

from __future__ import annotations

import time
from typing import TextIO

#: Least time between two redraws of the bar on a terminal.
REDRAW_INTERVAL_S = 0.2
#: Time between two progress lines when stderr is not a terminal.
LOG_INTERVAL_S = 5.0
BAR_WIDTH = 30


class Progress:
    """Rows written of ``total``, their rate since the start, and the time left."""

    def __init__(self, total: int, done: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.terminal = stream.isatty()
        self.interval_s = REDRAW_INTERVAL_S if self.terminal else LOG_INTERVAL_S
        self._first = done
        self._done = done
        self._started_s = time.monotonic()
        self._shown_s = self._started_s

    def start(self) -> None:
        """Count the rate from now (the first row read, the model loaded)."""
        self._started_s = self._shown_s = time.monotonic()

    def update(self, done: int) -> None:
        """``done`` rows are written now; shown if the last showing is old enough."""
        self._done = done
        now_s = time.monotonic()
        if now_s - self._shown_s >= self.interval_s:
            self._shown_s = now_s
            self._show(now_s)

    def finish(self) -> None:
        """The last state, and the end of the bar's line on a terminal."""
        if self.terminal:
            self._show(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, now_s: float) -> None:
        elapsed_s = max(now_s - self._started_s, 1e-9)
        rate = (self._done - self._first) / elapsed_s
        left = self.total - self._done
        eta = f"{left / rate:.0f} s left" if rate > 0 else "? s left"
        share = self._done / self.total if self.total else 1.0
        counts = f"{self._done:,}/{self.total:,} rows ({share:.0%}), {rate:,.0f} rows/s, {eta}"
        if self.terminal:
            filled = round(BAR_WIDTH * share)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {counts}\x1b[K")
        else:
            self.stream.write(f"batchserve predict: {counts}\n")
        self.stream.flush()
