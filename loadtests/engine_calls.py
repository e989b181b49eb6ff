"""Python calls per request in the engine's event-loop thread: a count, not a time.

The capacity bench (``capacity.py``) measures the engine's CPU per request, which moves by
tens of percent on a shared machine. This runs the same engine (zero-cost model, synthetic
front ends over the real bridge) under ``cProfile`` twice, for a short and a long run, and
divides the difference in calls (and in each function's calls) by the difference in requests
answered: the start-up's calls cancel out, and what is left is the number of Python calls
(and C calls made from Python) that one request costs the event loop's thread. It does not
move with the neighbours' load. The device thread (collation, the model, the split) is
counted apart (``device_profiled.py``: ``cProfile`` follows one thread), per request and per
batch (a batch: one call of ``_timed_run_batch``). Times under ``cProfile`` are inflated and
only listed for orientation.

    python -m loadtests.engine_calls --checkout /path/to/a/checkout [--top 30] [--device-top 30]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests import capacity

#: (function name and place): (calls, own seconds)
Counts = dict[str, tuple[int, float]]

_DEVICE_PROFILED = Path(__file__).resolve().with_name("device_profiled.py")
#: One call a batch on the device thread, in every checkout measured so far.
_BATCH_FUNCTION = "_timed_run_batch"


def profiled_run(checkout: Path, per_frame: int, window: int, frontends: int, duration_s: float,
                 profile: Path, device_profile: Path) -> int:  # fmt: skip
    """Requests answered by an engine of ``checkout`` run under cProfile into ``profile``
    (the event loop's thread) and ``device_profile`` (the device thread)."""
    with tempfile.TemporaryDirectory(prefix="engine-calls-") as scratch:
        repository = Path(scratch) / "models"
        capacity.package(repository)
        path = str(Path(scratch) / "engine.sock")
        env = capacity.engine_env(checkout, Path(scratch), path)
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cProfile",
                "-o",
                str(profile),
                str(_DEVICE_PROFILED),
                str(device_profile),
            ],
            cwd=checkout,
            env=env,
        )
        try:
            version = capacity.ready_version(path)
            results: multiprocessing.Queue[int] = multiprocessing.Queue()
            cpus = sorted(os.sched_getaffinity(0))
            workers = [
                multiprocessing.Process(
                    target=capacity.front_end,
                    args=(path, "new", version, window, per_frame, duration_s, cpus, results),
                )
                for _ in range(frontends)
            ]
            for worker in workers:
                worker.start()
            answered = sum(results.get(timeout=duration_s + 120) for _ in workers)
            for worker in workers:
                worker.join()
        finally:
            engine.terminate()
            engine.wait(timeout=60)
    return answered


def counts(profile: Path) -> Counts:
    found: Counts = {}
    for (file, line, name), row in pstats.Stats(str(profile)).stats.items():  # type: ignore[attr-defined]
        place = "/".join(Path(file).parts[-2:]) if "/" in file else file
        found[f"{name} ({place}:{line})"] = (row[1], row[2])
    return found


def differences(short: Counts, long: Counts, per: int) -> list[tuple[str, float, float]]:
    """Each function's calls and own seconds of the long run less the short one's, per
    ``per`` (requests or batches) between them."""
    rows = []
    for name, (calls, seconds) in long.items():
        short_calls, short_seconds = short.get(name, (0, 0.0))
        rows.append((name, (calls - short_calls) / per, (seconds - short_seconds) / per))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--per-frame", type=int, default=64)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--frontends", type=int, default=3)
    parser.add_argument("--short-s", type=float, default=2.0)
    parser.add_argument("--long-s", type=float, default=6.0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device-top", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine-calls-out-") as out:
        runs = []
        for duration_s in (args.short_s, args.long_s):
            profile = Path(out) / f"{duration_s}.prof"
            device_profile = Path(out) / f"{duration_s}-device.prof"
            answered = profiled_run(args.checkout, args.per_frame, args.window, args.frontends,
                                    duration_s, profile, device_profile)  # fmt: skip
            runs.append((answered, counts(profile), counts(device_profile)))
    (short_answered, short, short_device), (long_answered, long, long_device) = runs
    requests = long_answered - short_answered
    rows = differences(short, long, requests)
    total = sum(row[1] for row in rows)
    print(f"# {args.checkout}: {requests} requests between the runs; "
          f"{total:.1f} calls a request in the event loop's thread")  # fmt: skip
    print("calls/request  µs/request under cProfile  function")
    for name, calls_per, seconds_per in sorted(rows, key=lambda row: -row[1])[: args.top]:
        print(f"{calls_per:13.2f}  {seconds_per * 1e6:10.2f}  {name}")
    batches = sum(calls for name, (calls, _) in long_device.items() if _BATCH_FUNCTION in name)
    batches -= sum(calls for name, (calls, _) in short_device.items() if _BATCH_FUNCTION in name)
    device_rows = differences(short_device, long_device, batches)
    device_total = sum(row[1] for row in device_rows)
    print(f"\n# device thread: {batches} batches between the runs "
          f"({requests / batches:.1f} requests a batch); {device_total:.1f} calls a batch, "
          f"{device_total * batches / requests:.2f} calls a request")  # fmt: skip
    print("  calls/batch  µs/batch under cProfile  function")
    for name, calls_per, seconds_per in sorted(device_rows, key=lambda row: -row[1])[
        : args.device_top
    ]:
        print(f"{calls_per:13.2f}  {seconds_per * 1e6:10.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
