"""What a server's event-loop thread was doing, sampled every few milliseconds from outside it.

A 504 the client sees late by more than its own loop's lag lost that time before the server
started the request's deadline (it starts once the headers are read): the server's loop did
not run. Either it was runnable and the kernel ran something else (two cores shared by the
server's loop, its device thread, the load generator and whatever else runs), or it waited for
the interpreter lock while another thread of the server held it. Linux tells both apart from
outside: ``/proc/<pid>/task/<tid>/schedstat`` counts the nanoseconds a thread spent runnable
but waiting for a core, and ``wchan`` names where a sleeping thread sleeps (``futex`` for a
lock such as the GIL, ``ep_poll``/``poll_schedule_timeout`` for an idle loop).

Run in a process of its own (``start``), so its reads take no time from the load generator's
own loop:

    python -m loadtests.sched_sampler PID TID OUT [--interval-ms 5]

writes ``monotonic_s on_cpu_ns runqueue_ns wchan`` a line until terminated.
"""

from __future__ import annotations

import argparse
import bisect
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

INTERVAL_MS = 5.0


@dataclass(frozen=True)
class Sample:
    at_s: float
    on_cpu_ns: int
    runqueue_ns: int
    wchan: str


def parse(text: str) -> list[Sample]:
    """The samples of a sampler's output (lines cut short at its end are skipped)."""
    samples = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:
            samples.append(Sample(float(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return samples


def runqueue_wait_s(samples: Sequence[Sample], start_s: float, end_s: float) -> float:
    """Seconds the thread waited for a core between ``start_s`` and ``end_s``: the counter's
    rise from the last sample at or before ``start_s`` to the first at or after ``end_s``."""
    if not samples:
        return 0.0
    first, last = _bracket(samples, start_s, end_s)
    return (samples[last].runqueue_ns - samples[first].runqueue_ns) / 1e9


def on_cpu_s(samples: Sequence[Sample], start_s: float, end_s: float) -> float:
    """Seconds the thread ran between ``start_s`` and ``end_s`` (as ``runqueue_wait_s``)."""
    if not samples:
        return 0.0
    first, last = _bracket(samples, start_s, end_s)
    return (samples[last].on_cpu_ns - samples[first].on_cpu_ns) / 1e9


def _bracket(samples: Sequence[Sample], start_s: float, end_s: float) -> tuple[int, int]:
    """The last sample at or before ``start_s`` and the first at or after ``end_s``."""
    times = [sample.at_s for sample in samples]
    first = max(0, bisect.bisect_right(times, start_s) - 1)
    last = min(len(samples) - 1, bisect.bisect_left(times, end_s))
    return first, last


def lock_wait_s(
    samples: Sequence[Sample], start_s: float, end_s: float, interval_s: float = INTERVAL_MS / 1e3
) -> float:
    """About how long the thread slept on a lock (``futex`` in its ``wchan``; the GIL, for a
    Python thread that is not idle in its selector) between ``start_s`` and ``end_s``."""
    return interval_s * sum(
        start_s <= sample.at_s <= end_s and "futex" in sample.wchan for sample in samples
    )


def start(
    pid: int, tid: int, out: Path, interval_ms: float = INTERVAL_MS, ready_timeout_s: float = 60.0
) -> subprocess.Popen[bytes]:
    """The sampler of ``pid``'s thread ``tid``, writing to ``out`` until terminated, once it
    has taken its first sample (an interpreter starts in a few hundred milliseconds on a busy
    machine: a storm begun before would go unsampled)."""
    ready = out.with_name(out.name + ".ready")
    command = [sys.executable, "-m", "loadtests.sched_sampler", str(pid), str(tid), str(out)]
    sampler = subprocess.Popen([*command, "--interval-ms", str(interval_ms), "--ready", str(ready)])
    deadline_s = time.monotonic() + ready_timeout_s
    while not ready.exists() and sampler.poll() is None and time.monotonic() < deadline_s:
        time.sleep(0.01)
    return sampler


def stop(sampler: subprocess.Popen[bytes]) -> None:
    sampler.terminate()
    sampler.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pid", type=int)
    parser.add_argument("tid", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--interval-ms", type=float, default=INTERVAL_MS)
    parser.add_argument("--ready", type=Path, help="a file made once the first sample is taken")
    args = parser.parse_args(argv)
    # Terminated: leave through the ``with`` below, so what was sampled is written out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    task = Path(f"/proc/{args.pid}/task/{args.tid}")
    interval_s = args.interval_ms / 1000
    with args.out.open("w", buffering=1 << 16) as out:
        next_s = time.monotonic()
        while True:
            try:
                on_cpu, runqueue, _ = (task / "schedstat").read_text().split()
                wchan = (task / "wchan").read_text().strip() or "running"
            except (OSError, ValueError):
                return 0  # the thread or the process has ended
            out.write(f"{time.monotonic():.6f} {on_cpu} {runqueue} {wchan}\n")
            if args.ready is not None and not args.ready.exists():
                args.ready.touch()
            next_s += interval_s
            time.sleep(max(0.0, next_s - time.monotonic()))


if __name__ == "__main__":
    sys.exit(main())
