"""Every process's metric files, read for one scrape (Prometheus multiprocess mode)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

from prometheus_client import multiprocess
from prometheus_client.metrics_core import Metric


class CollectorOfStartedFiles(multiprocess.MultiProcessCollector):
    """prometheus-client's collector of every process's files, without those a process is
    creating just then: its file is empty from its creation until it is sized, and a scrape in
    that moment (an engine restarting) failed on it with a 500 (``struct.error``). An empty
    file holds no value yet, so nothing is left out."""

    def collect(self) -> Iterable[Metric]:
        files = glob.glob(os.path.join(self._path, "*.db"))
        started = [path for path in files if _size_bytes(path) >= _FILE_HEADER_BYTES]
        return self.merge(started, accumulate=True)  # type: ignore[no-untyped-call,no-any-return]


#: What a metric file starts with once sized: how much of it is used.
_FILE_HEADER_BYTES = 8


def _size_bytes(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:  # the folder cleared meanwhile
        return 0
