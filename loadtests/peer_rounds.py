"""batchserve against TorchServe on the PEERS.md MLP, in one interleaved run.

Starts TorchServe (``loadtests.torchserve_peer``), batchserve ``--workers 2`` (``mlp-w2``)
and batchserve in one process (``mlp-single``) as ``loadtests.engine_cost`` starts them, all
at once, each on its own 127.0.0.1 port, the two models with the same weights. Before any
load it checks that TorchServe and batchserve give the same logits for the same bodies, and
warms TorchServe's JVM up (``warm_up_torchserve``) as batchserve gets the sweep's warm-up. Then
rounds: in each, for each concurrency, one wrk run (one thread, closed loop, the same
bodies) on each server in turn, the order reversed every other round, so that a machine
shared with others slows every server of a round alike. Per run it records req/s, p50, p99,
errors, rows per batch (batchserve's /metrics) and the CPU of the server's whole process tree
per answered request (``/proc``).

The report gives, per concurrency and server, the figures of each round, their medians, and
the ratio of batchserve's req/s to TorchServe's in the same round and its median. The rounds
stop at ``--rounds`` or when the next would end after ``--max-total-s``. Writes ``runs.csv``
and ``report.md`` to ``--out`` and prints the report.

    python -m loadtests.peer_rounds --rounds 3 --duration-s 5
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests import configs, engine_cost, servers, sweep, torchserve_peer
from loadtests.wrk import WrkResult, run_wrk, wrk_version

REFERENCE = "torchserve"
BATCHSERVE_CONFIGS = ("mlp-w2", "mlp-single")
MAX_ROUNDS = 20
CHECK_BODIES = 8
JVM_WARMUP_RUN_S = 3.0
JVM_SETTLED_TOLERANCE = 0.10


@dataclass(frozen=True)
class PeerRun:
    """One wrk run on one server."""

    label: str
    round: int
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    rows_per_batch: float | None
    cpu_us_per_request: float


@dataclass(frozen=True)
class Contender:
    label: str
    predict_url: str
    pid: int
    metrics_url: str | None
    """batchserve's base URL, whose /metrics counts rows per batch; None for TorchServe."""


def round_order(contenders: Sequence[Contender], round_index: int) -> list[Contender]:
    """The order of round ``round_index`` (0-based): as given, reversed every other round."""
    return list(contenders) if round_index % 2 == 0 else list(contenders)[::-1]


def ratios_per_round(runs: Sequence[PeerRun], label: str, concurrency: int) -> list[float]:
    """``label``'s req/s over TorchServe's in each round both ran at ``concurrency``."""
    reference = {
        r.round: r.requests_per_s
        for r in runs
        if r.label == REFERENCE and r.concurrency == concurrency
    }
    return [
        r.requests_per_s / reference[r.round]
        for r in runs
        if r.label == label and r.concurrency == concurrency and reference.get(r.round, 0) > 0
    ]


def settled(rates_per_s: Sequence[float], tolerance: float = JVM_SETTLED_TOLERANCE) -> bool:
    """Whether the last two warm-up rates are within ``tolerance`` of each other: the JVM's
    JIT has compiled TorchServe's hot paths (its req/s rose 5x over its first 12 s here)."""
    if len(rates_per_s) < 2 or rates_per_s[-1] <= 0:
        return False
    return abs(rates_per_s[-1] - rates_per_s[-2]) / rates_per_s[-1] <= tolerance


def warm_up_torchserve(
    url: str, script: Path, concurrency: int, least_s: float, most_s: float
) -> list[float]:
    """wrk runs of ``JVM_WARMUP_RUN_S`` at ``concurrency`` for at least ``least_s``, then
    until the rate settles, never past ``most_s``; the rates seen. A rate can hold still for
    two runs while the JIT is still at work: the floor keeps TorchServe from being measured
    cold."""
    rates: list[float] = []
    started_s = time.monotonic()
    while time.monotonic() + JVM_WARMUP_RUN_S <= started_s + most_s and (
        time.monotonic() < started_s + least_s or not settled(rates)
    ):
        result = run_wrk(url, script, concurrency=concurrency, duration_s=JVM_WARMUP_RUN_S)
        rates.append(result.requests_per_s)
        sweep.log(f"  torchserve warm-up: {result.requests_per_s:,.0f} req/s")
    return rates


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _rounds(values: Sequence[float], spec: str) -> str:
    return " · ".join(format(value, spec) for value in values)


