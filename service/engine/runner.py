"""Runs a model on its device: precision, compilation, warm-up, collation and splitting.

Everything here runs in ``TorchRunner.executor``, one dedicated thread per device, so autocast
(thread-local state) is entered in the thread that runs the model and the event loop never
runs model code. No asyncio here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch

from service.config import CompileMode, Precision
from service.errors import DeviceOutOfMemoryError, InferenceError, ModelLoadError
from service.types import Array

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


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    container's limit), which ``os.cpu_count()`` ignores by counting the whole node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


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
    """Owns a model on one device and runs batches of numpy rows through it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        precision: Precision = "fp32",
        compile_mode: CompileMode = "off",
        max_batch_size: int,
        variable_axis: int | None = None,
        pad_value: float = 0,
        length_edges: Sequence[int] = (),
    ) -> None:
        """``variable_axis`` is the instance axis (batch not counted) whose length varies; a
        batch pads it with ``pad_value`` to its longest payload, or, when compiled, up to the
        next of ``length_edges`` so compiled shapes stay few."""
        check_precision(precision, device)
        self.device = device
        self._on_cuda = device.type == "cuda"
        self.precision = precision
        self.compile_mode = compile_mode
        self.max_batch_size = max_batch_size
        self._variable_axis = None if variable_axis is None else variable_axis + 1
        self._pad_value = pad_value
        self._length_edges = tuple(length_edges)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-device")
        self._model = _in_eval_mode(model.to(device))
        self._forward: Callable[[torch.Tensor], object] = self._model
        self._padded_sizes = batch_sizes_to_warm(max_batch_size)
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
        dynamic = None if self._variable_axis is not None else False
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

    def warm_up(self, batches: Sequence[Array]) -> list[float]:
        """Run each batch twice: once to compile its shape and warm the allocators, once to
        time it as requests will find it. Returns the second run's seconds, per batch."""
        started_s = time.perf_counter()
        steady_s = []
        for batch in batches:
            self.run_batch([batch])
            timed_s = time.perf_counter()
            self.run_batch([batch])
            if self._on_cuda:
                torch.cuda.synchronize(self.device)
            steady_s.append(time.perf_counter() - timed_s)
        elapsed_s = time.perf_counter() - started_s
        logger.info(
            "model_warmed_up",
            extra={
                "shapes": [list(batch.shape) for batch in batches],
                "seconds": round(elapsed_s, 3),
                "device": str(self.device),
            },
        )
        return steady_s

    def run_batch(self, payloads: Sequence[Array]) -> list[Array | InferenceError]:
        """Stack the payloads, run one forward pass, and split the output rows back per payload.

        A payload whose outputs are not all finite (NaN or infinity: an input the model cannot
        handle, or fp16 overflowing) gets an ``InferenceError`` instead of its rows; its
        batch-mates are answered as usual.
        """
        rows = [len(payload) for payload in payloads]
        if self._variable_axis is not None:
            payloads = self._pad_lengths(payloads)
        host = payloads[0] if len(payloads) == 1 else np.concatenate(payloads)
        total_rows = host.shape[0]
        inputs = torch.from_numpy(np.ascontiguousarray(host))
        padded_rows = self.padded_rows(total_rows)
        if padded_rows > total_rows:
            padding = inputs.new_zeros((padded_rows - total_rows, *inputs.shape[1:]))
            inputs = torch.cat([inputs, padding])
        if self._on_cuda:
            inputs = inputs.pin_memory().to(self.device, non_blocking=True)
        try:
            with torch.inference_mode(), self._autocast():
                outputs = self._forward(inputs)
        except torch.OutOfMemoryError as error:
            # Release the failed batch's cached blocks so the retried halves can fit; only
            # here, never on the normal path, where empty_cache() would cost every batch.
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise DeviceOutOfMemoryError(
                f"out of memory on {self.device} for {padded_rows} rows"
            ) from error
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"the model must return one tensor, got {type(outputs).__name__}")
        # Checked before the padding is sliced off, so extra rows are refused, not truncated.
        returned_rows = outputs.shape[0] if outputs.ndim > 0 else 0
        if returned_rows != padded_rows:
            raise ValueError(
                f"the model returned {returned_rows} rows for a batch of {padded_rows}"
            )
        # One device-to-host copy per batch, in fp32 whatever the autocast precision.
        host_outputs = outputs[:total_rows].to("cpu", torch.float32).numpy()
        split: list[Array] = []
        start = 0
        for count in rows:  # slices, not np.split: a tenth of its cost per batch
            split.append(host_outputs[start : start + count])
            start += count
        if np.isfinite(host_outputs).all():
            return list(split)
        return [_finite_or_error(output) for output in split]

    def _pad_lengths(self, payloads: Sequence[Array]) -> Sequence[Array]:
        """Pad the variable axis of every payload to the batch's length (its bucket if compiled)."""
        axis = self._variable_axis
        assert axis is not None
        length = max(payload.shape[axis] for payload in payloads)
        if self.compiled and self._length_edges:
            length = next((edge for edge in self._length_edges if edge >= length), length)
        padded = []
        for payload in payloads:
            missing = length - payload.shape[axis]
            if missing:
                widths = [(0, 0)] * payload.ndim
                widths[axis] = (0, missing)
                payload = np.pad(payload, widths, constant_values=self._pad_value)
            padded.append(payload)
        return padded

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
        """Stop the device thread and release the model's device memory (once)."""
        self.executor.shutdown(wait=True)
        if not hasattr(self, "_model"):
            return
        del self._forward
        del self._model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _finite_or_error(output: Array) -> Array | InferenceError:
    if np.isfinite(output).all():
        return output
    return InferenceError(
        "the model produced values that are not finite (NaN or infinity) for this input; "
        "check that the input lies in the range the model was trained on"
    )
