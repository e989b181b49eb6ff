"""A picture of one request's trace and the batch it shared, drawn from exported spans.

``python -m loadtests.trace_picture`` starts ``batchserve serve`` with two front ends and an
engine process, exporting OTLP/HTTP to a receiver in this process; sends a few bursts of
concurrent ``/predict`` requests; takes the batch that served the most requests, and draws
the trace of one request in it (front end and engine spans) above the batch's spans and the
other requests it served. Writes ``trace.png`` and the spans drawn (``trace.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import orjson

from loadtests import servers
from loadtests.otlp_sink import ReceivedSpan, otlp_receiver

REQUEST_SPAN = "POST /predict"
COLOURS = {"frontend": "#4C72B0", "engine": "#DD8452", "server": "#4C72B0"}


async def bursts(url: str, count: int, size: int) -> None:
    """``count`` bursts of ``size`` concurrent requests of 1 to 3 digits each."""
    rng = np.random.default_rng(0)
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        for _ in range(count):
            bodies = [
                orjson.dumps({"instances": rng.random((1 + index % 3, 8, 8)).tolist()})
                for index in range(size)
            ]
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/predict", content=body, headers={"content-type": "application/json"}
                    )
                    for body in bodies
                )
            )
            for answer in answers:
                answer.raise_for_status()


def chosen(spans: list[ReceivedSpan]) -> tuple[ReceivedSpan, ReceivedSpan, list[ReceivedSpan]]:
    """The batch linked to the most requests, the earliest of them, and all their request
    spans."""
    batches = [span for span in spans if span.name == "batch"]
    if not batches:
        raise RuntimeError("no batch span was received")
    batch = max(batches, key=lambda span: (len(span.links), span.start_ns))
    traces = {trace_id for trace_id, _ in batch.links}
    requests = sorted(
        (span for span in spans if span.name == REQUEST_SPAN and span.trace_id in traces),
        key=lambda span: span.start_ns,
    )
    return batch, requests[0], requests


def draw(spans: list[ReceivedSpan], output: Path) -> list[ReceivedSpan]:
    """Draw the picture into ``output``; the spans drawn."""
    batch, request, requests = chosen(spans)
    own = sorted(
        (span for span in spans if span.trace_id == request.trace_id),
        key=lambda span: (span.start_ns, -span.end_ns),
    )
    phases = sorted(
        (span for span in spans if span.parent_span_id == batch.span_id),
        key=lambda span: span.start_ns,
    )
    others = [span for span in requests if span is not request]
    rows: list[tuple[str, ReceivedSpan | None]] = [(f"{s.name}  [{s.role}]", s) for s in own]
    rows += [("", None), (f"batch  [{batch.role}]", batch)]
    rows += [(f"  {span.name}", span) for span in phases]
    rows += [("", None)]
    rows += [(f"other request in the batch ({i + 1})", span) for i, span in enumerate(others)]
    origin = request.start_ns
    figure, axes = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.8))
    for index, (_, span) in enumerate(rows):
        if span is None:
            continue
        colour = "#B0B0B0" if span in others else COLOURS.get(span.role, "#55A868")
        axes.barh(
            index,
            (span.end_ns - span.start_ns) / 1e6,
            left=(span.start_ns - origin) / 1e6,
            height=0.6,
            color=colour,
        )
    axes.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the request arrived")
    attributes = batch.attributes
    request_rows = dict(
        zip(
            request.attributes.get("batchserve.batch.span_ids", ()),
            request.attributes.get("batchserve.batch.rows", ()),
            strict=False,
        )
    )
    axes.set_title(
        f"One request ({request_rows.get(batch.span_id, '?')} rows) and the batch it shared: "
        f"{attributes.get('batchserve.batch.requests')} requests, "
        f"{attributes.get('batchserve.batch.rows')} rows "
        f"(padded {attributes.get('batchserve.batch.padded_rows')}), "
        f"{attributes.get('batchserve.model')}@{attributes.get('batchserve.model.version')}, "
        f"{attributes.get('batchserve.device')} {attributes.get('batchserve.precision')}",
        fontsize=10,
    )
    axes.grid(axis="x", alpha=0.3)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLOURS["frontend"]),
        plt.Rectangle((0, 0), 1, 1, color=COLOURS["engine"]),
        plt.Rectangle((0, 0), 1, 1, color="#B0B0B0"),
    ]
    axes.legend(
        handles,
        ["front-end process", "engine process", "batch-mates (their request spans)"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.07),
        ncol=3,
        fontsize=8,
    )
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return [span for _, span in rows if span is not None]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("docs/bench/tracing/trace.png"))
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--burst-size", type=int, default=16)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchserve-trace-") as folder, otlp_receiver() as sink:
        env = servers.server_env(
            {
                "BATCHSERVE_DEVICE": "cpu",
                "BATCHSERVE_LOG_LEVEL": "warning",
                "BATCHSERVE_WORKERS": "2",
                "BATCHSERVE_ENGINE_MODE": "process",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            }
        )
        command = servers.batchserve_command()
        with servers.serving(command, env, Path(folder) / "server.log", 180.0) as server:
            asyncio.run(bursts(server.url, 1, 2))  # both front ends connected, warm
            sent_after = len(sink.received())
            asyncio.run(bursts(server.url, args.bursts, args.burst_size))
            deadline_s = time.monotonic() + 20.0
            expected = args.bursts * args.burst_size
            while time.monotonic() < deadline_s:
                requests = [s for s in sink.received()[sent_after:] if s.name == REQUEST_SPAN]
                if len(requests) >= expected:
                    break
                time.sleep(0.2)
            time.sleep(0.5)  # the engine's last batch spans
        drawn = draw(sink.received(), args.output)
    args.output.with_suffix(".json").write_bytes(
        orjson.dumps([dataclasses.asdict(span) for span in drawn], option=orjson.OPT_INDENT_2)
    )
    print(f"wrote {args.output} ({len(drawn)} spans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
