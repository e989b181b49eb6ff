"""What ``tune`` found, written down: the env file, a markdown report, a plot and the raw
figures as JSON. The plot needs matplotlib (the ``tune`` extra); without it the report says
so and everything else is written."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from service.config import BUNDLED_MODEL_REPOSITORY
from service.server.env_file import MODEL_NAME, MODEL_VERSION, render_env_file
from service.server.tuning.bounds import Bound
from service.server.tuning.comparison import Comparison, median_of
from service.server.tuning.search import ModelLimit, Result

MIB = 1024 * 1024


@dataclass(frozen=True)
class Trial:
    """A candidate of the search and the stage that proposed it."""

    stage: str
    result: Result


@dataclass
class TuneReport:
    model: str
    version: str
    """The version measured (``latest`` resolved)."""
    version_asked: str
    """``--version``: ``latest``, or an id the env file then pins."""
    repository: Path
    requests: str
    """What the load sent (``bodies.Workload.description``)."""
    rows_per_request: float
    cores: int
    concurrency: int
    p99_target_ms: float
    budget_s: float
    limit: ModelLimit
    model_limit_rps: float
    ceiling_rps: dict[int, float]
    trials: list[Trial] = field(default_factory=list)
    winner: Result | None = None
    bound: Bound | None = None
    remeasured: dict[str, list[Result]] = field(default_factory=dict)
    """``defaults`` and ``tuned``: one result per interleaved round."""
    pick: Result | None = None
    """The search's best, before the re-measurement decides between it and the defaults."""
    comparison: Comparison | None = None
    """The search's pick against the defaults in those rounds (when they differ)."""
    window_s: float = 0.0
    """How long each search trial and each round measured."""
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    final: Result | None = None
    """The written configuration's medians over the re-measurement's rounds, when it ran:
    they decide whether the target is met (more rounds than the search's one)."""

    @property
    def decisive(self) -> Result | None:
        return self.final or self.winner

    @property
    def met(self) -> bool:
        return self.decisive is not None and self.decisive.meets(self.p99_target_ms)


def env_comments(report: TuneReport) -> list[str]:
    lines = [
        f"batchserve tune --model {report.model} --version {report.version_asked} "
        f"--concurrency {report.concurrency} --p99-ms {report.p99_target_ms:g}",
        f"measured on {report.model}@{report.version}, {report.cores} cores; see the report "
        "beside this file",
    ]
    if report.remeasured:
        for name in ("tuned", "defaults"):
            rps, p99 = median_of(report.remeasured.get(name, []))
            lines.append(f"{name}: {rps:,.0f} requests/s, p99 {p99:.1f} ms (interleaved median)")
    if not report.met and report.decisive is not None:
        lines.append(
            f"NO configuration met p99 {report.p99_target_ms:g} ms; these settings reached "
            f"the lowest p99, {report.decisive.p99_ms:.1f} ms"
        )
    lines.append(
        "To serve another model with these settings, name it: serve --env-file FILE "
        "--model-name OTHER (this file's model and version then do not apply)"
    )
    return lines


def env_variables(report: TuneReport) -> dict[str, str]:
    """What ``serve --env-file`` needs to serve what was tuned with the settings found: the
    model, its repository (unless the bundled one, which is ``serve``'s default wherever it
    is installed), the version only when ``--version`` named one (``latest`` stays
    ``latest``), and every tuned setting."""
    assert report.winner is not None
    variables = {MODEL_NAME: report.model}
    if report.version_asked != "latest":
        variables[MODEL_VERSION] = report.version
    if report.repository != BUNDLED_MODEL_REPOSITORY.resolve():
        variables["BATCHSERVE_MODEL_REPOSITORY"] = str(report.repository)
    return variables | report.winner.candidate.environment()


def write_env(report: TuneReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_env_file(env_variables(report), env_comments(report)))


