"""``package --hf`` versions: their parity with ``transformers``' pipelines, and what their
handlers cost per request beside the built-in handlers.

``python -m loadtests.hf`` (needs the hf extra; prints a Markdown report). The tiny models of
``tests/hf_folders.py`` are saved, packaged and run in this process: each handler's
``preprocess``, the version's module, then ``postprocess``, compared with the pipeline on the
same folder (largest score gap, or largest feature gap). Then each handler's ``preprocess`` +
``postprocess`` alone, median microseconds per one-instance request over ``--calls`` calls,
beside the demo handlers (``sentiment``'s ``TextHandler``, ``digits_png``'s ``ImageHandler``).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore
from service.engine.outputs import call_model, named_outputs
from service.frontend.handlers.base import Handler, HandlerContext, HandlerRequest, build_handler
from service.frontend.inputs import InputLayout
from service.server.cli import main as cli
from service.tensors import NamedArrays
from tests.hf_folders import TEXT_TASKS, save_image_model, save_text_model

TEXTS = [
    "I loved this movie, it was great",
    "the lazy dog in Paris",
    "a dull story about Berlin and London",
    "Ada Lovelace wrote the first program in London",
]
NAMES = {
    "text-classification": "sentiment",
    "token-classification": "tagger",
    "feature-extraction": "embedder",
    "image-classification": "vit",
}


def png(seed: int, height: int = 40, width: int = 50) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def handler_of(store: ModelStore, name: str) -> Handler:
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
    handler = handler_of(store, name)
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
        pipe = pipeline(task, model=str(folder), **options)
        gaps: list[float] = []
        bodies: list[str | bytes] = (
            [png(seed) for seed in range(4)] if task == "image-classification" else list(TEXTS)
        )
        for body in bodies:
            got = served_answer(store, NAMES[task], body)
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


def median_us(call: Callable[[], object], calls: int) -> float:
    timings = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings) * 1e6


def handler_cost(store: ModelStore, name: str, body: str | bytes, calls: int) -> float:
    handler = handler_of(store, name)
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


def costs(store: ModelStore, calls: int) -> list[str]:
    bundled = ModelStore(BUNDLED_MODEL_REPOSITORY)
    rows = [
        "| handler (model) | body | µs per request (pre + post) |",
        "| --- | --- | --- |",
    ]
    text = TEXTS[0]
    image = png(0, 240, 320)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchserve-hf-") as scratch:
        root = Path(scratch)
        folders = {task: save_text_model(root / task, task) for task in TEXT_TASKS}
        folders["image-classification"] = save_image_model(root / "image-classification")
        repository = root / "repository"
        for task, folder in folders.items():
            arguments = ["package", "--repository", str(repository), "--hf", str(folder)]
            if cli([*arguments, "--name", NAMES[task]]) != 0:
                raise SystemExit(f"packaging {task} failed")
        store = ModelStore(repository)
        print("\n".join(["## Parity", "", *parity(store, folders), ""]))
        print("\n".join(["## Handler cost", "", *costs(store, args.calls)]))


if __name__ == "__main__":
    main()
