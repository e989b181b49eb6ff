"""A batch's output rows split back into each payload's own: views, never copies.

Runs on the device thread once a batch (``TorchRunner.run_batch``). Every payload gets the
rows it brought, in order, and each output whose variable axis follows an input's (per-token
outputs) is cut to that payload's own length, so an answer never depends on its batch-mates.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from service.manifest import TensorSpec
from service.tensors import NamedArrays
from service.types import Array

LengthTie = tuple[str, int, str, int]
"""An output whose variable axis follows an input's: (output, its axis, input, its axis)."""


def length_ties(
    inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> tuple[LengthTie, ...]:
    axes = {spec.name: spec.variable_axis for spec in inputs}
    ties = []
    for spec in outputs:
        input_axis = axes.get(spec.length_of or "")
        if spec.variable_axis is not None and input_axis is not None:
            ties.append((spec.name, spec.variable_axis + 1, spec.length_of or "", input_axis + 1))
    return tuple(ties)


def split_rows(
    outputs: dict[str, Array],
    payloads: Sequence[NamedArrays],
    rows_each: list[int],
    ties: Sequence[LengthTie],
) -> list[NamedArrays]:
    """Each payload's rows of ``outputs`` (the batch's checked host arrays, real rows only),
    ``rows_each[i]`` rows for payload ``i``, in order: slices of checked arrays, so not
    checked again (``of_rows``)."""
    ends = list(itertools.accumulate(rows_each))
    starts = [0, *ends[:-1]]
    split = []
    for payload, start, end in zip(payloads, starts, ends, strict=True):
        rows = NamedArrays.of_rows({name: array[start:end] for name, array in outputs.items()})
        split.append(_at_own_length(rows, payload, ties) if ties else rows)
    return split


def _at_own_length(
    rows: NamedArrays, payload: NamedArrays, ties: Sequence[LengthTie]
) -> NamedArrays:
    """``rows`` with each tied output cut to the payload's own length (the batch padded it to
    its longest payload's): an answer never depends on its batch-mates."""
    arrays = dict(rows.arrays)
    for output, axis, source, source_axis in ties:
        length = payload[source].shape[source_axis]
        if arrays[output].shape[axis] > length:
            arrays[output] = arrays[output][(slice(None),) * axis + (slice(0, length),)]
    return NamedArrays(arrays)
