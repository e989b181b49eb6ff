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
    ``rows_each[i]`` rows for payload ``i``, in order.

    Views, not ``np.split`` (a tenth of its cost a batch); the same rows of checked arrays,
    so no check again a payload (``of_rows``). One output (the common case) has no dict loop,
    and when every payload is one row, no step a payload in Python at all."""
    of_rows = NamedArrays.of_rows
    ends = list(itertools.accumulate(rows_each))
    starts = [0, *ends[:-1]]
    if len(outputs) == 1 and not ties:
        [(name, array)] = outputs.items()
        if rows_each.count(1) == len(rows_each):  # counted in C; a payload of 0 rows is not 1
            return _one_row_each(name, array)
        return [of_rows({name: array[start:end]}) for start, end in zip(starts, ends, strict=True)]
    split = []
    for payload, start, end in zip(payloads, starts, ends, strict=True):
        rows = of_rows({name: array[start:end] for name, array in outputs.items()})
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


#: The slot's setter of ``NamedArrays.arrays``, called in C by ``map`` in ``_one_row_each``
#: (the frozen dataclass guards only ``__setattr__``, as ``NamedArrays.of_rows`` relies on).
_set_arrays = NamedArrays.arrays.__set__  # type: ignore[attr-defined,misc]


def _one_row_each(name: str, array: Array) -> list[NamedArrays]:
    """``NamedArrays.of_rows({name: array[i:i + 1]})`` for each row ``i`` of ``array``, made
    by C calls only (``map``): the rows are views of one row each of one view with an axis of
    one inserted after the first. The device thread made two Python calls a request here."""
    rows = len(array)
    split: list[NamedArrays] = list(map(object.__new__, itertools.repeat(NamedArrays, rows)))
    by_row = map(dict.fromkeys, itertools.repeat((name,), rows), array[:, None])
    list(map(_set_arrays, split, by_row))
    return split
