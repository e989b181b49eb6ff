"""``batchserve export``: a version converted to another format, as a new version.

The source version is loaded (hashes verified), exported with a dynamic batch axis and, for
variable-length inputs, a dynamic length shared by them, and the result is loaded back and run
beside the source on a fixed seeded sample covering several batch sizes and lengths. Outside
the tolerance the export fails with the numbers; inside, the new version's manifest records
the source, the export settings and the parity measured (no timings: exporting the same
version again gives the same id, where the format's exporter writes the same bytes). A format
that cannot express the model fails with the exporter's own words, which name the operation.
An export is never ``latest`` (``service/repository.py``): it is served when named by its id.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.engine.model_store import ModelStore, build_module
from service.engine.outputs import call_model, example_tensors, named_outputs
from service.manifest import ARTIFACT_SUFFIXES, Manifest, ModelFormat
from service.packaging.package import Packager
from service.repository import one_line, sha256_of

logger = logging.getLogger(__name__)

EXPORT_FORMATS: tuple[ModelFormat, ...] = ("torchscript", "exported_program", "aoti", "onnx")
#: Largest batch the exported graphs are guarded for (dynamic axes need a bound).
MAX_BATCH = 4096
ONNX_OPSET = 18
#: Parity tolerance: every output within ``ATOL + RTOL * |source|`` of the source's.
ATOL = 1e-4
RTOL = 1e-3
PARITY_BATCH_SIZES = (1, 3, 16)
PARITY_LENGTHS = (3, 17, 64)


class ExportError(Exception):
    """The format cannot express the model, or the export's answers differ from the source."""


@dataclass(frozen=True)
class Parity:
    max_abs: float
    max_rel: float
    samples: int
    within: bool
    """Every output element within ``ATOL + RTOL * |source|`` of the source's."""

    def as_metadata(self) -> dict[str, Any]:
        return {
            "max_abs_diff": float(f"{self.max_abs:.3g}"),
            "max_rel_diff": float(f"{self.max_rel:.3g}"),
            "samples": self.samples,
            "tolerance": {"atol": ATOL, "rtol": RTOL},
        }


def export_version(store: ModelStore, name: str, version: str, to: ModelFormat) -> Manifest:
    """Export ``name`` at ``version`` to ``to`` and package it; returns the new manifest."""
    if to not in EXPORT_FORMATS:
        raise ExportError(f"export formats are {', '.join(EXPORT_FORMATS)}; got {to!r}")
    source = store.load(name, version)
    manifest, module = source.manifest, source.module  # built in eval mode
    settings = _settings(manifest, to)
    with tempfile.TemporaryDirectory(prefix="batchserve-export-") as scratch:
        artifact = Path(scratch) / ("model" + ARTIFACT_SUFFIXES[to])
        try:
            with _torch_deprecations_quiet():
                _write(module, manifest, to, artifact)
        except Exception as error:
            raise ExportError(
                f"{manifest.label} cannot be exported to {to}: {type(error).__name__}: "
                f"{_summary(error)}"
            ) from error
        draft = manifest.model_copy(
            update={
                "format": to,
                "artifact": artifact.name,
                "files": {artifact.name: sha256_of(artifact)},
            }
        )
        with _torch_deprecations_quiet():
            exported = build_module(draft, Path(scratch))
        parity = measure_parity(manifest, module, exported)
        if not parity.within:
            raise ExportError(
                f"{manifest.label} exported to {to} differs from the source: max absolute "
                f"difference {parity.max_abs:.3g}, max relative {parity.max_rel:.3g} over "
                f"{parity.samples} samples (tolerance atol {ATOL}, rtol {RTOL})"
            )
        folder = store.version_folder(manifest.name, manifest.version)
        files = [folder / file for file in manifest.files if file != manifest.artifact]
        return Packager(store.root).package(
            name=manifest.name,
            artifact=artifact,
            format=to,
            inputs=manifest.inputs,
            outputs=manifest.outputs,
            handler=manifest.handler,
            files=files,
            metadata={
                **manifest.metadata,
                "exported_from": manifest.label,
                "export": settings,
                "parity": parity.as_metadata(),
            },
        )


