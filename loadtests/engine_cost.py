"""What the front-end/engine split costs, against a baseline checkout, in one command.

Starts each configuration (``mlp-single``, ``mlp-w2``, ``digits-batched``, ``digits-w2`` by
default) on this checkout and on ``--baseline-checkout``, all at once, then measures them in
interleaved rounds (each round: one wrk run per concurrency on each server in turn, the order
reversed every other round), so that a machine shared with others slows both sides of a pair
alike. For every run it records req/s, p50 and p99, rows per batch, and the CPU each role of
the server used per answered request, from ``/proc`` (utime + stime of each thread):

  - ``front end``: the front-end processes (gunicorn workers), or in one process its main
    thread (the event loop, which there also runs the batcher and the bridge-less engine);
  - ``engine loop``: the engine process's main thread (bridge, batcher);
  - ``device``: every other thread of a process that runs the model (the device thread and
    torch's threads: collation, the forward, splitting);
  - ``other``: the supervisor or gunicorn's master;
  - ``forward (est.)``: the model's own CPU per row at the batch size seen, measured in this
    process (one torch thread), times rows per request: what no server can avoid.

Beside the CPU: a batch's wall time on the device thread (collation, forward, split: the mean
of ``batchserve_inference_duration_seconds`` over the run) and how much of it the device
threads spent ready to run but waiting for a CPU (``/proc/.../schedstat``, per batch). On a
shared 2-core host the second is often as large as the forward's own CPU: a preempted forward
holds up every request of its batch.

Ratios (ours / baseline) are given per round and as their median. Writes ``runs.csv`` and
``report.md`` to ``--out``. ``--baseline-of`` starts the baseline only for the configurations
named (the others are compared with the first of ``--configs``).

    python -m loadtests.engine_cost --baseline-checkout /path/to/12e05c8 --rounds 3
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtests import configs, memory, servers, sweep
from loadtests.report import BASELINE_SUFFIX, Point

ROLES = ("front end", "engine loop", "device", "other")
#: A batch of more than this many rows (a bucket edge of the batch size histogram) counts as
#: full in ``Run.full_batch_share``: the issue's bimodal fill was 40 or 63 rows of 64.
FULL_BATCH_OVER_ROWS = 48.0
#: The server's histogram of one batch's wall time on the device thread.
BATCH_WALL_HISTOGRAM = "batchserve_inference_duration_seconds"
DEFAULT_CONFIGS = ("mlp-single", "mlp-w2", "digits-batched", "digits-w2")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of each role in ``root``'s process tree (see the module text)."""
    return _by_role(root, _task_cpu_s)


def thread_wait_by_role(root: int) -> dict[str, float]:
    """Seconds so far that each role's threads in ``root``'s tree were ready to run but waited
    for a CPU (``/proc/.../schedstat``'s run-queue time): on a shared host, where a batch's
    wall time goes beyond its CPU."""
    return _by_role(root, _task_run_queue_s)


def _by_role(root: int, seconds_of: Callable[[int, int], float]) -> dict[str, float]:
    parents = memory._parents(memory.PROC)
    pids = memory.descendants(root, parents)
    commands = {pid: memory._command(pid, memory.PROC) for pid in pids}
    roles = memory.roles(root, parents, commands)
    runs_model = {pid for pid, role in roles.items() if role in ("engine", "server")}
    if not any(role == "engine" for role in roles.values()):
        runs_model |= {pid for pid, role in roles.items() if role == "gunicorn worker"}
    used = dict.fromkeys(ROLES, 0.0)
    for pid in pids:
        for task in _tasks(pid):
            seconds = seconds_of(pid, task)
            role = roles[pid]
            if pid in runs_model and task != pid:
                used["device"] += seconds
            elif role == "engine":
                used["engine loop"] += seconds
            elif role in ("server", "gunicorn worker"):
                used["front end"] += seconds
            else:
                used["other"] += seconds
    return used


