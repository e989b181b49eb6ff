"""A front end's CPU per request under wrk, checkout against checkout: the HTTP ceiling
(``service.server.tuning.ceiling``, batchserve's real front end over a zero-cost engine, no
bridge) as a ``--workers`` front end runs it (gunicorn, ``BatchserveWorker``, one worker), from
each ``--checkout``, all started at once on 127.0.0.1 and loaded in turn, round after round
(the order rotated each round), so a busy shared machine weighs on every checkout alike.

    python -m loadtests.frontend_http_gap --checkout /tmp/main-head --checkout . \\
        --rounds 7 --duration-s 4

CPU per request: ``utime + stime`` of the gunicorn worker (``/proc``) over the run, divided
by the requests answered. Load: wrk, one thread, ``--concurrency`` connections (64), POST of
the MLP's bodies (one 256-float JSON instance each). Prints every run, then the medians and
the medians of the per-round ratios to the first checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests import bodies, configs, servers, wrk
from loadtests.frontend_cost import cpu_ticks, process_tree

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Run:
    """One wrk run against one checkout's front end."""

    checkout: str
    round: int
    requests_per_s: float
    answered: int
    cpu_us: float
    """The gunicorn worker's CPU per answered request (µs)."""
    p50_ms: float
    p99_ms: float
    load_1m: float


def ceiling_env(checkout: Path, repository: Path, metrics_dir: Path) -> dict[str, str]:
    """The ceiling of one gunicorn front end, importing ``service`` from ``checkout``."""
    env = servers.server_env(
        {
            "BATCHSERVE_MODEL_REPOSITORY": str(repository),
            "BATCHSERVE_MODEL_NAME": configs.MLP_MODEL.name,
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_WORKERS": "1",
            "BATCHSERVE_ENGINE_MODE": "process",
        }
    )
    env["PYTHONPATH"] = str(checkout)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return env


def worker_of(server: servers.RunningServer) -> int:
    """The gunicorn worker: the deepest process of the server's tree (ceiling, master,
    worker)."""
    tree = process_tree(server.pid)
    return tree[-1]


def measure(
    checkout: str,
    server: servers.RunningServer,
    script: Path,
    concurrency: int,
    duration_s: float,
    round_index: int,
) -> Run:
    worker = worker_of(server)
    before = cpu_ticks([worker])[worker]
    result = wrk.run_wrk(
        server.url + "/predict", script, concurrency=concurrency, duration_s=duration_s
    )
    spent = cpu_ticks([worker])[worker] - before
    answered = result.requests - result.errors
    return Run(
        checkout=checkout,
        round=round_index,
        requests_per_s=answered / result.duration_s if result.duration_s > 0 else 0.0,
        answered=answered,
        cpu_us=spent / TICKS_PER_S / max(1, answered) * 1e6,
        p50_ms=result.p50_ms,
        p99_ms=result.p99_ms,
        load_1m=os.getloadavg()[0],
    )


def summary(runs: list[Run], checkouts: list[str]) -> str:
    """Markdown: medians per checkout, and the median per-round ratio to the first."""
    lines = [
        "| checkout | req/s | CPU µs/request | ratio to first (rounds) | p50 ms | p99 ms | load |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    first = {run.round: run for run in runs if run.checkout == checkouts[0]}
    for checkout in checkouts:
        mine = [run for run in runs if run.checkout == checkout]
        ratios = [run.cpu_us / first[run.round].cpu_us for run in mine if run.round in first]
        lines.append(
            f"| {checkout} | {statistics.median(r.requests_per_s for r in mine):,.0f} "
            f"| {statistics.median(r.cpu_us for r in mine):.0f} "
            f"| {statistics.median(ratios):.2f} ({' · '.join(f'{r:.2f}' for r in ratios)}) "
            f"| {statistics.median(r.p50_ms for r in mine):.1f} "
            f"| {statistics.median(r.p99_ms for r in mine):.1f} "
            f"| {statistics.median(r.load_1m for r in mine):.2f} |"
        )
    return "\n".join(lines)


def run_rounds(args: argparse.Namespace) -> list[Run]:
    request_bodies = bodies.mlp_bodies(np.random.default_rng(0), 64)
    headers = {"Content-Type": "application/json"}
    command = [sys.executable, "-m", "service.server.tuning.ceiling", "--port", "{port}"]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="frontend-http-gap-") as folder:
        root = Path(folder)
        repository = configs.MLP_MODEL.package(root / "package")
        script = wrk.write_script(root / "wrk", request_bodies, headers)
        with servers.ServerPool() as pool:
            started: dict[str, servers.RunningServer] = {}
            for index, checkout in enumerate(args.checkout):
                name = f"{index}:{checkout}"
                metrics_dir = root / f"metrics-{index}"
                metrics_dir.mkdir()
                folder_of_checkout = Path(checkout).resolve()
                env = ceiling_env(folder_of_checkout, repository, metrics_dir)
                # In the checkout: ``python -m`` puts the working directory before PYTHONPATH.
                started[name] = pool.start(
                    command, env, root / f"{index}.log", 120.0, cwd=folder_of_checkout
                )
            for server in started.values():
                servers.check_answers(server.url, request_bodies[:2], headers)
                wrk.run_wrk(
                    server.url + "/predict", script, concurrency=args.concurrency, duration_s=2
                )
            names = list(started)
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in [*names[shift:], *names[:shift]]:
                    run = measure(
                        name, started[name], script, args.concurrency, args.duration_s, round_index
                    )
                    runs.append(run)
                    print(
                        f"round {round_index + 1} {name}: {run.requests_per_s:,.0f} req/s, "
                        f"{run.cpu_us:.0f} µs CPU/request, p50 {run.p50_ms:.1f} ms, "
                        f"p99 {run.p99_ms:.1f} ms, load {run.load_1m:.2f}",
                        flush=True,
                    )
    print(summary(runs, names))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", action="append", required=True, help="repeat: 1 or more")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20 or not 1 <= args.duration_s <= 30:
        parser.error(f"--rounds 1-20, --duration-s 1-30 (got {args.rounds}, {args.duration_s})")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    run_rounds(args)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
