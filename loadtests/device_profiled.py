"""Run the engine process with each device thread under its own ``cProfile``.

``cProfile`` follows the thread that enables it only, so ``python -m cProfile`` sees the
event loop's thread and never the device thread (``batchserve-device``), where collation,
the forward and the split run. This script installs a hook (``threading.setprofile``) that
starts a profiler in every thread whose name begins with ``batchserve-device`` and, once the
engine has exited, writes their merged counts to the file named by its first argument (a
``pstats`` file). Run it under ``python -m cProfile -o MAIN`` to get the loop's counts too:

    python -m cProfile -o main.prof loadtests/device_profiled.py device.prof
"""

from __future__ import annotations

import cProfile
import marshal
import runpy
import sys
import threading
from types import FrameType
from typing import Any

_PROFILES: list[cProfile.Profile] = []


def _start_in_device_threads(frame: FrameType, event: str, arg: Any) -> None:
    """The first profile event of a new thread: a profiler of its own if it is a device
    thread (it replaces this hook in that thread), none otherwise."""
    if threading.current_thread().name.startswith("batchserve-device"):
        profile = cProfile.Profile()
        _PROFILES.append(profile)
        profile.enable()
    else:
        sys.setprofile(None)


def _write(path: str) -> None:
    """Every device thread's counts merged into one ``pstats`` file (``getstats`` through
    ``snapshot_stats`` reads a profiler without stopping it)."""
    merged: dict[Any, Any] = {}
    for profile in _PROFILES:
        profile.snapshot_stats()
        for function, (calls, primitive, own_s, total_s, callers) in profile.stats.items():  # type: ignore[attr-defined]
            before = merged.get(function, (0, 0, 0.0, 0.0, {}))
            merged[function] = (before[0] + calls, before[1] + primitive, before[2] + own_s,
                                before[3] + total_s, {**before[4], **callers})  # fmt: skip
    with open(path, "wb") as file:
        marshal.dump(merged, file)


def main() -> None:
    out = sys.argv[1]
    sys.argv = ["service.engine.process"]
    threading.setprofile(_start_in_device_threads)
    try:
        runpy.run_module("service.engine.process", run_name="__main__", alter_sys=True)
    finally:
        _write(out)


if __name__ == "__main__":
    main()
