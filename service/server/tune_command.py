"""``batchserve tune``'s flags and its run: the search itself is ``service.server.tuning``,
imported only when ``tune`` runs (it imports torch and aiohttp)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from service.cpus import usable_cpus
from service.server.model_flags import add_model_flags

DEFAULT_BUDGET_S = 300.0
#: Requests in flight: one front end holds at most ``max_requests_per_frontend`` (1,024 by
#: default) and answers more with 503, and each is a connection of the load generator.
MAX_CONCURRENCY = 1024
#: The longest ``request_timeout_ms``: no request is answered later.
MAX_P99_MS = 600_000.0
MIN_BUDGET_S = 1.0
MAX_BUDGET_S = 86_400.0


def _in_range(
    kind: Callable[[str], float], low: float, high: float, unit: str = "", *, above: bool = False
) -> Callable[[str], float]:
    """A flag's parser: a finite ``kind`` from ``low`` (or ``above`` it) to ``high``; its
    message quotes the value and the accepted range."""
    noun = "a whole number" if kind is int else "a number"
    start = f"above {low:g}" if above else f"from {low:g}"
    accepted = f"{noun} {start} to {high:g}{' ' + unit if unit else ''}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}") from None
        above_low = value > low if above else value >= low
        if not (math.isfinite(value) and above_low and value <= high):
            raise argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}")
        return value

    return parse


def add_tune_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = commands.add_parser(
        "tune",
        help="find the settings that serve a model best on this host: the highest "
        "throughput whose p99 meets a target, measured",
        description="Measures the model alone and the HTTP ceiling, serves the model under "
        "closed-loop load on 127.0.0.1 for a guided search, re-measures the pick against "
        "the defaults, and writes its BATCHSERVE_* settings (--out) and a report beside it.",
    )
    add_model_flags(tune, "version (latest)")
    tune.add_argument(
        "--concurrency",
        required=True,
        type=_in_range(int, 1, MAX_CONCURRENCY),
        help=f"requests in flight, 1 to {MAX_CONCURRENCY}",
    )
    tune.add_argument(
        "--p99-ms",
        required=True,
        type=_in_range(float, 0, MAX_P99_MS, "ms", above=True),
        help="p99 target, ms",
    )
    tune.add_argument(
        "--budget-s",
        type=_in_range(float, MIN_BUDGET_S, MAX_BUDGET_S, "s"),
        default=DEFAULT_BUDGET_S,
        help=f"time for the whole run, s ({DEFAULT_BUDGET_S:g})",
    )
    tune.add_argument(
        "--body",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a request body to send (repeat for several), typed by its suffix: .json, "
        ".txt, .png, .jpg, .npy, .npz; default: generated for the model's handler (texts, "
        "images or tensors)",
    )
    tune.add_argument(
        "--out",
        type=Path,
        default=Path("tuned.env"),
        help="env file to write (tuned.env); the report is written beside it",
    )


def run_tune(args: argparse.Namespace) -> int:
    """0 when a configuration met the target, 3 when none did (the lowest p99 is written),
    128 + the signal's number when SIGTERM or SIGINT stopped it."""
    from service.server.tuning.budget import Progress, plan_budget

    # The budget counts from here: importing torch is part of the run.
    progress = Progress(args.budget_s, plan_budget(args.budget_s, usable_cpus()))
    try:
        from service.server.tuning.children import (
            STOP_AFTER_SIGNAL_S,
            Children,
            StopSignalError,
            until_stopped,
        )
        from service.server.tuning.report import write_env, write_report
        from service.server.tuning.tune import EXIT_TARGET_MISSED, tune
    except ModuleNotFoundError as error:
        print(
            f"batchserve: tune needs {error.name}: pip install 'batchserve[tune]'",
            file=sys.stderr,
        )
        return 1

    out: Path = args.out
    children = Children()
    stopped: StopSignalError | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="batchserve-tune-") as logs:
            work = tune(
                model=args.model,
                version=args.version,
                concurrency=int(args.concurrency),
                p99_ms=args.p99_ms,
                logs=Path(logs),
                progress=progress,
                children=children,
                repository=args.repository,
                samples=args.body,
            )
            report = asyncio.run(until_stopped(work, children))
    except StopSignalError as signalled:
        stopped = signalled
    finally:
        children.stop_all(STOP_AFTER_SIGNAL_S)  # whatever happened, none outlives tune
    if stopped is not None:
        print(
            f"batchserve: tune stopped by {stopped}; the servers it started were stopped",
            file=sys.stderr,
        )
        return 128 + stopped.signum
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
