"""Where one closed-loop client's time and CPU go: each server thread at c=1, and idle.

Starts each configuration (``mlp-single``, ``mlp-w2`` by default) on this checkout and, with
``--baseline-checkout``, on a baseline, all at once; then in interleaved rounds (the order
reversed every other round), for each server: ``--idle-s`` of no traffic, then one wrk run
at c=1. From ``/proc/PID/task/TID/schedstat`` (nanoseconds, unlike ``stat``'s 10 ms ticks)
it reads, per thread (by process role and thread name): CPU per answered request, the time
it waited runnable for a CPU (run-queue wait) per request, its context switches per request,
and its CPU per second while idle (a thread that spins or polls shows there). Medians over
the rounds; a machine shared with others moves every absolute figure.

    python -m loadtests.c1_threads --baseline-checkout /path/to/12e05c8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from loadtests import configs, engine_cost, memory, servers, sweep
from loadtests.report import Point

ThreadKey = tuple[str, str]
"""(process role, thread name: ``main`` for a process's first thread)."""
#: Per thread: CPU ns, run-queue wait ns, context switches (schedstat's three fields).
Sample = tuple[float, float, float]


def thread_samples(root: int) -> dict[ThreadKey, Sample]:
    """schedstat so far of every thread of ``root``'s process tree, summed by role and name."""
    parents = memory._parents(memory.PROC)
    pids = memory.descendants(root, parents)
    commands = {pid: memory._command(pid, memory.PROC) for pid in pids}
    roles = memory.roles(root, parents, commands)
    found: dict[ThreadKey, Sample] = {}
    for pid in pids:
        for task in engine_cost._tasks(pid):
            try:
                name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()
            except OSError:
                continue
            key = (roles.get(pid, "other"), "main" if task == pid else name)
            before = found.get(key, (0.0, 0.0, 0.0))
            found[key] = (
                before[0] + int(fields[0]),
                before[1] + int(fields[1]),
                before[2] + int(fields[2]),
            )
    return found


def _delta(
    after: dict[ThreadKey, Sample], before: dict[ThreadKey, Sample]
) -> dict[ThreadKey, Sample]:
    zero = (0.0, 0.0, 0.0)
    return {
        key: (a[0] - before.get(key, zero)[0], a[1] - before.get(key, zero)[1],
              a[2] - before.get(key, zero)[2])
        for key, a in after.items()
    }  # fmt: skip


def _start(harness: sweep.Sweep, pool: servers.ServerPool, args: argparse.Namespace,
           scratch: Path) -> list[sweep.Contender]:  # fmt: skip
    contenders = []
    for name in args.configs:
        configuration = configs.CONFIGURATIONS[name]
        contenders.append(harness.start_contender(pool, configuration, None))
        if args.baseline_checkout is None:
            continue
        baseline = sweep.Baseline(args.baseline_checkout.resolve())
        if (baseline.checkout / "service" / "model_store.py").exists():  # pre-split layout
            repository, path = engine_cost.baseline_mlp_repository(
                baseline.checkout, scratch / "baseline-mlp"
            )
        else:  # today's layout (main, say): it reads our repository
            repository, path = harness.ensure_repository(configs.MLP_MODEL), scratch
        contenders.append(
            engine_cost.start_baseline(harness, pool, configuration, baseline, repository, path)
        )
    return contenders


def table(p50s: dict[str, list[float]], busy: dict[str, dict[ThreadKey, list[Sample]]],
          idle: dict[str, dict[ThreadKey, list[float]]]) -> list[str]:  # fmt: skip
    """A Markdown table: each server's p50, then each thread that did anything."""
    lines = [
        "| server | p50 ms (median; rounds) | thread | CPU µs / request | run-queue wait µs "
        "/ request | switches / request | CPU µs / s idle |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, rounds in p50s.items():
        medians = {
            key: tuple(statistics.median(s[i] for s in samples) for i in range(3))
            for key, samples in busy[label].items()
        }
        idle_us = {key: statistics.median(v) for key, v in idle[label].items()}
        p50 = f"{statistics.median(rounds):.2f}; " + ", ".join(f"{v:.2f}" for v in rounds)
        lines.append(
            f"| {label} | {p50} | all | {sum(m[0] for m in medians.values()):.0f} | "
            f"{sum(m[1] for m in medians.values()):.0f} | "
            f"{sum(m[2] for m in medians.values()):.1f} | {sum(idle_us.values()):.0f} |"
        )
        for key in sorted(medians, key=lambda k: -medians[k][0]):
            cpu_us, wait_us, switches = medians[key]
            if cpu_us >= 5 or idle_us.get(key, 0.0) >= 100:
                lines.append(
                    f"| | | {key[0]}: {key[1]} | {cpu_us:.0f} | {wait_us:.0f} | "
                    f"{switches:.1f} | {idle_us.get(key, 0.0):.0f} |"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-checkout", type=Path)
    parser.add_argument("--configs", nargs="+", default=["mlp-single", "mlp-w2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/c1-threads"))
    args = parser.parse_args(argv)
    sweep_args = sweep.parse_args(
        ["--configs", *args.configs, "--concurrency", "1", "--duration-s", str(args.duration_s),
         "--repeats", str(args.rounds), "--warmup-s", "1"]
    )  # fmt: skip
    p50s: dict[str, list[float]] = defaultdict(list)
    busy: dict[str, dict[ThreadKey, list[Sample]]] = defaultdict(lambda: defaultdict(list))
    idle: dict[str, dict[ThreadKey, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="c1-threads-") as scratch:
        harness = sweep.Sweep(sweep_args, args.out, Path(scratch))
        with servers.ServerPool() as pool:
            contenders = _start(harness, pool, args, Path(scratch))
            for round_index in range(args.rounds):
                order = contenders if round_index % 2 == 0 else contenders[::-1]
                for contender in order:
                    pid, label = contender.server.pid, contender.label
                    before = thread_samples(pid)
                    time.sleep(args.idle_s)
                    for key, sample in _delta(thread_samples(pid), before).items():
                        idle[label][key].append(sample[0] / 1e3 / args.idle_s)
                    point = Point(label=label, workload="mlp", concurrency=1, ceiling="-")
                    script = harness.script(contender.configuration.workload)
                    before = thread_samples(pid)
                    result, _ = harness.measure_run(contender.server.url, script, point)
                    answered = max(1, result.requests)
                    for key, sample in _delta(thread_samples(pid), before).items():
                        per_request = (sample[0] / 1e3 / answered, sample[1] / 1e3 / answered,
                                       sample[2] / answered)  # fmt: skip
                        busy[label][key].append(per_request)
                    p50s[label].append(result.p50_ms)
                    sweep.log(f"r{round_index + 1} {label}: p50 {result.p50_ms:.3f} ms")
    lines = table(p50s, busy, idle)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