def _tasks(pid: int) -> list[int]:
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _task_cpu_s(pid: int, task: int) -> float:
    try:
        text = Path(f"/proc/{pid}/task/{task}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def _task_run_queue_s(pid: int, task: int) -> float:
    try:
        text = Path(f"/proc/{pid}/task/{task}/schedstat").read_text()
    except OSError:
        return 0.0
    return int(text.split()[1]) / 1e9


BASELINE_MLP = """
import subprocess, sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from service.model_store import Architecture, ModelStore, TensorSpec, instantiate

root = Path(sys.argv[1])
architecture = Architecture(import_path="peer_mlp:PeerMLP")
torch.manual_seed(0)
module = instantiate(architecture)
weights = root / "mlp.safetensors"
save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
ModelStore(root / "models").package(
    name="mlp",
    artifact=weights,
    format="safetensors",
    architecture=architecture,
    inputs=(TensorSpec(name="features", dtype="float32", shape=(-1, 256)),),
    outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, 10)),),
)
"""


def baseline_mlp_repository(checkout: Path, root: Path) -> tuple[Path, Path]:
    """The MLP packaged by the baseline's own code (its manifest schema), its architecture a
    copy of ``service/models/mlp.py`` on a folder the baseline server gets on its path;
    the repository and that folder."""
    root.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve().parents[1] / "service" / "models" / "mlp.py"
    (root / "peer_mlp.py").write_text(source.read_text())
    env = os.environ | {"PYTHONPATH": f"{checkout}:{root}"}
    subprocess.run(
        [sys.executable, "-c", BASELINE_MLP, str(root)], cwd=checkout, env=env, check=True
    )
    return root / "models", root


def forward_cpu_s_per_row(workload: configs.Workload, rows: int) -> float:
    """The model's forward CPU per row at ``rows`` per batch, one torch thread, here."""
    import torch

    torch.set_num_threads(1)
    if workload.name == "mlp":
        from service.models.mlp import PeerMLP

        model: torch.nn.Module = PeerMLP()
        batch = torch.rand(rows, 256)
    else:
        from service.models.digits import DigitsCNN

        model = DigitsCNN()
        batch = torch.rand(rows, 8, 8)
    with torch.inference_mode():
        for _ in range(20):
            model(batch)
        started_s = time.process_time()
        repeats = 200
        for _ in range(repeats):
            model(batch)
        return (time.process_time() - started_s) / (repeats * rows)


@dataclass
class Run:
    label: str
    configuration: str
    round: int
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    rows_per_batch: float | None
    cpu_us: dict[str, float] = field(default_factory=dict)
    """CPU per answered request by role, in µs."""
    full_batch_share: float | None = None
    """Share of the run's batches with more than ``FULL_BATCH_OVER_ROWS`` rows (/metrics)."""
    device_wait_ms: float | None = None
    """Time the device thread(s) waited for a CPU (run queue), per batch."""
    batch_wall_ms: float | None = None
    """Wall time of one batch on the device thread (collate, forward, split), the run's mean
    (``batchserve_inference_duration_seconds``): beside the forward's CPU, how long a batch
    held the device, waits for the GIL and the CPU included."""


def measure(
    args: argparse.Namespace, after_round: Callable[[int], None] = lambda round_number: None
) -> list[Run]:
    """Every run of every round; ``after_round(n)`` is called once round ``n`` is done, with
    every server still up and idle (another measurement can take its turn there)."""
    sweep_args = sweep.parse_args(
        ["--configs", *args.configs, "--concurrency", *map(str, args.concurrency),
         "--duration-s", str(args.duration_s), "--repeats", str(args.rounds),
         "--warmup-s", str(args.warmup_s), "--baseline-checkout", str(args.baseline_checkout)]
    )  # fmt: skip
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="engine-cost-") as scratch:
        harness = sweep.Sweep(sweep_args, args.out, Path(scratch))
        baseline = sweep.Baseline(args.baseline_checkout)
        with servers.ServerPool() as pool:
            contenders = []
            if (args.baseline_checkout / "service" / "model_store.py").exists():
                mlp_repository, mlp_path = baseline_mlp_repository(
                    args.baseline_checkout, Path(scratch) / "baseline-mlp"
                )
            else:  # a checkout of today's layout (a later main): it reads our repository
                mlp_repository = harness.ensure_repository(configs.MLP_MODEL)
                mlp_path = Path(scratch)
            for name in args.configs:
                configuration = configs.CONFIGURATIONS[name]
                sweep.log(f"start {name}")
                contenders.append(harness.start_contender(pool, configuration, None))
                if args.ours_only or (args.baseline_of and name not in args.baseline_of):
                    continue
                sweep.log(f"start {name}{BASELINE_SUFFIX}")
                contenders.append(
                    start_baseline(harness, pool, configuration, baseline, mlp_repository, mlp_path)
                )
            for round_index in range(args.rounds):
                order = contenders if round_index % 2 == 0 else contenders[::-1]
                for concurrency in args.concurrency:
                    for contender in order:
                        runs.append(one_run(harness, contender, concurrency, round_index + 1))
                after_round(round_index + 1)
    return runs