def _ms(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "-"


def markdown(report: TuneReport, plot_name: str | None) -> str:
    target = report.p99_target_ms
    lines = [
        f"# Tuning {report.model}@{report.version}",
        "",
        f"`batchserve tune --model {report.model} --concurrency {report.concurrency} "
        f"--p99-ms {target:g} --budget-s {report.budget_s:g}` on {report.cores} cores, "
        f"in {report.elapsed_s:.0f} s. Requests: {report.requests}.",
        "",
    ]
    if report.winner is None:
        lines += ["No candidate could be served; see the notes below.", ""]
    elif report.met:
        lines += [f"**Winner**: `{report.winner.candidate.label()}`", ""]
    else:
        lines += [
            f"**No configuration met p99 {target:g} ms.** The lowest p99 reached was "
            f"{report.decisive.p99_ms if report.decisive else math.inf:.1f} ms, with "
            f"`{report.winner.candidate.label()}`.",
            "",
        ]
    comparison, pick = report.comparison, report.pick
    if comparison is not None and pick is not None and not comparison.pick_is_better:
        lines += [
            f"The defaults are within the noise of the search's pick, "
            f"`{pick.candidate.label()}`: {comparison.reason}. The defaults are kept.",
            "",
        ]
    if report.final is not None and report.winner is not None:
        lines += [
            f"Written: `{report.winner.candidate.label()}`, re-measured at "
            f"{report.final.throughput_rps:,.0f} requests/s with p99 {_ms(report.final.p99_ms)}"
            " ms (medians of the interleaved rounds below).",
            "",
        ]
    if report.bound is not None:
        lines += [f"What bounds it: **{report.bound.kind}**: {report.bound.reason}.", ""]
    if report.remeasured:
        lines += [
            "## The search's pick against the defaults, interleaved",
            "",
            "| configuration | requests/s (median) | p99 ms (median) | rounds (requests/s, p99) |",
            "| --- | ---: | ---: | --- |",
        ]
        for name, results in report.remeasured.items():
            rps, p99 = median_of(results)
            rounds = ", ".join(f"{r.throughput_rps:,.0f} / {_ms(r.p99_ms)}" for r in results)
            lines.append(f"| {name} | {rps:,.0f} | {_ms(p99)} | {rounds} |")
        lines += ["", search_and_rounds(report), ""]
    if plot_name is not None:
        lines += [f"![throughput and p99 per candidate]({plot_name})", ""]
    lines += [
        "## Candidates",
        "",
        "| # | stage | settings | requests/s | p50 ms | p99 ms | answered | errors | memory MiB "
        "| meets |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for index, trial in enumerate(report.trials):
        result = trial.result
        mark = " **(winner)**" if result == report.winner else ""
        lines.append(
            f"| {index} | {trial.stage} | `{result.candidate.label()}`{mark} | "
            f"{result.throughput_rps:,.0f} | {_ms(result.p50_ms)} | {_ms(result.p99_ms)} | "
            f"{result.answered} | {result.errors} | {result.memory_bytes / MIB:,.0f} | "
            f"{'yes' if result.meets(target) else 'no'} |"
        )
    lines += ["", "## Model limit and HTTP ceiling", ""]
    lines.append(
        f"Model limit over this workload's lengths: {report.model_limit_rps:,.0f} rows/s "
        f"({report.rows_per_request:.3g} rows a request; torch threads "
        f"{report.limit.torch_threads}, model memory {report.limit.memory_bytes / MIB:,.1f} "
        "MiB). HTTP ceiling: "
        + ", ".join(
            f"{rps:,.0f} requests/s with {workers} front end{'s' if workers > 1 else ''}"
            for workers, rps in sorted(report.ceiling_rps.items())
        )
        + "."
    )
    lines += ["", _limit_table(report.limit), ""]
    if report.notes:
        lines += ["## Notes", "", *(f"- {note}" for note in report.notes), ""]
    return "\n".join(lines)


#: A pick whose rounds' median differs from its search window by more than this is noted.
NOTED_DIFFERENCE = 0.15


def search_and_rounds(report: TuneReport) -> str:
    """Why the search's figure for its pick and the re-measured ones may differ."""
    rounds = len(report.remeasured.get("tuned", []))
    text = (
        f"Each trial of the search measured one window of {report.window_s:.1f} s; the rounds "
        f"above measured the pick and the defaults in turn, {rounds} windows each, so that "
        "other load on the host fell on both alike: their medians decide what is written."
    )
    pick, tuned = report.pick, report.remeasured.get("tuned", [])
    if pick is None or not tuned or pick.throughput_rps <= 0:
        return text
    rps = median_of(tuned)[0]
    low, high = min(r.throughput_rps for r in tuned), max(r.throughput_rps for r in tuned)
    change = rps / pick.throughput_rps - 1
    text += (
        f" In the search the pick served {pick.throughput_rps:,.0f} requests/s; re-measured, "
        f"{low:,.0f} to {high:,.0f} (median {rps:,.0f})"
    )
    if abs(change) <= NOTED_DIFFERENCE:
        return text + ", about the same."
    return text + (
        f", {abs(change):.0%} {'less' if change < 0 else 'more'}: one window is a noisy sample "
        "on this host (the search kept the highest of several such samples, which favours a "
        "lucky one), and the rounds, measured alike, are the figures to trust."
    )


def _limit_table(limit: ModelLimit) -> str:
    sizes = sorted({size for rates in limit.rows_per_s.values() for size in rates})
    header = "| padded length | " + " | ".join(f"batch {size}" for size in sizes) + " |"
    rule = "| --- |" + " ---: |" * len(sizes)
    rows = [header, rule]
    for length, rates in sorted(limit.rows_per_s.items(), key=lambda item: item[0] or 0):
        cells = [f"{rates[size]:,.0f}" if size in rates else "-" for size in sizes]
        rows.append(f"| {length or 'fixed'} | " + " | ".join(cells) + " |")
    return "rows/s of the model alone:\n\n" + "\n".join(rows)


def plot(report: TuneReport, path: Path) -> bool:
    """Throughput bars and p99 points per candidate, the winner in orange, the model limit
    and HTTP ceilings as lines; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        return False
    figure, throughput_axis = pyplot.subplots(figsize=(9, 4.8))
    indexes = list(range(len(report.trials)))
    results = [trial.result for trial in report.trials]
    colours = ["tab:orange" if r == report.winner else "tab:blue" for r in results]
    throughput_axis.bar(indexes, [r.throughput_rps for r in results], color=colours)
    lines = [
        throughput_axis.axhline(
            report.model_limit_rps, color="tab:green", linestyle="--", label="model limit"
        )
    ]
    for (workers, rps), style in zip(sorted(report.ceiling_rps.items()), [":", "-."], strict=False):
        lines.append(
            throughput_axis.axhline(
                rps, color="tab:purple", linestyle=style, label=f"HTTP ceiling, {workers} front end"
            )
        )
    throughput_axis.set_xlabel("candidate (as in the table; orange: winner)")
    throughput_axis.set_ylabel("requests/s (bars)")
    shown = [r.throughput_rps for r in results if r.throughput_rps > 0]
    lines_top = max([report.model_limit_rps, *report.ceiling_rps.values()])
    if shown and lines_top > 20 * min(shown):  # bars would be flat under the ceilings
        throughput_axis.set_yscale("log")
        throughput_axis.set_ylabel("requests/s (bars, log scale)")
    throughput_axis.set_xticks(indexes)
    p99_axis = throughput_axis.twinx()
    p99_values = [r.p99_ms if math.isfinite(r.p99_ms) else float("nan") for r in results]
    (points,) = p99_axis.plot(indexes, p99_values, "o", color="tab:red", label="p99")
    target = p99_axis.axhline(
        report.p99_target_ms, color="tab:red", linestyle="--", linewidth=0.8, label="p99 target"
    )
    p99_axis.set_ylabel("p99 ms (points)")
    p99_axis.set_ylim(bottom=0)
    handles = [*lines, points, target]
    throughput_axis.legend(handles=handles, loc="upper left", fontsize="small", framealpha=0.8)
    throughput_axis.set_title(
        f"{report.model}: concurrency {report.concurrency}, p99 target {report.p99_target_ms:g} ms"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return True


def write_report(report: TuneReport, folder: Path, stem: str) -> list[Path]:
    """``<stem>.md``, ``<stem>.png`` (with matplotlib) and ``<stem>.json`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    image = folder / f"{stem}.png"
    has_plot = plot(report, image)
    if has_plot:
        written.append(image)
    else:
        report.notes.append("no plot: matplotlib is not installed (pip install 'batchserve[tune]')")
    page = folder / f"{stem}.md"
    page.write_text(markdown(report, image.name if has_plot else None))
    data = folder / f"{stem}.json"
    options = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS  # ceiling_rps is keyed by int
    data.write_bytes(orjson.dumps(asdict(report), default=str, option=options) + b"\n")
    return [page, *written, data]
