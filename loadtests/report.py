"""Turn sweep results into CSV files, a Markdown report and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.servers import ProcessMemory
from loadtests.wrk import WrkResult

BASELINE_SUFFIX = "@baseline"


@dataclass
class Point:
    """All runs of one label (configuration or ceiling) at one concurrency; medians reported."""

    label: str
    workload: str
    concurrency: int
    runs: list[WrkResult] = field(default_factory=list)
    batch_rows: float = 0.0
    batches: float = 0.0
    has_batch_metrics: bool = False
    ceiling: str = "http-ceiling"
    """Label of the HTTP ceiling this point is compared with (same workload, same front ends)."""
    limit_of: str | None = None
    """Configuration whose model limit applies (default: ``label``)."""
    cpu_s: list[float | None] = field(default_factory=list)
    """CPU seconds (user + system) the server's processes used during each run, aligned with
    ``runs``; None where it could not be read (a server this sweep did not start)."""

    def _median(self, values: Sequence[float]) -> float:
        return statistics.median(values) if values else 0.0

    @property
    def cpu_us_per_run(self) -> list[float | None]:
        """Each run's server CPU per answered request, in µs: less moved by a busy machine
        than req/s, since a slower run costs about the same CPU for each answer."""
        return [
            None if cpu_s is None or not run.requests else cpu_s / run.requests * 1e6
            for run, cpu_s in zip(self.runs, self.cpu_s, strict=False)
        ]

    @property
    def cpu_us_per_request(self) -> float | None:
        return median_of(self.cpu_us_per_run)

    @property
    def requests_per_s(self) -> float:
        return self._median([run.requests_per_s for run in self.runs])

    @property
    def p50_ms(self) -> float:
        return self._median([run.p50_ms for run in self.runs])

    @property
    def p95_ms(self) -> float:
        return self._median([run.p95_ms for run in self.runs])

    @property
    def p99_ms(self) -> float:
        return self._median([run.p99_ms for run in self.runs])

    @property
    def errors(self) -> int:
        return sum(run.errors for run in self.runs)

    @property
    def requests(self) -> int:
        return sum(run.requests for run in self.runs)

    @property
    def mean_rows_per_batch(self) -> float | None:
        if not self.has_batch_metrics or self.batches <= 0:
            return None
        return self.batch_rows / self.batches


@dataclass
class ModelLimit:
    configuration: str
    rows_per_s: dict[int, float]
    details: dict[str, object]

    @property
    def best(self) -> tuple[int, float]:
        """(batch size, rows/s) of the fastest batch size."""
        size = max(self.rows_per_s, key=lambda b: self.rows_per_s[b])
        return size, self.rows_per_s[size]


@dataclass(frozen=True)
class IdleCpu:
    """CPU one server's processes used while it had no load, in cores (1.0: one core busy)."""

    settled_cores: float
    """With every server idle, for ``settled_s`` after the warm-ups."""
    settled_s: float
    between_turns_cores: float | None
    """While the other servers were measured (None if there were none)."""
    between_turns_s: float


#: A waiting server using more than this share of a core is flagged in the report.
IDLE_CPU_FLAG_CORES = 0.02


@dataclass
class SweepResult:
    points: list[Point]
    ceilings: list[Point]
    generator: Point | None
    model_limits: dict[str, ModelLimit]
    unavailable: dict[str, str]
    notes: list[str]
    environment: dict[str, str]
    memory: dict[str, list[ProcessMemory]] = field(default_factory=dict)
    """Per configuration: each process of its server after the warm-up."""
    rounds: int = 0
    """Interleaved rounds (``--interleave``): ``runs[i]`` of every point is round i + 1. 0 when
    each configuration was measured in one stretch."""
    comparisons: list[tuple[str, str]] = field(default_factory=list)
    """(a, b) label pairs whose per-round ratio a / b the report gives when interleaved."""
    idle_cpu: dict[str, IdleCpu] = field(default_factory=dict)
    """Per interleaved server: what it used while waiting for its turn."""


def _ceiling(result: SweepResult, point: Point) -> float | None:
    for ceiling in result.ceilings:
        if (ceiling.label, ceiling.workload, ceiling.concurrency) == (
            point.ceiling,
            point.workload,
            point.concurrency,
        ) and ceiling.runs:
            return ceiling.requests_per_s
    return None