@contextlib.contextmanager
def _torch_deprecations_quiet() -> Iterator[None]:
    """torch warns of its own deprecations while exporting (TorchScript, the format, is
    deprecated; so are parts the exporters use): the export's user can do nothing about them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _summary(error: BaseException) -> str:
    """The exporter's own words on what failed, without its advice on filing issues: the
    ONNX exporter puts them after "Exception summary"."""
    text = one_line(error, 100_000)
    _, marker, summary = text.partition("Exception summary")
    return one_line(ValueError(summary if marker else text), 1200)


def _settings(manifest: Manifest, to: ModelFormat) -> dict[str, Any]:
    variable = manifest.variable_input
    settings: dict[str, Any] = {
        "format": to,
        "torch": torch.__version__,
        "dynamic_axes": {"batch": [1, MAX_BATCH]},
    }
    if variable is not None:
        settings["dynamic_axes"]["length"] = [1, variable.max_length or 512]
    if to == "onnx":
        settings["opset"] = ONNX_OPSET
    return settings


def _dynamic_shapes(manifest: Manifest) -> dict[str, dict[int, Any]]:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    variable = manifest.variable_input
    length = (
        torch.export.Dim("length", min=1, max=variable.max_length or 512)
        if variable is not None
        else None
    )
    shapes: dict[str, dict[int, Any]] = {}
    for spec in manifest.inputs:
        axes: dict[int, Any] = {0: batch}
        if spec.variable_axis is not None:
            axes[spec.variable_axis + 1] = length
        shapes[spec.name] = axes
    return shapes


def _write(module: torch.nn.Module, manifest: Manifest, to: ModelFormat, path: Path) -> None:
    names = [spec.name for spec in manifest.inputs]
    variable = manifest.variable_input
    length = min(8, variable.max_length or 8) if variable else 1
    example = example_tensors(manifest, 2, length, 2 * 1000 + length)
    args: tuple[torch.Tensor, ...] = (example[names[0]],) if len(names) == 1 else ()
    kwargs = {} if len(names) == 1 else example
    shapes = _dynamic_shapes(manifest)
    dynamic: Any = (shapes[names[0]],) if len(names) == 1 else shapes
    if to == "torchscript":
        with torch.inference_mode(False), torch.no_grad():
            traced = (
                torch.jit.trace(module, args)  # type: ignore[no-untyped-call]
                if args
                else torch.jit.trace(module, example_kwarg_inputs=kwargs)  # type: ignore[no-untyped-call]
            )
        torch.jit.save(traced, str(path))
        return
    if to == "onnx":
        # Outputs as a tuple in the manifest's order, named by position: an output named
        # like a node inside the model ("embedding") would be a duplicate name in the graph.
        # The wrapper takes every input positionally, in the manifest's order.
        program = torch.onnx.export(
            OrderedOutputs(module, manifest).eval(),
            tuple(example[name] for name in names),
            dynamic_shapes={"inputs": tuple(shapes[name] for name in names)},
            input_names=names,
            output_names=[f"output_{index}" for index in range(len(manifest.outputs))],
            opset_version=ONNX_OPSET,
            dynamo=True,
        )
        assert program is not None
        program.save(str(path))
        return
    exported = torch.export.export(module, args, kwargs=kwargs, dynamic_shapes=dynamic)
    if to == "exported_program":
        torch.export.save(exported, str(path))
    else:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


class OrderedOutputs(torch.nn.Module):
    """``module`` taking its inputs positionally and returning its outputs as a tuple, both
    in the manifest's order."""

    def __init__(self, module: torch.nn.Module, manifest: Manifest) -> None:
        super().__init__()
        self.module = module
        self.names = [spec.name for spec in manifest.inputs]
        self.specs = manifest.outputs

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raw = call_model(self.module, dict(zip(self.names, inputs, strict=True)), self.names)
        outputs = named_outputs(raw, self.specs)
        return tuple(outputs[spec.name] for spec in self.specs)


def measure_parity(
    manifest: Manifest, source: torch.nn.Module, exported: torch.nn.Module
) -> Parity:
    """Largest absolute and relative differences between the two on the seeded sample."""
    names = [spec.name for spec in manifest.inputs]
    variable = manifest.variable_input
    lengths = (
        [length for length in PARITY_LENGTHS if length <= (variable.max_length or 512)]
        if variable
        else [1]
    )
    max_abs = max_rel = 0.0
    samples = 0
    within = True
    for rows in PARITY_BATCH_SIZES:
        for length in lengths:
            inputs = example_tensors(manifest, rows, length, rows * 1000 + length)
            with torch.inference_mode():
                expected = named_outputs(call_model(source, inputs, names), manifest.outputs)
                got = named_outputs(call_model(exported, inputs, names), manifest.outputs)
            for spec in manifest.outputs:
                want = expected[spec.name].to(torch.float64)
                have = got[spec.name].to(torch.float64)
                if want.shape != have.shape:
                    raise ExportError(
                        f"output {spec.name!r}: the export answers shape {tuple(have.shape)} "
                        f"where the source answers {tuple(want.shape)}"
                    )
                difference = (want - have).abs()
                max_abs = max(max_abs, float(difference.max()))
                max_rel = max(max_rel, float((difference / want.abs().clamp(min=1e-6)).max()))
                within = within and bool((difference <= ATOL + RTOL * want.abs()).all())
            samples += rows
    return Parity(max_abs, max_rel, samples, within)
