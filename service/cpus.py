"""How many CPUs this process may use: what an engine sizes torch's threads by, and what
``tune`` searches front ends and threads over, so that both count alike."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: A cgroup v2 CPU quota: ``QUOTA PERIOD`` in microseconds, or ``max PERIOD`` for none.
CPU_QUOTA_FILE = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    container's limit), which ``os.cpu_count()`` ignores by counting the whole node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        quota, period = CPU_QUOTA_FILE.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus
