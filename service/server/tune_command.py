"""``batchserve tune``'s flags and its run: the search itself is ``service.server.tuning``,
imported only when ``tune`` runs (it imports torch and aiohttp)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_BUDGET_S = 300.0


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
        return value

    return parse


def add_tune_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = commands.add_parser(
        "tune",
        help="find the settings that serve a model best on this host: the highest "
        "throughput whose p99 meets a target, measured",
        description="Measures the model alone and the HTTP ceiling, serves the model under "
        "closed-loop load on 127.0.0.1 for a guided search, re-measures the winner against "
        "the defaults, and writes its BATCHSERVE_* settings (--out) and a report beside it.",
    )
    tune.add_argument("--model", required=True, help="model name")
    tune.add_argument("--version", default="latest", help="version (latest)")
    tune.add_argument(
        "--concurrency", required=True, type=_positive(int), help="requests in flight"
    )
    tune.add_argument("--p99-ms", required=True, type=_positive(float), help="p99 target, ms")
    tune.add_argument(
        "--budget-s",
        type=_positive(float),
        default=DEFAULT_BUDGET_S,
        help=f"time for the whole run, s ({DEFAULT_BUDGET_S:g})",
    )
    tune.add_argument(
        "--out",
        type=Path,
        default=Path("tuned.env"),
        help="env file to write (tuned.env); the report is written beside it",
    )


def run_tune(args: argparse.Namespace) -> int:
    """0 when a configuration met the target, 3 when none did (the lowest p99 is written)."""
    from service.server.tuning.budget import Progress, host_cores, plan_budget

    # The budget counts from here: importing torch is part of the run.
    progress = Progress(args.budget_s, plan_budget(args.budget_s, host_cores()))
    try:
        from service.server.tuning.report import write_env, write_report
        from service.server.tuning.tune import EXIT_TARGET_MISSED, tune
    except ModuleNotFoundError as error:
        print(
            f"batchserve: tune needs {error.name}: pip install 'batchserve[tune]'",
            file=sys.stderr,
        )
        return 1

    out: Path = args.out
    with tempfile.TemporaryDirectory(prefix="batchserve-tune-") as logs:
        report = asyncio.run(
            tune(
                model=args.model,
                version=args.version,
                concurrency=int(args.concurrency),
                p99_ms=args.p99_ms,
                logs=Path(logs),
                progress=progress,
            )
        )
    written = write_report(report, out.parent, out.stem)
    if report.winner is None:
        print("batchserve: no candidate could be served; see " + str(written[0]), file=sys.stderr)
        return 1
    write_env(report, out)
    print(out)
    for path in written:
        print(path)
    if report.met:
        progress.say(f"winner: {report.winner.candidate.label()}; settings in {out}")
        return 0
    assert report.bound is not None
    assert report.decisive is not None
    progress.say(
        f"no configuration met p99 {args.p99_ms:g} ms: the lowest p99 reached was "
        f"{report.decisive.p99_ms:.1f} ms ({report.winner.candidate.label()}); bound by "
        f"{report.bound.kind}: {report.bound.reason}"
    )
    return EXIT_TARGET_MISSED