def summary_rows(result: SweepResult) -> list[dict[str, object]]:
    """One row per configuration x concurrency, with both limits and the fraction of the bound.

    One instance per request, so rows/s of the model and requests/s are the same unit.
    """
    rows = []
    for point in result.points:
        ceiling = _ceiling(result, point)
        limit = result.model_limits.get(point.limit_of or point.label)
        best_batch, model_rows_per_s = limit.best if limit else (None, None)
        bounds = [value for value in (ceiling, model_rows_per_s) if value]
        bound = min(bounds) if bounds else None
        rows.append(
            {
                "configuration": point.label,
                "workload": point.workload,
                "concurrency": point.concurrency,
                "requests_per_s": round(point.requests_per_s, 1),
                "p50_ms": round(point.p50_ms, 3),
                "p95_ms": round(point.p95_ms, 3),
                "p99_ms": round(point.p99_ms, 3),
                "errors": point.errors,
                "mean_rows_per_batch": _round(point.mean_rows_per_batch, 2),
                "cpu_us_per_request": _round(point.cpu_us_per_request, 1),
                "http_ceiling": point.ceiling,
                "http_ceiling_requests_per_s": _round(ceiling, 1),
                "model_limit_rows_per_s": _round(model_rows_per_s, 1),
                "model_limit_batch_size": best_batch,
                "bound_requests_per_s": _round(bound, 1),
                "fraction_of_bound": _round(point.requests_per_s / bound if bound else None, 3),
                "runs": len(point.runs),
                "requests": point.requests,
            }
        )
    return rows


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def write_csv(path: Path, rows: Sequence[dict[str, object]]) -> None:
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def ceiling_rows(points: Sequence[Point]) -> list[dict[str, object]]:
    return [
        {
            "server": point.label,
            "workload": point.workload,
            "concurrency": point.concurrency,
            "requests_per_s": round(point.requests_per_s, 1),
            "p50_ms": round(point.p50_ms, 3),
            "p95_ms": round(point.p95_ms, 3),
            "p99_ms": round(point.p99_ms, 3),
            "errors": point.errors,
            "runs": len(point.runs),
        }
        for point in points
    ]


def memory_rows(memory: dict[str, list[ProcessMemory]]) -> list[dict[str, object]]:
    return [
        {
            "configuration": name,
            "role": process.role,
            "pid": process.pid,
            "rss_mib": round(process.rss_bytes / 2**20, 1),
            "command": process.command,
        }
        for name, processes in memory.items()
        for process in processes
    ]


def run_rows(points: Sequence[Point]) -> list[dict[str, object]]:
    """One row per wrk run, in the order run; ``run`` is the round when interleaved."""
    return [
        {
            "configuration": point.label,
            "workload": point.workload,
            "concurrency": point.concurrency,
            "run": index,
            "requests_per_s": round(run.requests_per_s, 1),
            "p50_ms": round(run.p50_ms, 3),
            "p95_ms": round(run.p95_ms, 3),
            "p99_ms": round(run.p99_ms, 3),
            "errors": run.errors,
            "requests": run.requests,
            "cpu_us_per_request": _round(_item(point.cpu_us_per_run, index - 1), 1),
        }
        for point in points
        for index, run in enumerate(point.runs, start=1)
    ]


def _item(values: Sequence[float | None], index: int) -> float | None:
    return values[index] if index < len(values) else None


def model_limit_rows(limits: dict[str, ModelLimit]) -> list[dict[str, object]]:
    return [
        {"configuration": name, "batch_size": size, "rows_per_s": round(rows_per_s, 1)}
        for name, limit in limits.items()
        for size, rows_per_s in sorted(limit.rows_per_s.items())
    ]


def _fmt(value: object, pattern: str = "{:,.0f}") -> str:
    if value is None or value == "":
        return "-"
    return pattern.format(value)


def _ceiling_text(row: dict[str, object]) -> str:
    """The ceiling's req/s, naming its front ends when they are not one process."""
    text = _fmt(row["http_ceiling_requests_per_s"])
    name = str(row["http_ceiling"])
    return text if name == "http-ceiling" or text == "-" else f"{text} ({name})"


