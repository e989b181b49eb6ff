"""What a model is called with and what it returns, matched against its manifest.

A model with one input is called with it positionally (``model(images)``); a model with
several inputs with keyword arguments named as the inputs (``model(input_ids=...,
attention_mask=...)``, as HuggingFace models take them). It may return a tensor (one output),
a tuple or list (outputs in the manifest's order) or a dict (outputs by name; extra entries
are ignored). ``check_forward`` runs a model once on example inputs and names every output
whose name, dtype or shape differs from the manifest, at packaging and at warm-up;
``check_max_length`` runs it at its longest input, at packaging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from service.buckets import DEFAULT_MAX_LENGTH
from service.errors import ModelLoadError
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays
from service.types import Array

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class OutputMismatchError(ValueError):
    """The model's outputs differ from what its manifest declares."""


def call_model(
    forward: Callable[..., object], inputs: Mapping[str, torch.Tensor], names: Sequence[str]
) -> object:
    """One input positionally, several as keyword arguments by name."""
    if len(names) == 1:
        return forward(inputs[names[0]])
    return forward(**{name: inputs[name] for name in names})


def named_outputs(raw: object, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """The model's return value as ``{output name: tensor}``, in the manifest's order."""
    names = [spec.name for spec in specs]
    if isinstance(raw, torch.Tensor):
        if len(specs) != 1:
            raise OutputMismatchError(
                f"the model returned one tensor; the manifest declares {len(specs)} outputs {names}"
            )
        return {names[0]: raw}
    if isinstance(raw, tuple | list):
        if len(raw) != len(specs):
            raise OutputMismatchError(
                f"the model returned {len(raw)} outputs; the manifest declares {len(specs)} {names}"
            )
        outputs = dict(zip(names, raw, strict=True))
    elif isinstance(raw, Mapping):
        missing = [name for name in names if name not in raw]
        if missing:
            raise OutputMismatchError(
                f"the model returned outputs {sorted(map(str, raw))}; the manifest declares "
                f"{names}, so {missing} are missing"
            )
        outputs = {name: raw[name] for name in names}
    else:
        raise OutputMismatchError(
            f"the model must return a tensor, a tuple or a dict of tensors, got "
            f"{type(raw).__name__}"
        )
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor):
            raise OutputMismatchError(f"output {name!r} is a {type(value).__name__}, not a tensor")
    return outputs


def to_host(
    outputs: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec], rows: int
) -> NamedArrays:
    """The first ``rows`` rows of each output, on the CPU, in its declared dtype (bfloat16
    as float32: numpy has none). One device-to-host copy per output and batch."""
    host = {}
    for spec in specs:
        tensor = outputs[spec.name]
        if tensor.ndim == 0 or tensor.shape[0] < rows:
            raise OutputMismatchError(
                f"output {spec.name!r} has shape {tuple(tensor.shape)}: fewer rows than the "
                f"batch's {rows}"
            )
        target = torch.float32 if spec.dtype == "bfloat16" else TORCH_DTYPES[spec.dtype]
        host[spec.name] = tensor[:rows].to("cpu", target).numpy()
    return NamedArrays(host)


def mismatches(
    outputs: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec], rows: int, autocast: bool
) -> list[str]:
    """Each declared output whose shape or dtype the model does not produce, named with
    both. Under autocast a floating output may come in another float width (it is cast)."""
    problems = []
    for spec in specs:
        tensor = outputs[spec.name]
        shape = tuple(tensor.shape)
        declared = (rows, *spec.shape[1:])
        if len(shape) != len(declared) or any(
            size != -1 and size != got for size, got in zip(declared, shape, strict=True)
        ):
            problems.append(
                f"output {spec.name!r}: the manifest declares shape {spec.shape}, the model "
                f"returned {shape} for {rows} rows"
            )
        produced = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        both_float = tensor.dtype.is_floating_point and spec.numpy_dtype.kind == "f"
        if produced != spec.dtype and not (autocast and both_float):
            problems.append(
                f"output {spec.name!r}: the manifest declares dtype {spec.dtype}, the model "
                f"returned {produced}"
            )
    return problems


def example_inputs(
    manifest: Manifest, rows: int, length: int, rng: np.random.Generator
) -> dict[str, Array]:
    """Realistic example inputs: ``rows`` instances, ``length`` long on the variable axis."""
    return {spec.name: spec.example_instances(rows, length, rng) for spec in manifest.inputs}


def example_tensors(
    manifest: Manifest, rows: int, length: int, seed: int
) -> dict[str, torch.Tensor]:
    """``example_inputs`` (seeded) as tensors of the declared dtypes."""
    arrays = example_inputs(manifest, rows, length, np.random.default_rng(seed))
    return {
        spec.name: torch.from_numpy(arrays[spec.name]).to(TORCH_DTYPES[spec.dtype])
        for spec in manifest.inputs
    }


def run_on_examples(
    module: torch.nn.Module, manifest: Manifest, rows: int, length: int, seed: int
) -> object:
    """What ``module`` returns for ``rows`` example rows ``length`` long (seeded), as packaging
    checks a version: the outputs, the lengths they follow, the longest input."""
    tensors = example_tensors(manifest, rows, length, seed)
    with torch.inference_mode():
        return call_model(module, tensors, [spec.name for spec in manifest.inputs])


def check_forward(module: torch.nn.Module, manifest: Manifest) -> None:
    """Run ``module`` on 2 example rows (8 long, or ``max_length`` if shorter) and refuse it,
    naming each mismatch, unless it returns the manifest's outputs."""
    variable = manifest.variable_input
    length = min(8, variable.max_length or 8) if variable is not None else 1
    try:
        outputs = named_outputs(run_on_examples(module, manifest, 2, length, 0), manifest.outputs)
    except Exception as error:
        shapes = {
            spec.name: (2, *(length if size == -1 else size for size in spec.instance_shape))
            for spec in manifest.inputs
        }
        raise ModelLoadError(
            f"{manifest.label}: the model fails on example inputs {shapes}: "
            f"{type(error).__name__}: {error}"
        ) from error
    problems = mismatches(outputs, manifest.outputs, 2, autocast=False)
    if problems:
        raise ModelLoadError(f"{manifest.label}: " + "; ".join(problems))


def check_max_length(module: torch.nn.Module, manifest: Manifest) -> None:
    """Run one example row as long as the variable input's ``max_length`` (the server's
    default when it declares none): a length beyond what the model holds (its position
    embeddings) is refused at packaging, naming the length, rather than failing the warm-up
    as "index out of range in self"."""
    variable = manifest.variable_input
    if variable is None:
        return
    length = variable.max_length or DEFAULT_MAX_LENGTH
    try:
        run_on_examples(module, manifest, 1, length, 0)
    except Exception as error:
        declared = (
            f"max_length {length}"
            if variable.max_length is not None
            else f"the default max_length {length} (none is declared)"
        )
        raise ModelLoadError(
            f"{manifest.label}: {declared} of input {variable.name!r} is more than the model "
            f"can hold: one row {length} long fails with {type(error).__name__}: {error}. "
            "Declare a max_length the model holds (e.g. its position embeddings)"
        ) from error
