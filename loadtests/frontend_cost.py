"""CPU per request by role (front ends, engine, the rest), this checkout against another one.

``python -m loadtests.frontend_cost --baseline /path/to/checkout [--rounds 5] [--duration-s 8]``

Starts the MLP (``PeerMLP``, one 256-float JSON instance per request) once per checkout and
mode (``BATCHSERVE_WORKERS=2``: two front ends and an engine; ``1``: one process), all of them
at once, then loads them in turn with wrk (one thread, ``--concurrency`` connections),
interleaved round by round, so that a busy shared machine weighs on both sides alike. CPU per
request is the ``utime + stime`` that each server process spent over the run (``/proc``)
divided by the requests answered; a process is a front end when its command line is
gunicorn's or uvicorn's worker, the engine when it is ``service.engine.process``. Prints a
Markdown table of medians, and each round's figures with ``--verbose``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests import bodies, configs, servers, wrk

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
MODES: dict[str, dict[str, str]] = {
    "workers2": {"BATCHSERVE_WORKERS": "2"},
    "one-process": {"BATCHSERVE_WORKERS": "1"},
}


@dataclass(frozen=True)
class Sample:
    requests_per_s: float
    answered: int
    errors: int
    cpu_us: dict[str, float]
    """CPU per answered request (µs) by role: ``frontend``, ``engine``, ``other``, ``all``."""


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def role_of(pid: int, tree: list[int]) -> str:
    """``engine``, ``frontend`` (a gunicorn worker, or one process serving alone: a tree of
    one) or ``other`` (the supervisor, gunicorn's master)."""
    if len(tree) == 1:
        return "frontend"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_command = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "other"
    if "service.engine.process" in command:
        return "engine"
    return "frontend" if "gunicorn" in parent_command else "other"


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    ticks = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def measure(
    server: servers.RunningServer, script: Path, concurrency: int, seconds: float
) -> Sample:
    pids = process_tree(server.pid)
    roles = {pid: role_of(pid, pids) for pid in pids}
    before = cpu_ticks(pids)
    result = wrk.run_wrk(
        server.url + "/predict", script, concurrency=concurrency, duration_s=seconds
    )
    after = cpu_ticks(pids)
    answered = max(1, result.requests - result.errors)
    spent: dict[str, float] = {"frontend": 0.0, "engine": 0.0, "other": 0.0}
    for pid, ticks in after.items():
        role = roles[pid] if roles[pid] in spent else "other"
        spent[role] += (ticks - before.get(pid, ticks)) / _TICKS_PER_S
    spent["all"] = sum(spent.values())
    return Sample(
        result.requests_per_s,
        answered,
        result.errors,
        {role: seconds_spent / answered * 1e6 for role, seconds_spent in spent.items()},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    checkouts = {"this": here, "baseline": args.baseline.resolve()}
    request_bodies = bodies.mlp_bodies(np.random.default_rng(0), 64)
    samples: dict[tuple[str, str], list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="frontend-cost-") as folder:
        root = Path(folder)
        repository = configs.MLP_MODEL.package(root / "package")
        script = wrk.write_script(
            root / "wrk", request_bodies, {"Content-Type": "application/json"}
        )
        with servers.ServerPool() as pool:
            started = {}
            for mode in args.modes:
                for label, checkout in checkouts.items():
                    env = _env(checkout, repository, MODES[mode])
                    started[mode, label] = pool.start(
                        servers.checkout_command(checkout),
                        env,
                        root / f"{mode}-{label}.log",
                        180.0,
                        cwd=checkout,
                    )
            for server in started.values():
                servers.check_answers(
                    server.url, request_bodies[:2], {"Content-Type": "application/json"}
                )
                wrk.run_wrk(
                    server.url + "/predict", script, concurrency=args.concurrency, duration_s=2
                )
            for round_index in range(args.rounds):
                for (mode, label), server in started.items():
                    sample = measure(server, script, args.concurrency, args.duration_s)
                    samples.setdefault((mode, label), []).append(sample)
                    if args.verbose:
                        print(
                            f"round {round_index + 1} {mode} {label}: {_describe(sample)}",
                            flush=True,
                        )
    print(_table(samples, args.modes))
    return 0


def _env(checkout: Path, repository: Path, mode: Mapping[str, str]) -> dict[str, str]:
    env = servers.server_env(
        {
            "BATCHSERVE_MODEL_REPOSITORY": str(repository),
            "BATCHSERVE_MODEL_NAME": configs.MLP_MODEL.name,
            "BATCHSERVE_LOG_LEVEL": "warning",
            **mode,
        }
    )
    env["PYTHONPATH"] = str(checkout)
    return env


def _describe(sample: Sample) -> str:
    cpu = ", ".join(f"{role} {value:.0f}" for role, value in sample.cpu_us.items())
    return f"{sample.requests_per_s:.0f} req/s, errors {sample.errors}, CPU µs/request: {cpu}"


def _table(samples: dict[tuple[str, str], list[Sample]], modes: list[str]) -> str:
    lines = [
        "| mode | checkout | req/s | front ends µs/req | engine µs/req | all µs/req |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in modes:
        for label in ("baseline", "this"):
            runs = samples.get((mode, label), [])
            if not runs:
                continue
            median = {
                role: statistics.median(run.cpu_us[role] for run in runs)
                for role in ("frontend", "engine", "all")
            }
            rate = statistics.median(run.requests_per_s for run in runs)
            lines.append(
                f"| {mode} | {label} | {rate:,.0f} | {median['frontend']:.0f} | "
                f"{median['engine']:.0f} | {median['all']:.0f} |"
            )
        ratios = _ratios(samples.get((mode, "this"), []), samples.get((mode, "baseline"), []))
        if ratios:
            lines.append(f"| {mode} | this / baseline, median of rounds | {ratios} |  |  |  |")
    return "\n".join(lines)


def _ratios(this: list[Sample], baseline: list[Sample]) -> str:
    pairs = list(zip(this, baseline, strict=False))
    if not pairs:
        return ""
    rate = statistics.median(a.requests_per_s / b.requests_per_s for a, b in pairs)
    frontend = statistics.median(a.cpu_us["frontend"] / b.cpu_us["frontend"] for a, b in pairs)
    return f"req/s {rate:.2f}x, front-end CPU {frontend:.2f}x"


if __name__ == "__main__":
    time.tzset()
    sys.exit(main())
