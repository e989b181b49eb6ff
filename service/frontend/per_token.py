"""Per-token answers at each instance's own length.

A request's instances of different lengths are padded to its longest before they are queued
(one rectangular array per input), so a per-token output (an output whose ``length_of``
names the input its variable axis follows: a tagger's ``tags``) comes back from the engine
at the request's longest length; the engine has already cut it to the request's own length,
whatever batch it ran in. JSON can answer each instance at its own length:
``PaddedInstances`` carries each instance's length from parsing to the answer, and its
``rows`` are what ``/predict`` answers. ``.npy``/``.npz`` answers and the V2 protocols (REST
and gRPC) take rectangular tensors and answer rectangular tensors, at the request's own
length, as the request alone gives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from service.bridge.interface import InferenceResult
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays
from service.types import Array


@dataclass(frozen=True, slots=True)
class PaddedInstances(NamedArrays):
    """Named arrays whose instances were padded on a variable axis, with each one's own
    length: a request's inputs, or the per-token outputs answering them.

    ``named[name]`` is still the padded array; ``rows()`` cuts each instance to its length.
    """

    lengths: Array
    """Each instance's own length on the variable axis (int64, one per row)."""
    axes: Mapping[str, int]
    """The arrays padded to the longest instance, by name: their variable axis (counting the
    row axis). The other arrays are answered whole."""

    def own(self, name: str, index: int) -> Array:
        """Instance ``index`` of ``name`` at its own length."""
        row: Array = self.arrays[name][index]
        axis = self.axes.get(name)
        if axis is None:
            return row
        own: Array = row[(slice(None),) * (axis - 1) + (slice(0, int(self.lengths[index])),)]
        return own

    def rows(self) -> list[Any]:
        """Per instance: the row of a single array, or ``{name: row}`` for several; each
        padded array cut to the instance's own length (what ``/predict`` answers in JSON)."""
        names = self.names
        if len(names) == 1:
            return [self.own(names[0], index) for index in range(len(self))]
        return [{name: self.own(name, index) for name in names} for index in range(len(self))]


def padded_instances(
    arrays: NamedArrays, lengths: Sequence[int] | Array, specs: Sequence[TensorSpec]
) -> NamedArrays:
    """``arrays`` (a request's inputs, padded to its longest instance) with each instance's
    own ``lengths``; as they are when every instance is as long as the longest."""
    own = np.asarray(lengths, dtype=np.int64)
    axes = {spec.name: spec.variable_axis + 1 for spec in specs if spec.variable_axis is not None}
    if not axes or own.size == 0:
        return arrays
    name, axis = next(iter(axes.items()))
    if int(own.min()) == arrays[name].shape[axis]:
        return arrays
    return PaddedInstances(arrays.arrays, own, axes)


def at_own_lengths(
    result: InferenceResult, instances: NamedArrays, manifest: Manifest
) -> InferenceResult:
    """``result`` whose per-token outputs (``length_of``) answer each instance at its own
    length in JSON, when the request's instances had different lengths."""
    if not isinstance(instances, PaddedInstances):
        return result
    axes = {
        spec.name: spec.variable_axis + 1
        for spec in manifest.outputs
        if spec.length_of is not None and spec.variable_axis is not None
    }
    if not axes:
        return result
    outputs = PaddedInstances(result.outputs.arrays, instances.lengths, axes)
    return replace(result, outputs=outputs)
