"""Artifacts that are not ``nn.Module``s, wrapped as one so the runner treats every format
alike: an AOTInductor package (compiled ahead of time: compiled speed, no compiling at start)
and an ONNX model run by ONNX Runtime (the optional extra ``batchserve[onnx]``).

Each wrapper takes the model's inputs as the runner passes them (one positionally, several by
name) and returns its outputs by name, in the manifest's order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import ModelLoadError
from service.manifest import Manifest


class AotiModule(torch.nn.Module):
    """A ``.pt2`` package from ``torch._inductor.aoti_compile_and_package``, loaded from a
    path (a private verified copy: torch unpacks it while loading and never reads it again)."""

    def __init__(self, package: Path) -> None:
        super().__init__()
        self._compiled = torch._inductor.aoti_load_package(str(package))

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        return self._compiled(*args, **kwargs)


class OnnxModule(torch.nn.Module):
    """An ONNX model (its verified bytes) in an ONNX Runtime session: graph optimisations
    on, torch's thread count, the CUDA execution provider first when torch sees a GPU, else
    the CPU's."""

    def __init__(self, model: bytes, manifest: Manifest) -> None:
        super().__init__()
        try:
            import onnxruntime
        except ImportError as error:
            raise ModelLoadError(
                "the onnx format needs ONNX Runtime: pip install 'batchserve[onnx]'"
            ) from error
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        # As many threads as torch was given (torch_threads): a core stays with the event loop.
        options.intra_op_num_threads = torch.get_num_threads()
        providers = ["CPUExecutionProvider"]
        if torch.cuda.is_available() and "CUDAExecutionProvider" in (
            onnxruntime.get_available_providers()
        ):
            providers.insert(0, "CUDAExecutionProvider")
        self._session = onnxruntime.InferenceSession(model, options, providers=providers)
        self._inputs = [spec.name for spec in manifest.inputs]
        self._outputs = [spec.name for spec in manifest.outputs]
        served = {node.name for node in self._session.get_inputs()}
        if served != set(self._inputs):
            raise ModelLoadError(
                f"the ONNX model takes inputs {sorted(served)}, the manifest declares "
                f"{self._inputs}"
            )

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = dict(zip(self._inputs, args, strict=False)) | kwargs
        feed = {name: _numpy(tensor) for name, tensor in tensors.items()}
        # Exported with its outputs in the manifest's order (export.OrderedOutputs).
        results = self._session.run(None, feed)
        device = next(iter(tensors.values())).device
        return {
            name: torch.from_numpy(np.asarray(result)).to(device)
            for name, result in zip(self._outputs, results, strict=True)
        }


def _numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    array: np.ndarray[Any, Any] = tensor.detach().to("cpu").numpy()
    return array
