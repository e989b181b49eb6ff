"""What handlers cost per request, and how serving them scales with front ends.

Two measures (``python -m loadtests.handlers``; prints a Markdown report), and a third with
``--hf``:

1. In this process, each demo handler's ``preprocess`` and ``postprocess`` alone: median
   microseconds per request over ``--calls`` calls (no HTTP, no model).
2. Real servers on 127.0.0.1 under wrk (closed loop, ``--concurrency`` connections,
   ``--duration-s`` each, ``--repeats`` rounds interleaved), for each handler model beside the
   same weights without a handler, fed what a client that preprocesses itself would send:
   ``sentiment`` (a review as text) vs ``sentiment_tensors`` (its token ids and mask), and
   ``digits_png`` (a PNG upload) vs ``digits`` (its 8x8 pixels as JSON); each with one process
   (``--workers 1``) and with two front ends and an engine process (``--workers 2``).
3. ``--hf`` (needs the hf extra): ``package --hf`` versions of the tiny models of
   ``tests/hf_folders.py``, saved, packaged and run in this process: each handler's
   ``preprocess``, the version's module, then ``postprocess``, compared with ``transformers``'
   pipeline on the same folder (largest score gap, or largest feature gap); then each
   handler's ``preprocess`` + ``postprocess`` alone, median microseconds per one-instance
   request, beside the built-in handlers.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer

from loadtests import servers, wrk
from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore
from service.engine.outputs import call_model, named_outputs
from service.frontend.handlers.base import (
    Handler,
    HandlerContext,
    HandlerRequest,
    build_handler,
)
from service.frontend.inputs import InputLayout
from service.manifest import Manifest
from service.repository import ModelRepository
from service.server.cli import main as cli
from service.tensors import NamedArrays

REPOSITORY = ModelRepository(BUNDLED_MODEL_REPOSITORY)
REVIEWS = [
    "I loved this film, it was wonderful",
    "a dull and boring waste of time",
    "great acting and a moving story",
    "the plot made no sense and the ending was worse",
    "one of the best films I have seen this year",
    "terrible",
    "funny, warm and beautifully shot",
    "I want those two hours back",
]


@dataclass(frozen=True)
class Workload:
    """Requests for one model: bodies cycled by wrk, with their content type."""

    model: str
    bodies: list[bytes]
    content_type: str
    what: str
    handled: bool = False
    """Served through a handler (text, image) rather than as tensors."""


def handler_of(name: str) -> tuple[Manifest, Handler]:
    manifest = REPOSITORY.resolve(name)
    assert manifest.handler is not None, f"{name} has no handler"
    folder = REPOSITORY.version_folder(manifest.name, manifest.version)
    return manifest, build_handler(HandlerContext(manifest, folder, InputLayout(manifest)))


def drawn_digits(size: int) -> list[bytes]:
    """PNGs of the digits 0-9 drawn dark on white, ``size`` pixels square."""
    encoded = []
    for digit in range(10):
        image = Image.new("L", (size, size), 255)
        ImageDraw.Draw(image).text((size // 3, size // 6), str(digit), fill=0, font_size=size // 2)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


def workloads(image_size: int) -> list[Workload]:
    """Handler workloads beside the tensors a self-preprocessing client would send."""
    text = [orjson.dumps({"instances": [review]}) for review in REVIEWS]
    sentiment = REPOSITORY.resolve("sentiment")
    folder = REPOSITORY.version_folder("sentiment", sentiment.version)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = [
        orjson.dumps({"instances": [{"input_ids": e.ids, "attention_mask": e.attention_mask}]})
        for e in (tokenizer.encode(review) for review in REVIEWS)
    ]
    pngs = drawn_digits(image_size)
    _, image_handler = handler_of("digits_png")
    pixels = [
        orjson.dumps(
            {
                "instances": image_handler.preprocess(HandlerRequest(p, "image/png", "image/png"))[
                    "image"
                ].tolist()
            }
        )
        for p in pngs
    ]
    return [
        Workload("sentiment", text, "application/json", "text, tokenized by the server", True),
        Workload("sentiment_tensors", tokens, "application/json", "token ids and mask (JSON)"),
        Workload("digits_png", pngs, "image/png", f"{image_size}px PNG upload", True),
        Workload("digits", pixels, "application/json", "8x8 pixels (JSON)"),
    ]


def median_us(call: Callable[[], object], calls: int) -> float:
    timings = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings) * 1e6


def handler_costs(calls: int, image_size: int) -> list[str]:
    """Median preprocess and postprocess microseconds per request, in this process."""
    lines = [
        "## Handler cost per request (in process, no HTTP, no model)",
        "",
        f"Median of {calls} calls each.",
        "",
        "| handler | request | preprocess µs | postprocess µs |",
        "|---|---|---:|---:|",
    ]
    manifest, text = handler_of("sentiment")
    logits = NamedArrays(
        {
            "logits": np.array([[0.3, 1.2]], dtype=np.float32),
            "embedding": np.zeros((1, 32), dtype=np.float32),
        }
    )
    for count in (1, 8):
        body = orjson.dumps({"instances": REVIEWS[:count]})
        request = HandlerRequest(body, "application/json", "application/json")
        outputs = NamedArrays({name: np.repeat(a, count, 0) for name, a in logits.arrays.items()})
        pre = median_us(lambda r=request: text.preprocess(r), calls)  # type: ignore[misc]
        post = median_us(lambda o=outputs, r=request: text.postprocess(o, r), calls)  # type: ignore[misc]
        lines.append(
            f"| text ({manifest.name}) | {count} review(s), JSON | {pre:.0f} | {post:.0f} |"
        )
    manifest, image = handler_of("digits_png")
    png = drawn_digits(image_size)[7]
    scores = NamedArrays({"logits": np.linspace(-1, 1, 10, dtype=np.float32)[np.newaxis]})
    for label, request in (
        (f"{image_size}px PNG body", HandlerRequest(png, "image/png", "image/png")),
        (
            f"{image_size}px PNG, base64 JSON",
            HandlerRequest(
                orjson.dumps({"instances": [{"b64": base64.b64encode(png).decode()}]}),
                "application/json",
                "application/json",
            ),
        ),
    ):
        pre = median_us(lambda r=request: image.preprocess(r), calls)  # type: ignore[misc]
        post = median_us(lambda r=request: image.postprocess(scores, r), calls)  # type: ignore[misc]
        lines.append(f"| image ({manifest.name}) | {label} | {pre:.0f} | {post:.0f} |")
    return lines


def served(
    scratch: Path,
    workload: Workload,
    workers: int,
    threads: int,
    concurrency: int,
    duration_s: float,
) -> wrk.WrkResult:
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_MODEL_NAME": workload.model,
            "BATCHSERVE_WORKERS": str(workers),
            "BATCHSERVE_HANDLER_THREADS": str(threads),
        }
    )
    name = f"{workload.model}-w{workers}-t{threads}"
    log = scratch / f"{name}.log"
    headers = {"Content-Type": workload.content_type}
    script = wrk.write_script(scratch / name, workload.bodies, headers)
    with servers.running(servers.batchserve_command(), env, log, ready_timeout_s=180) as url:
        servers.check_answers(url, workload.bodies[:2], headers)
        wrk.run_wrk(url + "/predict", script, concurrency=concurrency, duration_s=1)  # warm
        return wrk.run_wrk(url + "/predict", script, concurrency=concurrency, duration_s=duration_s)


def throughput(
    scratch: Path,
    image_size: int,
    concurrency: int,
    duration_s: float,
    repeats: int,
    handler_threads: Sequence[int],
) -> list[str]:
    results: dict[tuple[str, int, int], list[wrk.WrkResult]] = {}
    chosen = workloads(image_size)
    points = [
        (workload, workers, threads)
        for workload in chosen
        for workers in (1, 2)
        for threads in (handler_threads if workload.handled else handler_threads[:1])
    ]
    for _ in range(repeats):
        for workload, workers, threads in points:
            result = served(scratch, workload, workers, threads, concurrency, duration_s)
            results.setdefault((workload.model, workers, threads), []).append(result)
            print(
                f"{workload.model} workers={workers} threads={threads}: "
                f"{result.requests_per_s:,.0f} req/s",
                file=sys.stderr,
                flush=True,
            )
    lines = [
        "## Served: handler models beside the same weights fed tensors",
        "",
        f"wrk, {concurrency} connections, {duration_s:.0f} s per point, {repeats} round(s) "
        "interleaved; medians over rounds. `--workers 1` is one process; `--workers 2` is two "
        "front ends (gunicorn) and one engine process. Handler threads: "
        "`BATCHSERVE_HANDLER_THREADS` (0: preprocessing on the event loop; tensor models never "
        "use them).",
        "",
        "| model | request | workers | handler threads | req/s | p50 ms | p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, workers, threads in points:
        runs = results[(workload.model, workers, threads)]
        lines.append(
            f"| {workload.model} | {workload.what} | {workers} | "
            f"{threads if workload.handled else '-'} | "
            f"{statistics.median(r.requests_per_s for r in runs):,.0f} | "
            f"{statistics.median(r.p50_ms for r in runs):.2f} | "
            f"{statistics.median(r.p99_ms for r in runs):.2f} | "
            f"{sum(r.errors for r in runs)} |"
        )
    return lines


# ------------------------------------------------------- package --hf versions

HF_TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "a dull story about Berlin and London",
    "Ada Lovelace wrote the first program in London",
]
HF_NAMES = {
    "text-classification": "sentiment",
    "token-classification": "tagger",
    "feature-extraction": "embedder",
    "image-classification": "vit",
}


def random_png(seed: int, height: int = 40, width: int = 50) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def stored_handler(store: ModelStore, name: str) -> Handler:
    manifest = store.resolve(name)
    folder = store.version_folder(manifest.name, manifest.version)
    return build_handler(
        HandlerContext(manifest=manifest, folder=folder, layout=InputLayout(manifest))
    )


def request_of(body: str | bytes) -> HandlerRequest:
    if isinstance(body, bytes):
        return HandlerRequest(body=body, media_type="image/png", content_type="image/png")
    encoded = body.encode()
    return HandlerRequest(body=encoded, media_type="text/plain", content_type="text/plain")


def served_answer(store: ModelStore, name: str, body: str | bytes) -> Any:
    """What /predict answers (one instance), without the transport and the batcher."""
    loaded = store.load(name)
    handler = stored_handler(store, name)
    request = request_of(body)
    inputs = handler.preprocess(request)
    names = [spec.name for spec in loaded.manifest.inputs]
    tensors = {key: torch.from_numpy(np.asarray(inputs[key])) for key in names}
    with torch.inference_mode():
        raw = named_outputs(call_model(loaded.module, tensors, names), loaded.manifest.outputs)
    outputs = NamedArrays({key: value.numpy() for key, value in raw.items()})
    return handler.postprocess(outputs, request)[0]


def parity(store: ModelStore, folders: dict[str, Path]) -> list[str]:
    from transformers import pipeline

    rows = ["| task | instances | largest gap to the pipeline |", "| --- | --- | --- |"]
    for task, folder in folders.items():
        options = {"aggregation_strategy": "simple"} if task == "token-classification" else {}
        pipe = pipeline(task, model=str(folder), **options)  # type: ignore[call-overload]
        gaps: list[float] = []
        bodies: list[str | bytes] = (
            [random_png(seed) for seed in range(4)]
            if task == "image-classification"
            else list(HF_TEXTS)
        )
        for body in bodies:
            got = served_answer(store, HF_NAMES[task], body)
            if task == "image-classification":
                want = pipe(Image.open(io.BytesIO(body)))  # type: ignore[arg-type]
            else:
                want = pipe(body)
            if task == "feature-extraction":
                expected = np.asarray(want)[0].mean(axis=0)
                gaps.append(float(np.abs(np.asarray(got) - expected).max()))
                continue
            if task == "text-classification":
                want = want[:1]
            assert len(got) == len(want), (got, want)
            gaps.extend(abs(a["score"] - float(b["score"])) for a, b in zip(got, want, strict=True))
        rows.append(f"| {task} | {len(bodies)} | {max(gaps, default=0.0):.2e} |")
    return rows


def handler_cost(store: ModelStore, name: str, body: str | bytes, calls: int) -> float:
    handler = stored_handler(store, name)
    request = request_of(body)
    inputs = handler.preprocess(request)
    loaded = store.load(name)
    names = [spec.name for spec in loaded.manifest.inputs]
    tensors = {key: torch.from_numpy(np.asarray(inputs[key])) for key in names}
    with torch.inference_mode():
        raw = named_outputs(call_model(loaded.module, tensors, names), loaded.manifest.outputs)
    outputs = NamedArrays({key: value.numpy() for key, value in raw.items()})

    def both() -> None:
        handler.preprocess(request)
        handler.postprocess(outputs, request)

    return median_us(both, calls)


def hf_costs(store: ModelStore, calls: int) -> list[str]:
    bundled = ModelStore(BUNDLED_MODEL_REPOSITORY)
    rows = [
        "| handler (model) | body | µs per request (pre + post) |",
        "| --- | --- | --- |",
    ]
    text = HF_TEXTS[0]
    image = random_png(0, 240, 320)
    cases: list[tuple[str, ModelStore, str, str | bytes, str]] = [
        ("TextHandler (sentiment, built-in)", bundled, "sentiment", text, "text, 7 words"),
        ("HFTextHandler (--hf text-classification)", store, "sentiment", text, "text, 7 words"),
        (
            "HFTextHandler, tensors (--hf feature-extraction)",
            store,
            "embedder",
            text,
            "text, 7 words",
        ),
        ("TokenClassificationHandler (--hf, simple)", store, "tagger", text, "text, 7 words"),
        ("ImageHandler (digits_png, built-in)", bundled, "digits_png", image, "PNG 320x240"),
        ("ImageHandler (--hf image-classification)", store, "vit", image, "PNG 320x240"),
    ]
    for label, source, name, body, described in cases:
        rows.append(f"| {label} | {described} | {handler_cost(source, name, body, calls):.0f} |")
    return rows


def hf_versions(calls: int) -> list[str]:
    """``package --hf`` versions: parity with the pipelines, then their handlers' cost."""
    from tests.hf_folders import TEXT_TASKS, save_image_model, save_text_model

    with tempfile.TemporaryDirectory(prefix="batchserve-hf-") as scratch:
        root = Path(scratch)
        folders = {task: save_text_model(root / task, task) for task in TEXT_TASKS}
        folders["image-classification"] = save_image_model(root / "image-classification")
        repository = root / "repository"
        for task, folder in folders.items():
            arguments = ["package", "--repository", str(repository), "--hf", str(folder)]
            if cli([*arguments, "--name", HF_NAMES[task]]) != 0:
                raise SystemExit(f"packaging {task} failed")
        store = ModelStore(repository)
        return [
            "## `package --hf` versions: parity with the pipelines",
            "",
            *parity(store, folders),
            "",
            "## `package --hf` handlers: cost per request (in process)",
            "",
            f"Median of {calls} calls each.",
            "",
            *hf_costs(store, calls),
            "",
        ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000, help="calls per in-process figure")
    parser.add_argument("--image-size", type=int, default=224, help="side of the PNGs sent")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--handler-threads",
        type=int,
        nargs="+",
        default=[0, 2],
        help="BATCHSERVE_HANDLER_THREADS values to compare (the first for tensor models)",
    )
    parser.add_argument("--no-servers", action="store_true", help="only the in-process costs")
    parser.add_argument(
        "--hf", action="store_true", help="add package --hf versions (needs the hf extra)"
    )
    args = parser.parse_args(argv)
    report = ["# Handlers: cost per request and scaling with front ends", ""]
    report += [*handler_costs(args.calls, args.image_size), ""]
    if args.hf:
        report += hf_versions(args.calls)
    if not args.no_servers:
        with tempfile.TemporaryDirectory(prefix="batchserve-handlers-") as folder:
            report += throughput(
                Path(folder),
                args.image_size,
                args.concurrency,
                args.duration_s,
                args.repeats,
                args.handler_threads,
            )
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
