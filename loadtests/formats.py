"""Each export format of a demo model, measured in process: time to load and answer a first
batch (ready to serve), rows/s at batch 1, 8 and 64, and the parity export recorded.

``python -m loadtests.formats [--models digits textenc]``: exports into a scratch copy of the
repository (``service.packaging.export``), then times each version with the runner's own call
(one thread per device, as served; medians over at most ``--seconds`` or ``--calls``).
Prints a Markdown table. AOTInductor compiles at export, not at load: its export time is
given beside it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson
import torch

from loadtests import servers, wrk
from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore
from service.engine.outputs import TORCH_DTYPES, call_model, example_inputs
from service.engine.runner import configure_torch_threads
from service.manifest import Manifest, ModelFormat
from service.packaging.export import export_version

FORMATS: dict[str, tuple[ModelFormat, ...]] = {
    "digits": ("torchscript", "exported_program", "aoti", "onnx"),
    "textenc": ("torchscript", "exported_program", "aoti", "onnx"),
}
BATCHES = (1, 8, 64)
LENGTH = 64


def inputs_for(manifest: Manifest, rows: int) -> dict[str, torch.Tensor]:
    arrays = example_inputs(manifest, rows, LENGTH, np.random.default_rng(rows))
    return {
        spec.name: torch.from_numpy(arrays[spec.name]).to(TORCH_DTYPES[spec.dtype])
        for spec in manifest.inputs
    }


def rows_per_s(module: torch.nn.Module, manifest: Manifest, rows: int, seconds: float) -> float:
    names = [spec.name for spec in manifest.inputs]
    batch = inputs_for(manifest, rows)
    timings: list[float] = []
    with torch.inference_mode():
        call_model(module, batch, names)  # compiles this shape, when compiled
        stop_s = time.monotonic() + seconds
        while len(timings) < 5 or (time.monotonic() < stop_s and len(timings) < 2000):
            started = time.perf_counter()
            call_model(module, batch, names)
            timings.append(time.perf_counter() - started)
    return rows / statistics.median(timings)


def measure(store: ModelStore, manifest: Manifest, seconds: float, compiled: bool) -> list[str]:
    """Ready time (load, and a first batch), rows/s at each batch size, parity and export
    time; ``compiled``: the module through ``torch.compile`` (its first call compiles)."""
    started = time.perf_counter()
    module = store.load(manifest.name, manifest.version).module
    if compiled:
        module = torch.compile(module)  # type: ignore[assignment]
    with torch.inference_mode():
        call_model(module, inputs_for(manifest, 1), [spec.name for spec in manifest.inputs])
    ready_s = time.perf_counter() - started
    rates = [rows_per_s(module, manifest, rows, seconds) for rows in BATCHES]
    parity = manifest.metadata.get("parity")
    export = manifest.metadata.get("export", {})
    kind = "compiled" if compiled else "eager"
    return [
        manifest.name,
        manifest.format if parity else f"{manifest.format} ({kind})",
        f"{ready_s:.2f}",
        *(f"{rate:,.0f}" for rate in rates),
        f"{parity['max_abs_diff']:.2g}" if parity else "-",
        f"{export['seconds']:.1f}" if export else "-",
    ]


def served(
    root: Path, manifest: Manifest, scratch: Path, seconds: float, compiled: bool
) -> list[str]:
    """Seconds from ``batchserve serve`` to ``/readyz`` 200, and req/s (p50 ms) at 1 and 64
    wrk connections, one instance per request (JSON)."""
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_MODEL_REPOSITORY": str(root),
            "BATCHSERVE_MODEL_NAME": manifest.name,
            "BATCHSERVE_MODEL_VERSION": manifest.version,
            "BATCHSERVE_COMPILE_MODE": "default" if compiled else "off",
        }
    )
    arrays = example_inputs(manifest, 1, 16, np.random.default_rng(0))
    instance = {name: array[0].tolist() for name, array in arrays.items()}
    only = [spec.name for spec in manifest.inputs]
    body = orjson.dumps({"instances": [instance[only[0]] if len(only) == 1 else instance]})
    headers = {"Content-Type": "application/json"}
    script = wrk.write_script(scratch / f"{manifest.version}-wrk", [body], headers)
    started = time.perf_counter()
    log = scratch / f"{manifest.version}-{compiled}.log"
    with servers.running(servers.batchserve_command(), env, log, ready_timeout_s=600) as url:
        ready_s = time.perf_counter() - started
        servers.check_answers(url, [body], headers)
        cells = [f"{ready_s:.1f}"]
        for concurrency in (1, 64):
            run = wrk.run_wrk(url + "/predict", script, concurrency=concurrency, duration_s=seconds)
            cells.append(f"{run.requests_per_s:,.0f} ({run.p50_ms:.2f})")
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(FORMATS))
    parser.add_argument("--seconds", type=float, default=2.0, help="per batch size")
    parser.add_argument(
        "--served", action="store_true", help="also start a server per version and run wrk"
    )
    args = parser.parse_args(argv)
    configure_torch_threads(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchserve-formats-") as folder:
        store = ModelStore(Path(folder))
        for name in args.models:
            source = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve(name)
            shutil.copytree(
                BUNDLED_MODEL_REPOSITORY / name / source.version,
                Path(folder) / name / source.version,
            )
            variants = [(source, False), (source, True)] + [
                (export_version(store, name, source.version, to), False) for to in FORMATS[name]
            ]
            for version, compiled in variants:
                row = measure(store, version, args.seconds, compiled)
                if args.served:
                    row += served(Path(folder), version, Path(folder), 5.0, compiled)
                rows.append(row)
    header = [
        "model", "format", "ready s", *(f"rows/s @{b}" for b in BATCHES), "parity (max abs)",
        "export s",
        *(["served: ready s", "req/s (p50 ms) c=1", "req/s (p50 ms) c=64"] if args.served else []),
    ]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
