"""Runs a model on its device: precision, compilation, warm-up batches, collation and
splitting.

Everything here runs on a device thread of the engine (``TorchRunner.executor``, shared by
every model of the engine; ``device_instances`` of them when a model runs as several
instances), so autocast (thread-local state) is entered in the thread that runs the model and
the event loop never runs model code. No asyncio here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from service.config import CompileMode, Precision
from service.cpus import usable_cpus
from service.engine.batcher.spans import BatchTimings
from service.engine.output_split import length_ties, split_rows
from service.engine.outputs import (
    OutputMismatchError,
    call_model,
    mismatches,
    named_outputs,
    to_host,
)
from service.errors import DeviceOutOfMemoryError, InferenceError, ModelLoadError
from service.manifest import TensorSpec
from service.tensors import NamedArrays, pad_axis

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES: dict[Precision, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def resolve_device(requested: str) -> torch.device:
    """Turn the ``device`` setting into a torch device, refusing CUDA where there is none."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device {requested!r} was requested but CUDA is not available; "
                "use device=cpu or device=auto"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {requested!r} does not exist: {torch.cuda.device_count()} CUDA "
                "device(s) are visible"
            )
    return device


def check_precision(precision: Precision, device: torch.device) -> None:
    """Refuse precisions the device cannot autocast to, with what to use instead."""
    if precision == "fp16" and device.type != "cuda":
        raise ModelLoadError(
            "precision fp16 needs a CUDA device (fp16 autocast on CPU is slow and inexact); "
            "use precision=bf16 or fp32 on CPU"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(f"device {device} does not support bf16; use precision=fp16")


def _in_eval_mode(model: torch.nn.Module) -> torch.nn.Module:
    try:
        return model.eval()
    except NotImplementedError:
        # Modules from torch.export refuse eval(); their mode was fixed when they were exported.
        return model


def configure_torch_threads(requested: int) -> int:
    """Set torch's intra-op thread count (process-wide); 0 picks usable CPUs minus one, at
    least 1.

    Small models gain little from many threads, and threads that spin between batches take
    the CPU away from the event loop parsing the next requests.
    """
    threads = requested or max(1, usable_cpus() - 1)
    torch.set_num_threads(threads)
    return threads


def batch_sizes_to_warm(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes = [1 << exponent for exponent in range(max_batch_size.bit_length())]
    return sorted({size for size in sizes if size < max_batch_size} | {max_batch_size})


class TorchRunner:
    """Owns a model on one device and runs batches of named numpy rows through it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        precision: Precision = "fp32",
        compile_mode: CompileMode = "off",
        max_batch_size: int,
        length_edges: Sequence[int] = (),
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """Inputs with a variable axis share one length (ids and mask): a batch pads each,
        with its own ``pad_value``, to the batch's longest payload, or, when compiled, up to
        the next of ``length_edges`` so compiled shapes stay few.

        ``executor``: the device thread, shared by every model of an engine (the runner
        starts one of its own, and stops it on ``close``, when given none)."""
        check_precision(precision, device)
        self.device = device
        self._on_cuda = device.type == "cuda"
        self.precision = precision
        self.compile_mode = compile_mode
        self.max_batch_size = max_batch_size
        self._inputs = tuple(inputs)
        self._input_names = [spec.name for spec in self._inputs]
        self._variable = any(spec.variable_axis is not None for spec in self._inputs)
        self._outputs = tuple(outputs)
        self._length_ties = length_ties(self._inputs, self._outputs)
        self._length_edges = tuple(length_edges)
        self._owns_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="batchserve-device")
        self._model = _in_eval_mode(model.to(device))
        self._forward: Callable[..., object] = self._model
        self._padded_sizes = batch_sizes_to_warm(max_batch_size)
        self.last_batch: BatchTimings | None = None
        """When the phases of the batch run last began and ended, for its trace."""
        self._forwarding = (0, 0, 0)  # when the forward began, padded rows, padded length
        self._real_positions = real_positions_input(self._inputs)
        self.count_positions: Callable[[int, int], None] | None = None
        """Told each batch's real and padded positions of a variable-length input, when set
        (once warmed up: the metrics count the requests' batches)."""
        if device.type == "cuda":
            # Fixed shapes (compiled, padded) let cuDNN pick the fastest kernels, at the cost of
            # bit-for-bit determinism between runs.
            torch.backends.cudnn.benchmark = True
        if compile_mode != "off":
            self._compile()

    @property
    def compiled(self) -> bool:
        return self.compile_mode != "off"

    def _compile(self) -> None:
        # Each padded batch size is one static graph; allow them all without recompile warnings.
        # Variable lengths multiply the shapes, so there dynamo may mark axes dynamic instead.
        limit = len(self._padded_sizes) * max(1, len(self._length_edges)) + 4
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        mode = None if self.compile_mode == "default" else self.compile_mode
        dynamic = None if self._variable else False
        self._forward = torch.compile(self._model, mode=mode, dynamic=dynamic)

    def padded_rows(self, rows: int) -> int:
        """Rows a batch is padded to: unchanged in eager mode, the next warmed size if compiled."""
        if not self.compiled:
            return rows
        for size in self._padded_sizes:
            if size >= rows:
                return size
        return rows

    @property
    def padded_batch_sizes(self) -> list[int]:
        """The batch sizes a compiled model meets (powers of two and ``max_batch_size``)."""
        return list(self._padded_sizes)

    def warm_up_batch(self, batch: NamedArrays) -> float:
        """Run ``batch`` twice (compile its shape, warm the allocators; then time it as
        requests will find it) and return the second run's seconds."""
        self.run_batch([batch])
        timed_s = time.perf_counter()
        self.run_batch([batch])
        if self._on_cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - timed_s

    def check_outputs(self, batch: NamedArrays) -> None:
        """Refuse a model whose outputs differ from the manifest (names, dtypes, shapes),
        with a ``ModelLoadError`` naming each mismatch."""
        try:
            outputs, rows_each = self._forward_batch([batch])
            problems = mismatches(outputs, self._outputs, sum(rows_each), self.precision != "fp32")
        except OutputMismatchError as error:
            problems = [str(error)]
        if problems:
            raise ModelLoadError("; ".join(problems))

    def run_batch(self, payloads: Sequence[NamedArrays]) -> list[NamedArrays | InferenceError]:
        """Collate the payloads, run one forward pass, and split the output rows back per
        payload.

        A payload whose floating outputs are not all finite (NaN or infinity: an input the
        model cannot handle, or fp16 overflowing) gets an ``InferenceError`` instead of its
        rows; its batch-mates are answered as usual.
        """
        collate_ns = time.time_ns()
        outputs, rows_each = self._forward_batch(payloads)
        total_rows = sum(rows_each)
        host = to_host(outputs, self._outputs, total_rows)  # waits for the device: forward
        split_ns = time.time_ns()
        split = split_rows(host.arrays, payloads, rows_each, self._length_ties)
        floating = [name for name in host.names if host[name].dtype.kind == "f"]
        answers: list[NamedArrays | InferenceError] = list(split)
        if not all(np.isfinite(host[name]).all() for name in floating):
            answers = [_finite_or_error(output, floating) for output in split]
        forward_ns, padded_rows, length = self._forwarding
        if self.count_positions is not None and self._real_positions is not None:
            spec = self._real_positions
            real = sum(
                int(np.count_nonzero(payload.arrays[spec.name] != spec.pad_value))
                for payload in payloads
            )
            self.count_positions(real, padded_rows * length)
        self.last_batch = BatchTimings(
            collate_ns, forward_ns, split_ns, time.time_ns(), padded_rows, padded_rows * length
        )
        return answers

    def _forward_batch(
        self, payloads: Sequence[NamedArrays]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The model's named outputs for the collated payloads (padded rows included), and
        the real rows of each payload."""
        length = self._batch_length(payloads) if self._variable else 0
        rows_each = [len(payload) for payload in payloads]
        total_rows = sum(rows_each)
        padded_rows = self.padded_rows(total_rows)
        tensors = {}
        for spec in self._inputs:
            parts = [payload.arrays[spec.name] for payload in payloads]
            if spec.variable_axis is not None:
                axis = spec.variable_axis + 1
                parts = [pad_axis(part, axis, length, spec.pad_value) for part in parts]
            host = parts[0] if len(parts) == 1 else np.concatenate(parts)
            tensor = torch.from_numpy(np.ascontiguousarray(host))
            if padded_rows > total_rows:  # repeat the first row: real data, finite outputs
                filler = tensor[:1].expand(padded_rows - total_rows, *tensor.shape[1:])
                tensor = torch.cat([tensor, filler])
            if spec.dtype == "bfloat16":
                tensor = tensor.to(torch.bfloat16)
            if self._on_cuda:
                tensor = tensor.pin_memory().to(self.device, non_blocking=True)
            tensors[spec.name] = tensor
        self._forwarding = (time.time_ns(), padded_rows, length)
        try:
            with torch.inference_mode(), self._autocast():
                raw = call_model(self._forward, tensors, self._input_names)
        except torch.OutOfMemoryError as error:
            # Release the failed batch's cached blocks so the retried halves can fit; only
            # here, never on the normal path, where empty_cache() would cost every batch.
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise DeviceOutOfMemoryError(
                f"out of memory on {self.device} for {padded_rows} rows"
            ) from error
        outputs = named_outputs(raw, self._outputs)
        for name, tensor in outputs.items():
            # Checked before the padding is sliced off, so extra rows are refused, not truncated.
            returned_rows = tensor.shape[0] if tensor.ndim > 0 else 0
            if returned_rows != padded_rows:
                raise ValueError(
                    f"the model returned {returned_rows} rows of {name!r} for a batch of "
                    f"{padded_rows}"
                )
        return outputs, rows_each

    def _batch_length(self, payloads: Sequence[NamedArrays]) -> int:
        """The variable axis' length for this batch: its longest payload, or the bucket edge
        above it when compiled."""
        length: int = max(
            payload[spec.name].shape[spec.variable_axis + 1]
            for payload in payloads
            for spec in self._inputs
            if spec.variable_axis is not None
        )
        if self.compiled and self._length_edges:
            length = next((edge for edge in self._length_edges if edge >= length), length)
        return length

    def _autocast(self) -> AbstractContextManager[object]:
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def device_memory_bytes(self) -> tuple[int, int]:
        """(allocated, reserved) CUDA memory of this runner's device; (0, 0) on CPU."""
        if self.device.type != "cuda":
            return 0, 0
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def close(self) -> None:
        """Stop the device thread (when it is the runner's own) and release the model's
        device memory (once). Call once no batch of it is queued or running."""
        if self._owns_executor:
            self.executor.shutdown(wait=True)
        if not hasattr(self, "_model"):
            return
        del self._forward
        del self._model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def real_positions_input(inputs: Sequence[TensorSpec]) -> TensorSpec | None:
    """The input whose values tell real positions from padding: an attention mask (a
    variable-length input of zeros and ones, padded with zeros) when there is one, else the
    first variable-length input (its values other than its pad value); None without one."""
    variable = [spec for spec in inputs if spec.variable_axis is not None]
    masks = [
        spec
        for spec in variable
        if spec.pad_value == 0 and spec.min_value == 0 and spec.max_value == 1
    ]
    return next(iter(masks or variable), None)


def _finite_or_error(output: NamedArrays, floating: Sequence[str]) -> NamedArrays | InferenceError:
    if all(np.isfinite(output[name]).all() for name in floating):
        return output
    return InferenceError(
        "the model produced values that are not finite (NaN or infinity) for this input; "
        "check that the input lies in the range the model was trained on"
    )