def start_baseline(
    harness: sweep.Sweep,
    pool: servers.ServerPool,
    configuration: configs.Configuration,
    baseline: sweep.Baseline,
    mlp_repository: Path,
    mlp_path: Path,
) -> sweep.Contender:
    """``configuration`` on the baseline checkout, the MLP from its own repository."""
    env = harness.env_for(configuration)
    env["PYTHONPATH"] = f"{baseline.checkout}:{mlp_path}"
    if configuration.workload.name == "mlp":
        env["BATCHSERVE_MODEL_REPOSITORY"] = str(mlp_repository)
    else:
        env.pop("BATCHSERVE_MODEL_REPOSITORY", None)
    label = configuration.name + BASELINE_SUFFIX
    log_path = harness.out / "logs" / f"{label}.log"
    server = pool.start(
        baseline.command, env, log_path, configuration.ready_timeout_s, cwd=baseline.checkout
    )
    harness.prepare(server.url, configuration.workload)
    points = [
        Point(label=label, workload=configuration.workload.name, concurrency=c, ceiling="-")
        for c in harness.args.concurrency
    ]
    return sweep.Contender(configuration, label, server, points, [])


def one_run(
    harness: sweep.Sweep, contender: sweep.Contender, concurrency: int, round_number: int
) -> Run:
    configuration = contender.configuration
    point = Point(
        label=contender.label,
        workload=configuration.workload.name,
        concurrency=concurrency,
        ceiling="-",
    )
    buckets_before = servers.batch_size_buckets(contender.server.url)
    batches_before = servers.histogram_totals(contender.server.url, BATCH_WALL_HISTOGRAM)
    before = thread_cpu_by_role(contender.server.pid)
    waited_before = thread_wait_by_role(contender.server.pid)
    result, rows = harness.measure_run(
        contender.server.url, harness.script(configuration.workload), point
    )
    after = thread_cpu_by_role(contender.server.pid)
    waited_after = thread_wait_by_role(contender.server.pid)
    buckets_after = servers.batch_size_buckets(contender.server.url)
    batches_after = servers.histogram_totals(contender.server.url, BATCH_WALL_HISTOGRAM)
    answered = max(1, result.requests)
    run = Run(
        label=contender.label,
        configuration=configuration.name,
        round=round_number,
        concurrency=concurrency,
        requests_per_s=result.requests_per_s,
        p50_ms=result.p50_ms,
        p99_ms=result.p99_ms,
        rows_per_batch=rows,
        cpu_us={role: (after[role] - before[role]) / answered * 1e6 for role in ROLES},
        full_batch_share=servers.share_of_batches_over(
            buckets_before, buckets_after, FULL_BATCH_OVER_ROWS
        ),
        batch_wall_ms=mean_between(batches_before, batches_after, scale=1e3),
        device_wait_ms=per_batch_ms(
            waited_after["device"] - waited_before["device"], batches_before, batches_after
        ),
    )
    sweep.log(
        f"  r{round_number} c={concurrency} {run.label}: {run.requests_per_s:,.0f} req/s, "
        f"p50 {run.p50_ms:.2f} ms, rows/batch {rows or 0:.1f} "
        f"({run.full_batch_share or 0:.0%} over {FULL_BATCH_OVER_ROWS:.0f}), "
        f"batch wall {run.batch_wall_ms or 0:.2f} ms "
        f"(device thread waited for a CPU {run.device_wait_ms or 0:.2f} ms), "
        + ", ".join(f"{role} {us:.0f} µs" for role, us in run.cpu_us.items())
    )
    return run


def mean_between(
    before: tuple[float, float] | None, after: tuple[float, float] | None, scale: float = 1.0
) -> float | None:
    """The mean of a histogram's observations between two (sum, count) readings, times
    ``scale``; None when either is missing or nothing was observed between them."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * scale


def per_batch_ms(
    seconds: float, before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """``seconds`` spread over the batches counted between two (sum, count) readings, in ms."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return seconds / (after[1] - before[1]) * 1e3


