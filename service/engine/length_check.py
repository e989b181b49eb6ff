"""Packaging runs the model once at the longest input it will be served: a ``max_length``
beyond what the model holds (its position embeddings) is refused then, naming the length,
rather than at start-up's warm-up as "index out of range in self"."""

from __future__ import annotations

import torch

from service.buckets import DEFAULT_MAX_LENGTH
from service.engine.outputs import run_on_examples
from service.errors import ModelLoadError
from service.manifest import Manifest


def check_max_length(module: torch.nn.Module, manifest: Manifest) -> None:
    """Run one example row as long as the variable input's ``max_length`` (the server's
    default when it declares none); ``ModelLoadError`` saying the model cannot hold it."""
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