def report_table(runs: Sequence[PeerRun]) -> str:
    """One markdown table per concurrency (highest first): each server's req/s, p50, p99,
    errors and CPU per request, per round and median, and its req/s ratio to TorchServe."""
    labels = list(dict.fromkeys(r.label for r in runs))
    lines: list[str] = []
    for concurrency in sorted({r.concurrency for r in runs}, reverse=True):
        lines += [
            f"### c={concurrency}",
            "",
            "| server | req/s per round | median req/s | p50 ms (median) | p99 ms per round "
            "| median p99 ms | errors | CPU µs/request (median) | ratio to TorchServe per round "
            "| median ratio |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for label in labels:
            at = [r for r in runs if r.label == label and r.concurrency == concurrency]
            if not at:
                continue
            ratios = [] if label == REFERENCE else ratios_per_round(runs, label, concurrency)
            lines.append(
                f"| {label} | {_rounds([r.requests_per_s for r in at], ',.0f')} "
                f"| {_median([r.requests_per_s for r in at]):,.0f} "
                f"| {_median([r.p50_ms for r in at]):.2f} "
                f"| {_rounds([r.p99_ms for r in at], '.1f')} "
                f"| {_median([r.p99_ms for r in at]):.1f} "
                f"| {sum(r.errors for r in at)} "
                f"| {_median([r.cpu_us_per_request for r in at]):.0f} "
                f"| {_rounds(ratios, '.2f') if ratios else '-'} "
                f"| {f'{_median(ratios):.2f}' if ratios else '-'} |"
            )
        lines.append("")
    return "\n".join(lines)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of ``pid`` and every process below it, every thread."""
    return sum(engine_cost.thread_cpu_by_role(pid).values())


def one_run(
    contender: Contender, script: Path, concurrency: int, round_number: int, duration_s: float
) -> PeerRun:
    before_rows = servers.batch_counters(contender.metrics_url) if contender.metrics_url else None
    before_cpu_s = tree_cpu_s(contender.pid)
    result: WrkResult = run_wrk(
        contender.predict_url, script, concurrency=concurrency, duration_s=duration_s
    )
    after_cpu_s = tree_cpu_s(contender.pid)
    after_rows = servers.batch_counters(contender.metrics_url) if contender.metrics_url else None
    rows_per_batch = None
    if before_rows and after_rows and after_rows[1] > before_rows[1]:
        rows_per_batch = (after_rows[0] - before_rows[0]) / (after_rows[1] - before_rows[1])
    run = PeerRun(
        label=contender.label,
        round=round_number,
        concurrency=concurrency,
        requests_per_s=result.requests_per_s,
        p50_ms=result.p50_ms,
        p99_ms=result.p99_ms,
        errors=result.errors,
        rows_per_batch=rows_per_batch,
        cpu_us_per_request=(after_cpu_s - before_cpu_s) / max(1, result.requests) * 1e6,
    )
    sweep.log(
        f"  r{round_number} c={concurrency} {run.label}: {run.requests_per_s:,.0f} req/s, "
        f"p50 {run.p50_ms:.2f} ms, p99 {run.p99_ms:.1f} ms, {run.errors} errors, "
        f"CPU {run.cpu_us_per_request:.0f} µs/request"
        + (f", {rows_per_batch:.1f} rows/batch" if rows_per_batch is not None else "")
    )
    return run


def measure(args: argparse.Namespace, notes: list[str]) -> list[PeerRun]:
    """Start every server, check the answers, then the interleaved rounds; ``notes`` gets the
    load average around each round and why the rounds stopped early, if they did."""
    started_s = time.monotonic()
    workload = configs.MLP
    sweep_args = sweep.parse_args(
        ["--configs", *BATCHSERVE_CONFIGS, "--concurrency", *map(str, args.concurrency),
         "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s)]
    )  # fmt: skip
    runs: list[PeerRun] = []
    bin_dir = torchserve_peer.ensure_venv(args.venv)
    with tempfile.TemporaryDirectory(prefix="peer-rounds-") as scratch:
        harness = sweep.Sweep(sweep_args, args.out, Path(scratch))
        repository = harness.ensure_repository(configs.MLP_MODEL)
        weights = torchserve_peer.packaged_weights(repository, configs.MLP_MODEL.name)
        folder = Path(scratch) / "torchserve"
        store = torchserve_peer.archive(bin_dir, weights, folder)
        bodies = workload.bodies()
        headers = workload.headers()
        script = harness.script(workload)
        sweep.log("start torchserve")
        with (
            servers.ServerPool() as pool,
            torchserve_peer.serving(bin_dir, store, folder, bodies[0], headers) as torchserve,
        ):
            contenders = [Contender(REFERENCE, torchserve.predict_url, torchserve.pid, None)]
            for name in BATCHSERVE_CONFIGS:
                sweep.log(f"start {name}")
                started = harness.start_contender(pool, configs.CONFIGURATIONS[name], None)
                url = started.server.url
                contenders.append(Contender(name, url + "/predict", started.server.pid, url))
            largest = torchserve_peer.check_same_answers(
                torchserve.predict_url, contenders[1].predict_url, bodies[:CHECK_BODIES], headers
            )
            notes.append(
                f"Answers checked before the load: TorchServe and batchserve give the same "
                f"logits for {CHECK_BODIES} bodies (largest difference {largest:.1e})."
            )
            rates = warm_up_torchserve(
                torchserve.predict_url,
                script,
                max(args.concurrency),
                args.jvm_warmup_least_s,
                args.jvm_warmup_s,
            )
            notes.append(
                "TorchServe warm-up (the JVM's JIT), req/s per run of "
                f"{JVM_WARMUP_RUN_S:.0f} s at c={max(args.concurrency)}: {_rounds(rates, ',.0f')}"
                + ("" if settled(rates) else f" (not settled within {args.jvm_warmup_s:.0f} s)")
                + "."
            )
            round_s = len(contenders) * sum(args.duration_s + 1 for _ in args.concurrency)
            for round_index in range(args.rounds):
                if time.monotonic() - started_s + round_s > args.max_total_s:
                    notes.append(
                        f"Stopped after {round_index} round(s): the next would end after "
                        f"--max-total-s {args.max_total_s:.0f}."
                    )
                    break
                load_before = os.getloadavg()[0]
                for concurrency in args.concurrency:
                    for contender in round_order(contenders, round_index):
                        runs.append(
                            one_run(contender, script, concurrency, round_index + 1,
                                    args.duration_s)
                        )  # fmt: skip
                notes.append(
                    f"Round {round_index + 1}: load average (1 min) {load_before:.1f} before, "
                    f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs."
                )
    return runs


def write(runs: Sequence[PeerRun], out: Path, header: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["label", "round", "c", "req_s", "p50_ms", "p99_ms", "errors", "rows_per_batch",
             "cpu_us_per_request"]
        )  # fmt: skip
        for r in runs:
            writer.writerow(
                [r.label, r.round, r.concurrency, round(r.requests_per_s), round(r.p50_ms, 3),
                 round(r.p99_ms, 3), r.errors,
                 "" if r.rows_per_batch is None else round(r.rows_per_batch, 1),
                 round(r.cpu_us_per_request, 1)]
            )  # fmt: skip
    report = header + "\n\n" + report_table(runs)
    (out / "report.md").write_text(report)
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=torchserve_peer.DEFAULT_VENV)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--duration-s", type=float, default=5.0, help="wrk time cap per run")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument(
        "--jvm-warmup-least-s", type=float, default=15.0, help="TorchServe's warm-up, at least"
    )
    parser.add_argument(
        "--jvm-warmup-s", type=float, default=40.0, help="most TorchServe's warm-up may take"
    )
    parser.add_argument("--max-total-s", type=float, default=900.0, help="no round ends later")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/peers"))
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds takes 1 to {MAX_ROUNDS}, got {args.rounds}")
    if not 1 <= args.duration_s <= 60:
        parser.error(f"--duration-s takes 1 to 60, got {args.duration_s}")
    return args


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds the servers' blocks, which stop them


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    java = torchserve_peer.check_java()
    notes: list[str] = []
    runs = measure(args, notes)
    header = "\n".join(
        [
            "## batchserve against TorchServe 0.12.0, interleaved",
            "",
            f"{args.rounds} round(s), wrk ({wrk_version()}) one thread, "
            f"{args.duration_s:.0f} s per run, c={' and '.join(map(str, args.concurrency))}; "
            f"TorchServe: one Python worker, batches of up to "
            f"{torchserve_peer.MAX_BATCH_REQUESTS} requests, maxBatchDelay "
            f"{torchserve_peer.MAX_BATCH_DELAY_MS} ms, {java}. A machine shared with others: "
            "compare ratios within a round and their medians, not absolute figures.",
            "",
            *(f"- {note}" for note in notes),
        ]
    )
    print(write(runs, args.out, header))
    print(f"wrote {args.out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