def markdown(result: SweepResult, rows: Sequence[dict[str, object]]) -> str:
    lines = ["# batchserve load-test sweep", ""]
    lines += [f"- {key}: {value}" for key, value in result.environment.items()]
    lines += [f"- {note}" for note in result.notes]
    lines.append("")

    lines += ["## Load generator ceiling", ""]
    if result.generator is not None and result.generator.runs:
        g = result.generator
        lines.append(
            f"wrk (one thread, same Lua body script as the digits workload) against a "
            f"fixed-response server at c={g.concurrency}: **{g.requests_per_s:,.0f} req/s**, "
            f"p50 {g.p50_ms:.2f} ms, p99 {g.p99_ms:.2f} ms, {g.errors} errors. Served rates "
            "well below this are not limited by the generator."
        )
    else:
        lines.append("Not measured.")
    lines.append("")

    lines += ["## Results", ""]
    if result.rounds:
        lines.append(
            f"Served rows interleaved: every server ran at once, idle but for its turns, for "
            f"{result.rounds} round(s); each round ran one wrk run per concurrency on each server "
            "in turn. Each point is the median over its rounds. The HTTP ceilings and the model "
            "limits were measured separately, after the rounds."
        )
        lines.append("")
    lines.append(
        "Medians over the runs of each point. *CPU µs/req* is the CPU (user + system) of all "
        "the server's processes during a run divided by the requests answered. *Bound* is "
        "min(model limit at its best batch size, HTTP ceiling at the same concurrency, with as "
        "many front ends as the configuration); *served / bound* is req/s divided by it."
    )
    lines.append("")
    lines.append(
        "| configuration | c | req/s | p50 ms | p95 ms | p99 ms | errors | rows/batch "
        "| CPU µs/req | HTTP ceiling req/s | model limit rows/s (batch) | served / bound |"
    )
    lines.append("| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for row in rows:
        limit = row["model_limit_rows_per_s"]
        limit_text = (
            f"{limit:,.0f} ({row['model_limit_batch_size']})" if isinstance(limit, float) else "-"
        )
        lines.append(
            f"| {row['configuration']} | {row['concurrency']} | {_fmt(row['requests_per_s'])} "
            f"| {_fmt(row['p50_ms'], '{:.2f}')} | {_fmt(row['p95_ms'], '{:.2f}')} "
            f"| {_fmt(row['p99_ms'], '{:.2f}')} | {row['errors']} "
            f"| {_fmt(row['mean_rows_per_batch'], '{:.1f}')} "
            f"| {_fmt(row['cpu_us_per_request'])} "
            f"| {_ceiling_text(row)} | {limit_text} "
            f"| {_fmt(row['fraction_of_bound'], '{:.0%}')} |"
        )
    lines.append("")

    lines += _baseline_comparison(result.points, interleaved=result.rounds > 0)
    if result.rounds:
        lines += _round_comparisons(result)
        lines += _idle_cpu_section(result.idle_cpu)

    if result.ceilings:
        lines += ["## HTTP ceiling (the service's front end, no model, no batching)", ""]
        lines.append(
            "`http-ceiling`: one process; `http-ceiling-wN`: N gunicorn front ends, as "
            "`--workers N` runs them. Each answers with zeros at once."
        )
        lines.append("")
        lines.append("| ceiling | workload | c | req/s | p50 ms | p99 ms | errors |")
        lines.append("| --- | --- | --: | --: | --: | --: | --: |")
        for point in result.ceilings:
            lines.append(
                f"| {point.label} | {point.workload} | {point.concurrency} "
                f"| {point.requests_per_s:,.0f} | {point.p50_ms:.2f} | {point.p99_ms:.2f} "
                f"| {point.errors} |"
            )
        lines.append("")

    lines += _memory_section(result.memory)

    if result.model_limits:
        sizes = sorted({s for limit in result.model_limits.values() for s in limit.rows_per_s})
        lines += ["## Model limit (in-process forward, rows/s by batch size)", ""]
        lines.append("| configuration | threads | " + " | ".join(str(s) for s in sizes) + " |")
        lines.append("| --- | --: | " + " | ".join("--:" for _ in sizes) + " |")
        for name, limit in result.model_limits.items():
            cells = [_fmt(limit.rows_per_s.get(size)) for size in sizes]
            threads = limit.details.get("torch_threads", "?")
            lines.append(f"| {name} | {threads} | " + " | ".join(cells) + " |")
        lines.append("")

    if result.unavailable:
        lines += ["## Not measured", ""]
        for name, reason in result.unavailable.items():
            first, *rest = reason.strip().splitlines() or [""]
            lines.append(f"- **{name}**: {first}")
            if rest:
                lines += ["", "  ```", *(f"  {line}" for line in rest[-30:]), "  ```"]
        lines.append("")

    if result.points:
        lines += ["## Plots", "", "![throughput](throughput.png)", "", "![latency](latency.png)"]
        lines.append("")
    return "\n".join(lines)


def _baseline_comparison(points: Sequence[Point], *, interleaved: bool = False) -> list[str]:
    """This checkout against ``--baseline-checkout``, side by side, where both were measured."""
    by_key = {(point.label, point.concurrency): point for point in points}
    pairs = [
        (point, by_key[(point.label + BASELINE_SUFFIX, point.concurrency)])
        for point in points
        if (point.label + BASELINE_SUFFIX, point.concurrency) in by_key
    ]
    if not pairs:
        return []
    lines = ["## This checkout against the baseline checkout", ""]
    if interleaved:
        lines.append(
            "Same configuration, same wrk load, interleaved round by round in this run. "
            "*new / baseline* is the ratio of the median req/s; the median of the per-round "
            "ratios (below) is the figure that drift does not bias."
        )
    else:
        lines.append(
            "Same configuration, same wrk load, measured one after the other in this run. "
            "*new / baseline* is the ratio of req/s."
        )
    lines.append("")
    lines.append(
        "| configuration | c | req/s new | req/s baseline | new / baseline | p50 ms new "
        "| p50 ms baseline | p99 ms new | p99 ms baseline | rows/batch new "
        "| rows/batch baseline |"
    )
    lines.append("| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for new, old in pairs:
        ratio = new.requests_per_s / old.requests_per_s if old.requests_per_s else None
        lines.append(
            f"| {new.label} | {new.concurrency} | {new.requests_per_s:,.0f} "
            f"| {old.requests_per_s:,.0f} | {_fmt(ratio, '{:.2f}')} "
            f"| {new.p50_ms:.2f} | {old.p50_ms:.2f} | {new.p99_ms:.2f} | {old.p99_ms:.2f} "
            f"| {_fmt(new.mean_rows_per_batch, '{:.1f}')} "
            f"| {_fmt(old.mean_rows_per_batch, '{:.1f}')} |"
        )
    lines.append("")
    return lines


def _aligned(result: SweepResult, a: str, b: str) -> list[tuple[Point, Point]]:
    """(a, b) points at each concurrency both were measured at, in ``a``'s order."""
    by_key = {(point.label, point.concurrency): point for point in result.points}
    return [
        (point, by_key[(b, point.concurrency)])
        for point in result.points
        if point.label == a and (b, point.concurrency) in by_key
    ]


def per_round(
    a: Point, b: Point, combine: Callable[[WrkResult, WrkResult], float | None]
) -> list[float | None]:
    """``combine`` of the two runs of each round both completed: run i of an interleaved
    point is round i + 1, measured seconds apart from the other's."""
    return [combine(x, y) for x, y in zip(a.runs, b.runs, strict=False)]


def rate_ratio(a: WrkResult, b: WrkResult) -> float | None:
    return a.requests_per_s / b.requests_per_s if b.requests_per_s else None


def p50_difference_ms(a: WrkResult, b: WrkResult) -> float | None:
    return a.p50_ms - b.p50_ms


def median_of(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _round_comparisons(result: SweepResult) -> list[str]:
    """Ratio per round of each compared pair, and the p50 difference at the lowest concurrency.

    A ratio of medians mixes runs minutes apart, and the machine's speed drifts by a third in
    minutes; the two runs of one round are seconds apart, so their ratio mostly cancels drift.
    """
    pairs = [(a, b, _aligned(result, a, b)) for a, b in result.comparisons]
    pairs = [(a, b, points) for a, b, points in pairs if points]
    if not pairs:
        return []
    rounds = range(1, result.rounds + 1)
    lines = ["## Interleaved comparisons: ratio per round", ""]
    lines.append(
        "*a / b* is the ratio of req/s of two servers in the same round, measured seconds "
        "apart; the median of these per-round ratios is the figure to quote. The ratio of the "
        "medians (of the Results table) is shown for contrast: it mixes rounds minutes apart."
    )
    lines.append("")
    lines.append(
        "| a | b | c | "
        + " | ".join(f"a / b round {r}" for r in rounds)
        + " | **median of per-round ratios** | ratio of medians |"
    )
    lines.append("| --- | --- | --: | " + " | ".join("--:" for _ in rounds) + " | --: | --: |")
    for a, b, points in pairs:
        for point_a, point_b in points:
            ratios = per_round(point_a, point_b, rate_ratio)
            cells = [_fmt(ratios[r - 1] if r <= len(ratios) else None, "{:.3f}") for r in rounds]
            rate_b = point_b.requests_per_s
            of_medians = point_a.requests_per_s / rate_b if rate_b else None
            lines.append(
                f"| {a} | {b} | {point_a.concurrency} | "
                + " | ".join(cells)
                + f" | **{_fmt(median_of(ratios), '{:.3f}')}** | {_fmt(of_medians, '{:.3f}')} |"
            )
    lines.append("")

    lowest = min(point.concurrency for _, _, points in pairs for point, _ in points)
    lines += [f"### p50 latency difference at c={lowest}, a - b (ms)", ""]
    lines.append(
        "| a | b | " + " | ".join(f"round {r}" for r in rounds) + " | **median of differences** |"
    )
    lines.append("| --- | --- | " + " | ".join("--:" for _ in rounds) + " | --: |")
    for a, b, points in pairs:
        for point_a, point_b in points:
            if point_a.concurrency != lowest:
                continue
            differences = per_round(point_a, point_b, p50_difference_ms)
            cells = [
                _fmt(differences[r - 1] if r <= len(differences) else None, "{:+.3f}")
                for r in rounds
            ]
            median = _fmt(median_of(differences), "{:+.3f}")
            lines.append(f"| {a} | {b} | " + " | ".join(cells) + f" | **{median}** |")
    lines.append("")
    lines += _cpu_ratios(pairs, rounds)
    return lines


def _cpu_ratios(
    pairs: Sequence[tuple[str, str, list[tuple[Point, Point]]]], rounds: range
) -> list[str]:
    """CPU per request of a over b, per round: the figure a busy shared machine moves least."""
    rows = []
    for a, b, points in pairs:
        for point_a, point_b in points:
            ratios = [
                x / y if x is not None and y else None
                for x, y in zip(point_a.cpu_us_per_run, point_b.cpu_us_per_run, strict=False)
            ]
            if not any(ratio is not None for ratio in ratios):
                continue
            cells = [_fmt(_item(ratios, r - 1), "{:.3f}") for r in rounds]
            rows.append(
                f"| {a} | {b} | {point_a.concurrency} | "
                + " | ".join(cells)
                + f" | **{_fmt(median_of(ratios), '{:.3f}')}** "
                f"| {_fmt(point_a.cpu_us_per_request)} | {_fmt(point_b.cpu_us_per_request)} |"
            )
    if not rows:
        return []
    return [
        "### CPU per request, a / b per round",
        "",
        "The CPU of all of a server's processes during its run, per answered request; below "
        "1 means a spends less CPU on each answer than b.",
        "",
        "| a | b | c | "
        + " | ".join(f"round {r}" for r in rounds)
        + " | **median of per-round ratios** | a µs/req | b µs/req |",
        "| --- | --- | --: | " + " | ".join("--:" for _ in rounds) + " | --: | --: | --: |",
        *rows,
        "",
    ]


def _idle_cpu_section(idle: dict[str, IdleCpu]) -> list[str]:
    """Whether the servers waiting for their turn stayed out of the measured server's way."""
    if not idle:
        return []
    settled_s = max(value.settled_s for value in idle.values())
    lines = ["## CPU of the servers while they waited for their turn", ""]
    lines.append(
        f"Percent of one core used by all of a server's processes: *settled* with every server "
        f"idle for {settled_s:.0f} s after the warm-ups; *between turns* while the other "
        f"servers were measured. Above {IDLE_CPU_FLAG_CORES:.0%} is flagged (**!**): such a "
        "server takes CPU from the one measured."
    )
    lines.append("")
    lines.append("| server | settled | between turns | seconds between turns |")
    lines.append("| --- | --: | --: | --: |")

    def cell(cores: float | None) -> str:
        if cores is None:
            return "-"
        return f"{cores:.2%}" + (" **!**" if cores > IDLE_CPU_FLAG_CORES else "")

    for label, value in idle.items():
        lines.append(
            f"| {label} | {cell(value.settled_cores)} | {cell(value.between_turns_cores)} "
            f"| {value.between_turns_s:.0f} |"
        )
    lines.append("")
    return lines


def _memory_section(memory: dict[str, list[ProcessMemory]]) -> list[str]:
    if not memory:
        return []
    lines = ["## Resident memory per process (VmRSS after the warm-up)", ""]
    lines.append(
        "In this checkout the gunicorn workers are front ends without torch and the engine "
        "holds the model; in the older layout each gunicorn worker holds a model of its own. "
        "Pages shared after a fork count in every process, so totals overstate."
    )
    lines.append("")
    lines.append("| configuration | role | pid | RSS MiB |")
    lines.append("| --- | --- | --: | --: |")
    for name, processes in memory.items():
        for process in processes:
            lines.append(
                f"| {name} | {process.role} | {process.pid} | {process.rss_bytes / 2**20:,.1f} |"
            )
        total = sum(process.rss_bytes for process in processes) / 2**20
        count = f"{len(processes)} process" + ("" if len(processes) == 1 else "es")
        lines.append(f"| {name} | **total** ({count}) | | **{total:,.1f}** |")
    lines.append("")
    return lines


def plot(result: SweepResult, folder: Path) -> list[Path]:
    """throughput.png and latency.png: one line per configuration, log concurrency axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label: dict[str, list[Point]] = {}
    for point in result.points:
        by_label.setdefault(point.label, []).append(point)

    concurrencies = sorted({p.concurrency for p in [*result.points, *result.ceilings]})
    colors: dict[str, object] = {}
    figure, axis = plt.subplots(figsize=(11, 5.5))
    values = []
    for label, points in by_label.items():
        ys = [p.requests_per_s for p in points]
        values += ys
        (line,) = axis.plot([p.concurrency for p in points], ys, marker="o", label=label)
        colors.setdefault(points[0].workload, line.get_color())
    ceilings: dict[tuple[str, str], list[Point]] = {}
    for point in result.ceilings:
        ceilings.setdefault((point.label, point.workload), []).append(point)
    for (ceiling, workload), points in ceilings.items():
        ys = [p.requests_per_s for p in points]
        values += ys
        axis.plot(
            [p.concurrency for p in points],
            ys,
            linestyle="--",
            marker="x",
            color=colors.get(workload, "grey"),
            alpha=0.6,
            label=f"{ceiling}, {workload}",
        )
    _concurrency_axis(axis, concurrencies)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 20:
        axis.set_yscale("log")
    axis.set_xlabel("concurrent connections (closed loop)")
    axis.set_ylabel("requests/s (median of runs)")
    axis.set_title("Throughput vs concurrency (dashed: HTTP ceiling of the same workload)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    throughput = folder / "throughput.png"
    figure.savefig(throughput, dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(1, 3, figsize=(17, 5), sharey=True)
    for axis, (name, attribute) in zip(
        axes, (("p50", "p50_ms"), ("p95", "p95_ms"), ("p99", "p99_ms")), strict=True
    ):
        for label, points in by_label.items():
            axis.plot(
                [p.concurrency for p in points],
                [max(getattr(p, attribute), 1e-3) for p in points],
                marker="o",
                label=label,
            )
        _concurrency_axis(axis, concurrencies)
        axis.set_yscale("log")
        axis.set_xlabel("concurrent connections")
        axis.set_title(f"{name} latency")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms (median over runs)")
    axes[-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    latency = folder / "latency.png"
    figure.savefig(latency, dpi=120)
    plt.close(figure)
    return [throughput, latency]


def _concurrency_axis(axis: Any, concurrencies: Sequence[int]) -> None:
    """Log-2 x axis labelled with the measured concurrencies as plain numbers."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(concurrencies), [str(c) for c in concurrencies])
    axis.minorticks_off()


def write_all(result: SweepResult, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(result)
    paths = {
        "results": folder / "results.csv",
        "http_ceiling": folder / "http_ceiling.csv",
        "model_limits": folder / "model_limits.csv",
        "memory": folder / "memory.csv",
        "runs": folder / "runs.csv",
        "report": folder / "report.md",
    }
    write_csv(paths["results"], rows)
    write_csv(paths["runs"], run_rows(result.points))
    generator = [result.generator] if result.generator and result.generator.runs else []
    write_csv(paths["http_ceiling"], ceiling_rows([*result.ceilings, *generator]))
    write_csv(paths["model_limits"], model_limit_rows(result.model_limits))
    write_csv(paths["memory"], memory_rows(result.memory))
    paths["report"].write_text(markdown(result, rows))
    if result.points:
        throughput, latency = plot(result, folder)
        paths |= {"throughput": throughput, "latency": latency}
    return paths
