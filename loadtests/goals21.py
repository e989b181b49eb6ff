"""Issue 21's goals 1-5 in one command: this checkout against a baseline checkout, interleaved.

One run of ``loadtests.engine_cost`` (every server up at once, measured in rounds, the order
reversed every other round; req/s, p50, rows per batch from ``/metrics`` and CPU per request
by role from ``/proc``) for the MLP (``mlp-single``, ``mlp-w2``) and, with ``--digits``, the
digits model (``digits-batched``, ``digits-w2``), each against the same configuration on the
baseline; after each round, while those servers idle, one ``loadtests.capacity`` run (one
engine pinned to one CPU, synthetic front ends over the real bridge, a zero-cost model).
Then one table: each goal, its target, the measured figure (the median over the rounds, or
the lowest round where the goal says "every round"), each round's value, and met or missed.

TorchServe is not installed here: goal 1's "≥ 2.5x TorchServe" is this run's ratio to the
baseline's ``--workers 2`` times the baseline's ratio to TorchServe measured in ``PEERS.md``
(the same machine, the same runs): an estimate, labelled as such, not a rerun.

Writes ``goals.md`` and ``goals.json`` (every run, every capacity run, the goals) and the
engine-cost report (``engine-cost/``) to ``--out``. A machine shared with others moves every
absolute figure: read the ratios, and rerun on a quiet host before quoting one.

    python -m loadtests.goals21 --baseline-checkout /path/to/12e05c8
    python -m loadtests.goals21 --baseline-checkout /path/to/12e05c8 --digits --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtests import engine_cost, sweep
from loadtests.engine_cost import Run
from loadtests.report import BASELINE_SUFFIX

REPO_ROOT = Path(__file__).resolve().parent.parent
HIGH, LOW = 64, 1
"""The concurrencies of the goals: c=64 (throughput, CPU, batch fill) and c=1 (latency)."""
#: (one process, ``--workers 2``) configurations of each workload.
FAMILIES: dict[str, tuple[str, str]] = {
    "mlp": ("mlp-single", "mlp-w2"),
    "digits": ("digits-batched", "digits-w2"),
}
#: PEERS.md, two runs on 2026-12-01 on this 2-core machine (wrk c=64, the MLP workload):
#: batchserve 12e05c8 ``--workers 2`` served 5,423 and 7,390 req/s, TorchServe 0.12.0 (one
#: worker) 2,520 and 2,807 in the same runs. Not rerun here: TorchServe is not installed.
PEERS_OLD_W2_OVER_TORCHSERVE = (5_423 / 2_520, 7_390 / 2_807)
CAPACITY_FRONTENDS, CAPACITY_PER_FRAME, CAPACITY_WINDOW = 3, 64, 4
#: Cores of the GPU host the capacity model is worked out for: one engine, the rest front ends.
GPU_HOST_CORES = 16
MAX_ROUNDS, MAX_DURATION_S = 20, 60.0


@dataclass(frozen=True)
class Capacity:
    """One ``loadtests.capacity`` run: one engine core fed by synthetic front ends."""

    round: int
    requests_per_s: float
    engine_cpu_us_per_request: float
    requests_per_s_per_engine_core: float


@dataclass(frozen=True)
class Goal:
    """One line of the table."""

    goal: str
    what: str
    target: str
    unit: str
    rounds: tuple[float, ...]
    value: float | None
    """The figure judged: the median of ``rounds``, or as ``what`` says."""
    met: bool | None
    """None: not a target (a figure the issue asks to publish), or nothing measured."""
    note: str = ""


def at_least(bound: float) -> Callable[[float], bool]:
    return lambda value: value >= bound


def at_most(bound: float) -> Callable[[float], bool]:
    return lambda value: value <= bound


def judged(
    goal: str,
    what: str,
    target: str,
    unit: str,
    rounds: Sequence[float],
    check: Callable[[float], bool] | None,
    *,
    lowest: bool = False,
    note: str = "",
) -> Goal:
    """A goal from its per-round values: the median (or, ``lowest``, the smallest) judged by
    ``check``; no values, no verdict."""
    value = (min(rounds) if lowest else statistics.median(rounds)) if rounds else None
    met = None if value is None or check is None else check(value)
    return Goal(goal, what, target, unit, tuple(rounds), value, met, note)


def by_round(runs: Sequence[Run], label: str, concurrency: int) -> dict[int, Run]:
    return {r.round: r for r in runs if r.label == label and r.concurrency == concurrency}


def paired(
    runs: Sequence[Run],
    label: str,
    other: str,
    concurrency: int,
    figure: Callable[[Run, Run], float],
) -> list[float]:
    """``figure(ours, other's)`` for every round both ran, in round order."""
    ours, theirs = by_round(runs, label, concurrency), by_round(runs, other, concurrency)
    return [figure(ours[n], theirs[n]) for n in sorted(ours.keys() & theirs.keys())]


def each(
    runs: Sequence[Run], label: str, concurrency: int, figure: Callable[[Run], float]
) -> list[float]:
    found = by_round(runs, label, concurrency)
    return [figure(found[n]) for n in sorted(found)]


def throughput_ratio(ours: Run, theirs: Run) -> float:
    return ours.requests_per_s / theirs.requests_per_s if theirs.requests_per_s else 0.0


def total_cpu_us(run: Run) -> float:
    return sum(run.cpu_us.values())


def cpu_ratio(ours: Run, theirs: Run) -> float:
    return total_cpu_us(ours) / total_cpu_us(theirs) if total_cpu_us(theirs) else 0.0


def p50_difference_ms(ours: Run, theirs: Run) -> float:
    return ours.p50_ms - theirs.p50_ms


def evaluate(
    runs: Sequence[Run], capacities: Sequence[Capacity], forward_us: Mapping[str, float]
) -> list[Goal]:
    """Goals 1-5 from the runs of one interleaved measurement (labels as ``engine_cost``'s:
    a configuration's name, ``@baseline`` for the baseline's) and its capacity runs."""
    labels = {run.label for run in runs}
    families = [name for name, pair in FAMILIES.items() if set(pair) <= labels]
    goals = [goal for family in families for goal in goal_1(runs, family)]
    goals += [goal for family in families for goal in goal_2(runs, family)]
    goals += [goal for family in families for goal in goal_3(runs, family, forward_us)]
    goals += capacity_goals(runs, capacities)
    goals += [goal for family in families for goal in goal_5(runs, family)]
    return goals


def goal_1(runs: Sequence[Run], family: str) -> list[Goal]:
    """``--workers 2`` against the old ``--workers 2``; for the MLP, against TorchServe
    through PEERS.md's ratio (not rerun)."""
    _, w2 = FAMILIES[family]
    ratios = paired(runs, w2, w2 + BASELINE_SUFFIX, HIGH, throughput_ratio)
    goals = [
        judged(
            "1",
            f"{family}: `--workers 2` req/s / old `--workers 2`, c=64",
            "≥ 1.0x",
            "x",
            ratios,
            at_least(1.0),
        )
    ]
    if family == "mlp":
        peers = statistics.median(PEERS_OLD_W2_OVER_TORCHSERVE)
        measured = " and ".join(f"{x:.2f}" for x in PEERS_OLD_W2_OVER_TORCHSERVE)
        goals.append(
            judged(
                "1",
                "mlp: `--workers 2` / TorchServe (ESTIMATE: TorchServe not rerun here)",
                "≥ 2.5x",
                "x",
                [ratio * peers for ratio in ratios],
                at_least(2.5),
                note="this run's ratio to the old `--workers 2` times the old `--workers 2` / "
                f"TorchServe measured in PEERS.md ({measured} in its two runs, median "
                f"{peers:.2f})",
            )
        )
    return goals


def goal_2(runs: Sequence[Run], family: str) -> list[Goal]:
    """One process against the old one process, and its batch fill in every round."""
    single, _ = FAMILIES[family]
    shares = each(runs, single, HIGH, lambda run: run.full_batch_share or 0.0)
    return [
        judged(
            "2",
            f"{family}: one process req/s / old one process, c=64",
            "≥ 1.0x",
            "x",
            paired(runs, single, single + BASELINE_SUFFIX, HIGH, throughput_ratio),
            at_least(1.0),
        ),
        judged(
            "2",
            f"{family}: one process, rows per batch at c=64 (lowest round)",
            "≥ 60 of 64",
            "rows",
            each(runs, single, HIGH, lambda run: run.rows_per_batch or 0.0),
            at_least(60),
            lowest=True,
            note="batches of more than 48 rows, per round: "
            + " / ".join(f"{share:.0%}" for share in shares),
        ),
    ]


def goal_3(runs: Sequence[Run], family: str, forward_us: Mapping[str, float]) -> list[Goal]:
    """CPU per request: all processes against the old ``--workers 2``, the engine beyond the
    model's forward, a front end."""
    _, w2 = FAMILIES[family]
    forward = forward_us.get(family, 0.0)

    def engine_beyond_forward(run: Run) -> float:
        return run.cpu_us["engine loop"] + run.cpu_us["device"] - forward

    return [
        judged(
            "3",
            f"{family}: CPU per request, all processes, `--workers 2` / old, c=64",
            "≤ 1.1x",
            "x",
            paired(runs, w2, w2 + BASELINE_SUFFIX, HIGH, cpu_ratio),
            at_most(1.1),
        ),
        judged(
            "3",
            f"{family}: the engine beyond the forward (engine loop + device - forward est.)",
            "≤ 25 µs",
            "µs",
            each(runs, w2, HIGH, engine_beyond_forward),
            at_most(25),
            note=f"forward (est.) {forward:.0f} µs a row at batch 64, one torch thread",
        ),
        judged(
            "3",
            f"{family}: a front end, per request it serves",
            "≤ 150 µs",
            "µs",
            each(runs, w2, HIGH, lambda run: run.cpu_us["front end"]),
            at_most(150),
        ),
    ]


def goal_5(runs: Sequence[Run], family: str) -> list[Goal]:
    """c=1 p50: one process against the old one, ``--workers 2`` against one process."""
    single, w2 = FAMILIES[family]
    return [
        judged(
            "5",
            f"{family}: c=1 p50, one process - old one process",
            "≤ +0.05 ms",
            "ms",
            paired(runs, single, single + BASELINE_SUFFIX, LOW, p50_difference_ms),
            at_most(0.05),
        ),
        judged(
            "5",
            f"{family}: c=1 p50, `--workers 2` - one process",
            "≤ +0.15 ms",
            "ms",
            paired(runs, w2, single, LOW, p50_difference_ms),
            at_most(0.15),
        ),
    ]


def capacity_goals(runs: Sequence[Run], capacities: Sequence[Capacity]) -> list[Goal]:
    """Goal 4 and the capacity model: how many front ends (at the MLP ``--workers 2`` front
    end's CPU per request in the same round) one engine core feeds, and where a
    ``GPU_HOST_CORES``-core host (one core of engine, the rest front ends) saturates."""
    front_end_us = {n: run.cpu_us["front end"] for n, run in by_round(runs, "mlp-w2", HIGH).items()}
    paired_rounds = [c for c in capacities if front_end_us.get(c.round, 0.0) > 0]
    fed = [c.requests_per_s_per_engine_core * front_end_us[c.round] / 1e6 for c in paired_rounds]
    fronts = GPU_HOST_CORES - 1
    host = [
        min(c.requests_per_s_per_engine_core, fronts * 1e6 / front_end_us[c.round])
        for c in paired_rounds
    ]
    limit = ""
    if fed:
        limit = "the engine" if statistics.median(fed) < fronts else "the front ends"
    return [
        judged(
            "4",
            "one engine core, zero-cost model: req/s per engine core",
            "≥ 50,000",
            "req/s",
            [c.requests_per_s_per_engine_core for c in capacities],
            at_least(50_000),
            note="engine CPU per request: "
            + " / ".join(f"{c.engine_cpu_us_per_request:.1f} µs" for c in capacities),
        ),
        judged(
            "4",
            "capacity model: front ends one engine core feeds (the mlp `--workers 2` front end)",
            "publish",
            "front ends",
            fed,
            None,
        ),
        judged(
            "4",
            f"capacity model: a {GPU_HOST_CORES}-core GPU host (1 engine core, {fronts} front "
            "ends) saturates at",
            "publish",
            "req/s",
            host,
            None,
            note=f"limited by {limit}" if limit else "",
        ),
    ]


def formatted(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value:+.2f} ms"
    if unit == "µs":
        return f"{value:.0f} µs"
    if unit == "req/s":
        return f"{value:,.0f}"
    return f"{value:.1f}"


def verdict(goal: Goal) -> str:
    if goal.met is None:
        return "-" if goal.value is not None else "not measured"
    return "met" if goal.met else "**missed**"


def markdown_table(goals: Sequence[Goal]) -> list[str]:
    lines = ["| goal | what | target | measured | rounds | verdict |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for goal in goals:
        measured = "-" if goal.value is None else formatted(goal.value, goal.unit)
        rounds = " · ".join(formatted(value, goal.unit) for value in goal.rounds) or "-"
        note = f" ({goal.note})" if goal.note else ""
        lines.append(
            f"| {goal.goal} | {goal.what}{note} | {goal.target} | {measured} | {rounds} | "
            f"{verdict(goal)} |"
        )
    return lines


def role_table(runs: Sequence[Run], forward_us: Mapping[str, float]) -> list[str]:
    """Goal 3's split: CPU per answered request by role at c=64, median over the rounds."""
    lines = ["| server | front end | engine loop | device thread(s) | other | total | "
             "forward (est.) | rounds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    labels = dict.fromkeys(r.label for r in runs if r.concurrency == HIGH)
    for label in labels:
        at = [r for r in runs if r.label == label and r.concurrency == HIGH]
        medians = {
            role: statistics.median(r.cpu_us[role] for r in at) for role in engine_cost.ROLES
        }
        family = next((f for f, names in FAMILIES.items() if at[0].configuration in names), "")
        forward = f"{forward_us[family]:.0f}" if family in forward_us else "-"
        lines.append(
            f"| {label} | "
            + " | ".join(f"{medians[role]:.0f}" for role in engine_cost.ROLES)
            + f" | {sum(medians.values()):.0f} | {forward} | "
            + " · ".join(f"{total_cpu_us(r):.0f}" for r in at)
            + " |"
        )
    return lines


def report(
    goals: Sequence[Goal], runs: Sequence[Run], forward_us: Mapping[str, float], notes: str
) -> str:
    lines = ["# Issue 21, goals 1-5: this checkout against the baseline, one interleaved run",
             "", notes, "", *markdown_table(goals), "",
             "## CPU per answered request by role (µs, c=64, median over the rounds)", "",
             "Front end: the gunicorn workers (one process: its main thread, which also runs the "
             "batcher); engine loop: the engine process's main thread; device thread(s): every "
             "other thread of the process that runs the model; forward (est.): the model's own "
             "CPU a row at batch 64, one torch thread. Rounds: the total of each round.", "",
             *role_table(runs, forward_us), ""]  # fmt: skip
    return "\n".join(lines)


def capacity_run(round_number: int, duration_s: float) -> Capacity:
    """One ``loadtests.capacity`` run of this checkout (its own engine process, its own
    scratch folder); bounded by a timeout."""
    completed = subprocess.run(
        [sys.executable, "-m", "loadtests.capacity",
         "--frontends", str(CAPACITY_FRONTENDS), "--per-frame", str(CAPACITY_PER_FRAME),
         "--window", str(CAPACITY_WINDOW), "--duration-s", str(duration_s),
         "--label", f"goals21-round-{round_number}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=duration_s + 240, check=False,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"loadtests.capacity failed: {completed.stderr[-3000:]}")
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    capacity = Capacity(
        round=round_number,
        requests_per_s=float(figures["requests_per_s"]),
        engine_cpu_us_per_request=float(figures["engine_cpu_us_per_request"]),
        requests_per_s_per_engine_core=float(figures["requests_per_s_per_engine_core"] or 0),
    )
    sweep.log(
        f"  r{round_number} capacity: {capacity.requests_per_s_per_engine_core:,.0f} req/s per "
        f"engine core, {capacity.engine_cpu_us_per_request:.1f} µs a request"
    )
    return capacity


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.goals21",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--baseline-checkout", type=Path, required=True, metavar="PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=4.0, help="each wrk run")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument(
        "--capacity-duration-s", type=float, default=None, help="each capacity run (--duration-s)"
    )
    parser.add_argument("--digits", action="store_true", help="the digits model too (goal 1)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "loadtests/results/goals21")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds must be 1 to {MAX_ROUNDS}, got {args.rounds}")
    for name in ("duration_s", "capacity_duration_s"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_DURATION_S:
            parser.error(
                f"--{name.replace('_', '-')} must be 1 to {MAX_DURATION_S:.0f} s, got {value}"
            )
    if args.capacity_duration_s is None:
        args.capacity_duration_s = args.duration_s
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name for family in (["mlp", "digits"] if args.digits else ["mlp"])
             for name in FAMILIES[family]]  # fmt: skip
    cost_args = engine_cost.parse_args(
        ["--baseline-checkout", str(args.baseline_checkout), "--configs", *names,
         "--concurrency", str(HIGH), str(LOW), "--rounds", str(args.rounds),
         "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s),
         "--out", str(args.out / "engine-cost")]
    )  # fmt: skip
    capacities: list[Capacity] = []
    runs = engine_cost.measure(
        cost_args,
        after_round=lambda n: capacities.append(capacity_run(n, args.capacity_duration_s)),
    )
    forward_us = engine_cost.forward_us_per_row(names)
    notes = (
        f"{args.rounds} interleaved round(s), wrk one thread, {args.duration_s:g} s a run, "
        f"a capacity run of {args.capacity_duration_s:g} s after each round; baseline "
        f"{cost_args.baseline_checkout}. Medians over the rounds; a machine shared with others "
        f"moves every absolute figure (load average at the end "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): read the ratios."
    )
    goals = evaluate(runs, capacities, forward_us)
    engine_cost.write(runs, args.out / "engine-cost", forward_us, notes)
    text = report(goals, runs, forward_us, notes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goals.md").write_text(text)
    (args.out / "goals.json").write_text(
        json.dumps(
            {
                "notes": notes,
                "goals": [asdict(goal) for goal in goals],
                "runs": [asdict(run) for run in runs],
                "capacity": [asdict(c) for c in capacities],
                "forward_us_per_row": dict(forward_us),
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(text)
    print(f"wrote {args.out / 'goals.md'} and goals.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
