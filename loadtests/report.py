"""Turn sweep results into CSV files, a Markdown report and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.memory import ProcessMemory
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

    def _median(self, values: Sequence[float]) -> float:
        return statistics.median(values) if values else 0.0

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
    lines.append(
        "Medians over the runs of each point. *Bound* is min(model limit at its best batch "
        "size, HTTP ceiling at the same concurrency, with as many front ends as the "
        "configuration); *served / bound* is req/s divided by it."
    )
    lines.append("")
    lines.append(
        "| configuration | c | req/s | p50 ms | p95 ms | p99 ms | errors | rows/batch "
        "| HTTP ceiling req/s | model limit rows/s (batch) | served / bound |"
    )
    lines.append("| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
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
            f"| {_ceiling_text(row)} | {limit_text} "
            f"| {_fmt(row['fraction_of_bound'], '{:.0%}')} |"
        )
    lines.append("")

    lines += _baseline_comparison(result.points)

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


def _baseline_comparison(points: Sequence[Point]) -> list[str]:
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
        "report": folder / "report.md",
    }
    write_csv(paths["results"], rows)
    generator = [result.generator] if result.generator and result.generator.runs else []
    write_csv(paths["http_ceiling"], ceiling_rows([*result.ceilings, *generator]))
    write_csv(paths["model_limits"], model_limit_rows(result.model_limits))
    write_csv(paths["memory"], memory_rows(result.memory))
    paths["report"].write_text(markdown(result, rows))
    if result.points:
        throughput, latency = plot(result, folder)
        paths |= {"throughput": throughput, "latency": latency}
    return paths