def write(runs: Sequence[Run], out: Path, forward_us: dict[str, float], notes: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["label", "round", "c", "req_s", "p50_ms", "p99_ms", "rows_per_batch",
             "full_batch_share", "batch_wall_ms", "device_wait_ms",
             *(f"cpu_us_{role.replace(' ', '_')}" for role in ROLES)]
        )  # fmt: skip
        for run in runs:
            writer.writerow(
                [run.label, run.round, run.concurrency, round(run.requests_per_s),
                 round(run.p50_ms, 3), round(run.p99_ms, 3),
                 "" if run.rows_per_batch is None else round(run.rows_per_batch, 1),
                 "" if run.full_batch_share is None else round(run.full_batch_share, 3),
                 "" if run.batch_wall_ms is None else round(run.batch_wall_ms, 3),
                 "" if run.device_wait_ms is None else round(run.device_wait_ms, 3),
                 *(round(run.cpu_us[role], 1) for role in ROLES)]
            )  # fmt: skip
    lines = ["# Engine cost: this checkout against the baseline, interleaved", "", notes, ""]
    labels = list(dict.fromkeys(run.configuration for run in runs))
    for concurrency in sorted({run.concurrency for run in runs}, reverse=True):
        lines += [f"## c={concurrency}", "",
                  "| configuration | req/s ours (rounds) | req/s reference | ratio per round | "
                  "median ratio | p50 ms ours / base | rows/batch ours (rounds) | "
                  "batch wall ms ours (rounds) | of it waiting for a CPU, ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name in labels:
            ours = [r for r in runs if r.label == name and r.concurrency == concurrency]
            reference = name + BASELINE_SUFFIX
            if not any(r.label == reference for r in runs):  # no baseline: against the first
                reference = labels[0]
            base = [r for r in runs if r.label == reference and r.concurrency == concurrency]
            ratios = [o.requests_per_s / b.requests_per_s for o, b in zip(ours, base, strict=False)
                      if b.requests_per_s]  # fmt: skip
            lines.append(
                f"| {name} | {' · '.join(f'{r.requests_per_s:,.0f}' for r in ours)} | "
                f"{' · '.join(f'{r.requests_per_s:,.0f}' for r in base)} | "
                f"{' · '.join(f'{x:.2f}' for x in ratios)} | "
                f"{statistics.median(ratios) if ratios else float('nan'):.2f} | "
                f"{statistics.median(r.p50_ms for r in ours):.2f} / "
                f"{statistics.median(r.p50_ms for r in base):.2f} | "
                f"{' · '.join(f'{r.rows_per_batch or 0:.1f}' for r in ours)} | "
                f"{' · '.join(f'{r.batch_wall_ms or 0:.2f}' for r in ours)} | "
                f"{' · '.join(f'{r.device_wait_ms or 0:.2f}' for r in ours)} |"
            )
        lines.append("")
    lines += ["## CPU per answered request by role (µs, median over rounds, c=64)", "",
              "| server | " + " | ".join(ROLES) + " | total | forward (est.) |",
              "| --- |" + " --- |" * (len(ROLES) + 2)]  # fmt: skip
    for label in sorted({run.label for run in runs}):
        at = [
            r
            for r in runs
            if r.label == label and r.concurrency == max(r.concurrency for r in runs)
        ]
        medians = {role: statistics.median(r.cpu_us[role] for r in at) for role in ROLES}
        workload = configs.CONFIGURATIONS[at[0].configuration].workload.name
        lines.append(
            f"| {label} | "
            + " | ".join(f"{medians[role]:.0f}" for role in ROLES)
            + f" | {sum(medians.values()):.0f} | {forward_us[workload]:.0f} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")


def forward_us_per_row(configuration_names: Sequence[str], rows: int = 64) -> dict[str, float]:
    """``forward_cpu_s_per_row`` in µs for each workload of the named configurations."""
    workloads = {
        (workload := configs.CONFIGURATIONS[name].workload).name: workload
        for name in configuration_names
    }
    return {name: forward_cpu_s_per_row(w, rows) * 1e6 for name, w in workloads.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-checkout", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/engine-cost"))
    parser.add_argument(
        "--ours-only", action="store_true", help="no baseline servers: compare --configs"
    )
    parser.add_argument(
        "--baseline-of",
        nargs="+",
        default=[],
        metavar="CONFIG",
        help="start the baseline only for these of --configs (the others compare to the first)",
    )
    args = parser.parse_args(argv)
    args.baseline_checkout = args.baseline_checkout.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runs = measure(args)
    forward_us = forward_us_per_row(args.configs)
    notes = (
        f"{args.rounds} interleaved round(s), wrk one thread, {args.duration_s:.0f} s per run, "
        f"baseline {args.baseline_checkout}; a machine shared with other engineers: compare "
        f"ratios within a round and their medians, not absolute figures. "
        f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
    )
    write(runs, args.out, forward_us, notes)
    print(f"wrote {args.out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
