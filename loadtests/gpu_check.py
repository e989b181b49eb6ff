"""Check the CUDA paths: both demo models under fp16/bf16 autocast, eager and compiled.

    python -m loadtests.gpu_check [--requests 2000] [--budget-s 270]

For each configuration it builds the real one-process app (front end and engine: store ->
runner -> batcher), sends one request through HTTP, then drives the engine with concurrent
requests, as the front end submits them (``Engine.infer``), and prints throughput, p99
latency, peak device memory and the largest deviation from an fp32 eager reference on the
same inputs. On a machine without CUDA it says so, skips the CUDA configurations and checks
the CPU equivalents it can (bf16 autocast, and torch.compile in fp32), so CI runs this script
too. ``--skip-compile`` leaves the compiled configurations out (compiling takes tens of
seconds per model on a small CPU).

Tolerances against fp32, relative to the largest reference output magnitude:
- compiled fp32: 1e-4 (same arithmetic, different kernel fusion and summation order);
- fp16 autocast: 1e-2 (10-bit mantissa, about 3 decimal digits, error grows with depth);
- bf16 autocast: 5e-2 (8-bit mantissa, about 2 decimal digits).
Plus, for digits, the predicted class must agree with fp32 on at least 98% of inputs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch
from asgi_lifespan import LifespanManager

from service.bridge.interface import InferenceRequest
from service.config import Settings
from service.engine.engine import Engine
from service.frontend.inputs import InputLayout
from service.frontend.state import FrontendState
from service.server.single import create_app

RELATIVE_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
CONCURRENCY = 64
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Configuration:
    model: str
    device: str
    precision: str
    compile_mode: str
    max_batch_size: int


@dataclass
class Outcome:
    configuration: Configuration
    rows_per_s: float
    p99_ms: float
    peak_memory_mb: float
    max_relative_error: float
    class_agreement: float | None
    passed: bool
    note: str = ""


def example_inputs(model: str, count: int, seed: int = 0) -> list[np.ndarray]:
    """Distinct single-instance inputs of each model's one input: digits images, or token
    sequences of mixed lengths."""
    rng = np.random.default_rng(seed)
    if model == "digits":
        return [rng.random((1, 8, 8), dtype=np.float32) for _ in range(count)]
    lengths = np.exp(rng.uniform(np.log(8), np.log(256), size=count)).astype(int)
    return [rng.integers(1, 1000, size=(1, int(length))) for length in lengths]


def configurations(cuda: bool, *, compile_models: bool = True) -> list[Configuration]:
    if not cuda:
        found = [Configuration(model, "cpu", "bf16", "off", 32) for model in ("digits", "textenc")]
        if compile_models:
            found += [Configuration(m, "cpu", "fp32", "default", 8) for m in ("digits", "textenc")]
        return found
    found = []
    for model in ("digits", "textenc"):
        for precision in ("fp16", "bf16"):
            found.append(Configuration(model, "cuda", precision, "off", 64))
            # Compiling every padded batch size costs tens of seconds each: keep them few.
            found.append(Configuration(model, "cuda", precision, "default", 8))
    return found


async def run_configuration(
    configuration: Configuration, inputs: list[np.ndarray], reference: list[np.ndarray]
) -> Outcome:
    settings = Settings(
        model_name=configuration.model,
        device=configuration.device,
        precision=configuration.precision,
        compile_mode=configuration.compile_mode,
        max_batch_size=configuration.max_batch_size,
        max_queue_size=100_000,
        request_timeout_ms=int(REQUEST_TIMEOUT_S * 1000),
    )
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=600):
        await app.state.loading
        engine: Engine = app.state.engine
        frontend: FrontendState = app.state.frontend
        if engine.served is None:
            raise RuntimeError(engine.state.load_error)
        layout = frontend.layout_for(engine.served.info())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://check") as client:
            response = await client.post("/predict", json={"instances": inputs[0].tolist()})
            response.raise_for_status()
        if configuration.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        outputs, latencies_s, elapsed_s = await drive(engine, layout, inputs)
        peak_mb = (
            torch.cuda.max_memory_allocated() / 2**20
            if configuration.device.startswith("cuda")
            else 0.0
        )
    scale = max(float(np.abs(row).max()) for row in reference)
    errors = [
        float(np.abs(out - ref).max()) / scale for out, ref in zip(outputs, reference, strict=True)
    ]
    agreement = None
    if configuration.model == "digits":
        agreement = float(
            np.mean(
                [out.argmax() == ref.argmax() for out, ref in zip(outputs, reference, strict=True)]
            )
        )
    tolerance = RELATIVE_TOLERANCE[configuration.precision]
    passed = max(errors) <= tolerance and (agreement is None or agreement >= 0.98)
    return Outcome(
        configuration=configuration,
        rows_per_s=len(inputs) / elapsed_s,
        p99_ms=float(np.percentile(latencies_s, 99) * 1000),
        peak_memory_mb=peak_mb,
        max_relative_error=max(errors),
        class_agreement=agreement,
        passed=passed,
    )


async def drive(
    engine: Engine, layout: InputLayout, inputs: list[np.ndarray]
) -> tuple[list[np.ndarray], list[float], float]:
    """Closed-loop load straight into the engine: CONCURRENCY callers, each input once."""
    served = engine.served
    assert served is not None
    # Both demo models take one input and answer one output.
    [input_name] = layout.names
    output_name = served.manifest.output.name
    outputs: list[Any] = [None] * len(inputs)
    latencies_s: list[float] = []
    next_index = 0

    async def caller() -> None:
        nonlocal next_index
        while next_index < len(inputs):
            index = next_index
            next_index += 1
            instances = layout.check({input_name: inputs[index]})  # as the front end does
            request = InferenceRequest(
                model=served.manifest.name,
                version=served.manifest.version,
                instances=instances,
                priority="normal",
                deadline_s=time.monotonic() + REQUEST_TIMEOUT_S,
                request_id=f"gpu-check-{index}",
            )
            started_s = time.perf_counter()
            result = await engine.infer(request)
            latencies_s.append(time.perf_counter() - started_s)
            outputs[index] = result.outputs[output_name][0]

    started_s = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    return outputs, latencies_s, time.perf_counter() - started_s


def fp32_reference(model: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Each input alone through the fp32 eager model on the CPU: the first row of its first
    output, called and read as the runner calls it and reads it."""
    from service.config import BUNDLED_MODEL_REPOSITORY
    from service.engine.model_store import ModelStore
    from service.engine.outputs import call_model, named_outputs

    loaded = ModelStore(BUNDLED_MODEL_REPOSITORY).load(model)
    manifest = loaded.manifest
    names = [spec.name for spec in manifest.inputs]
    [name] = names
    references = []
    with torch.inference_mode():
        for array in inputs:
            raw = call_model(loaded.module, {name: torch.from_numpy(array)}, names)
            output = named_outputs(raw, manifest.outputs)[manifest.output.name]
            references.append(output[0].float().numpy())
    return references


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per configuration")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting new ones")
    parser.add_argument(
        "--skip-compile", action="store_true", help="leave out the torch.compile configurations"
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    started_s = time.monotonic()
    if cuda:
        print(f"CUDA: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        print(
            f"CUDA not available (torch {torch.__version__}): skipped the CUDA configurations "
            "(fp16/bf16 x eager/compiled on cuda); checking bf16 autocast and torch.compile "
            "on the CPU instead."
        )
    print("| model | device | precision | compile | max batch | rows/s | p99 ms | peak MiB |"
          " max rel. error | class agreement | result |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    references: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    failures = 0
    for configuration in configurations(cuda, compile_models=not args.skip_compile):
        if time.monotonic() - started_s > args.budget_s:
            print(f"| {configuration.model} | ... | skipped: time budget of {args.budget_s} s |")
            continue
        if configuration.model not in references:
            inputs = example_inputs(configuration.model, args.requests)
            references[configuration.model] = (inputs, fp32_reference(configuration.model, inputs))
        inputs, reference = references[configuration.model]
        outcome = asyncio.run(run_configuration(configuration, inputs, reference))
        failures += not outcome.passed
        agreement = "" if outcome.class_agreement is None else f"{outcome.class_agreement:.1%}"
        print(
            f"| {configuration.model} | {configuration.device} | {configuration.precision} | "
            f"{configuration.compile_mode} | {configuration.max_batch_size} | "
            f"{outcome.rows_per_s:,.0f} | {outcome.p99_ms:.1f} | {outcome.peak_memory_mb:.0f} | "
            f"{outcome.max_relative_error:.2e} | {agreement} | "
            f"{'ok' if outcome.passed else 'FAILED'} |",
            flush=True,
        )
    print(f"finished in {time.monotonic() - started_s:.0f} s, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
