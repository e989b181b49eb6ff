"""What tracing costs: one digit per ``/predict`` at 64 clients, tracing off and on.

``python -m loadtests.tracing_overhead`` starts one-process servers of ``digits`` side by side:
tracing off (no ``OTEL_*`` variables), tracing on with every request sampled
(``OTEL_TRACES_SAMPLER=always_on``) and with one in ten (``parentbased_traceidratio`` 0.1),
exporting OTLP/HTTP through the SDK's batch span processor
to a receiver in this process (it decodes and counts the spans, like a collector on the same
host), and with ``--baseline CHECKOUT`` the code before tracing existed (e.g. ``git archive
844a953 | tar -x -C /tmp/before``), to show what "off" costs. wrk runs them in turn, round
after round (``--repeats``), so drift on a shared machine hits each alike. Writes a Markdown
report of medians, and per-round ratios to "off", to ``--report``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import orjson

from loadtests import servers, wrk
from loadtests.otlp_sink import otlp_receiver

IMAGE = np.random.default_rng(0).random((1, 8, 8), dtype=np.float32)
BODY = orjson.dumps({"instances": IMAGE.tolist()})
HEADERS = {"Content-Type": "application/json"}


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--baseline", type=Path, help="a checkout of batchserve before tracing")
    parser.add_argument("--report", type=Path, default=Path("docs/bench/tracing/report.md"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.duration_s <= 0:
        parser.error(
            f"--repeats must be >= 1 and --duration-s > 0, got {args.repeats}, {args.duration_s}"
        )
    base = {"BATCHSERVE_DEVICE": "cpu", "BATCHSERVE_LOG_LEVEL": "warning"}
    plain_env = {k: v for k, v in servers.server_env(base).items() if not k.startswith("OTEL_")}
    results: dict[str, list[wrk.WrkResult]] = {}
    with tempfile.TemporaryDirectory(prefix="batchserve-tracing-") as folder, ExitStack() as stack:
        scratch = Path(folder)
        sink = stack.enter_context(otlp_receiver(keep=False))
        exporting = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        configurations: dict[str, tuple[list[str], dict[str, str], Path | None]] = {
            "tracing off": (servers.batchserve_command(), plain_env, None),
            "tracing on, 100 % sampled": (
                servers.batchserve_command(),
                plain_env | exporting | {"OTEL_TRACES_SAMPLER": "always_on"},
                None,
            ),
            "tracing on, 10 % sampled": (
                servers.batchserve_command(),
                plain_env
                | exporting
                | {
                    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": "0.1",
                },
                None,
            ),
        }
        if args.baseline is not None:
            baseline = args.baseline.resolve()
            configurations = {
                "before tracing (baseline)": (
                    servers.checkout_command(baseline),
                    plain_env,
                    baseline,
                ),
                **configurations,
            }
        urls = {}
        for index, (name, (command, env, cwd)) in enumerate(configurations.items()):
            server = stack.enter_context(
                servers.serving(command, env, scratch / f"server{index}.log", 180.0, cwd)
            )
            servers.check_answers(server.url, [BODY], HEADERS)
            urls[name] = server.url
        script = wrk.write_script(scratch / "bodies", [BODY], HEADERS)
        for _ in range(args.repeats):
            for name, url in urls.items():
                run = wrk.run_wrk(
                    url + "/predict",
                    script,
                    concurrency=args.concurrency,
                    duration_s=args.duration_s,
                )
                if run.errors:
                    raise RuntimeError(f"{name}: {run.errors} errors in {run.requests} requests")
                results.setdefault(name, []).append(run)
        spans = sink.count
    report = render(results, args, spans)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report)
    print(report)
    return 0


def render(results: dict[str, list[wrk.WrkResult]], args: argparse.Namespace, spans: int) -> str:
    off = results["tracing off"]
    lines = [
        "# Tracing overhead",
        "",
        f"`python -m loadtests.tracing_overhead --repeats {args.repeats} --duration-s "
        f"{args.duration_s:g}{' --baseline CHECKOUT' if args.baseline else ''}`: one digit per "
        f"`POST /predict` (JSON), {args.concurrency} wrk connections, one-process servers "
        "side by side, runs interleaved round by round. Medians over rounds; ratios are per "
        "round against tracing off, then their median.",
        "",
        f"Machine: {machine()}; no GPU; shared with other work, so compare within this table.",
        "",
        "| configuration | req/s | p50 ms | p99 ms | req/s vs off | p50 vs off | p99 vs off |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():

        def ratio(field: str, runs: list[wrk.WrkResult] = runs) -> float:
            return statistics.median(
                getattr(run, field) / getattr(base, field)
                for run, base in zip(runs, off, strict=True)
            )

        lines.append(
            f"| {name} | {statistics.median(r.requests_per_s for r in runs):,.0f} "
            f"| {statistics.median(r.p50_ms for r in runs):.2f} "
            f"| {statistics.median(r.p99_ms for r in runs):.2f} "
            f"| {ratio('requests_per_s'):.3f} | {ratio('p50_ms'):.3f} | {ratio('p99_ms'):.3f} |"
        )
    lines += [
        "",
        f"Spans received by the OTLP/HTTP receiver during the runs: {spans:,} (4 per sampled "
        "request: server, parse, engine, queue_wait; 4 per batch that served one: batch, "
        "collate, forward, split).",
        "",
        "Per round (req/s): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{run.requests_per_s:,.0f}" for run in runs)
            for name, runs in results.items()
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
