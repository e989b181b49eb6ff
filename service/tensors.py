"""``NamedArrays``: a model's named tensors for some rows, as every room passes them around.

A request's inputs (``input_ids`` and ``attention_mask``), a batch's collated inputs, and the
rows of a model's outputs are all one ``NamedArrays``: arrays keyed by tensor name that share
their first (row) axis. The batcher slices and counts them like one array. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from service.types import Array


@dataclass(frozen=True, slots=True)
class NamedArrays:
    """Arrays keyed by name, each with the same number of rows (their first axis).

    ``named["input_ids"]`` is one array; ``named[2:5]`` is rows 2 to 4 of every array (how the
    batcher splits a request larger than a batch); ``len(named)`` counts rows."""

    arrays: dict[str, Array]

    def __post_init__(self) -> None:
        counts = {name: (len(array) if array.ndim else -1) for name, array in self.arrays.items()}
        if not counts or len(set(counts.values())) != 1 or -1 in counts.values():
            raise ValueError(f"named arrays need one row count for all, got {counts}")

    @classmethod
    def of(cls, **arrays: Array) -> NamedArrays:
        return cls(dict(arrays))

    @classmethod
    def of_rows(cls, arrays: dict[str, Array]) -> NamedArrays:
        """``arrays`` known to share their row count already (rows cut alike from arrays
        that were checked, or checked by the caller), without checking them again: the
        engine builds one for each request and each answer, and the check cost as much as
        the rest of building it."""
        named = object.__new__(cls)
        object.__setattr__(named, "arrays", arrays)
        return named

    @overload
    def __getitem__(self, key: str, /) -> Array: ...

    @overload
    def __getitem__(self, key: slice, /) -> NamedArrays: ...

    def __getitem__(self, key: str | slice, /) -> Array | NamedArrays:
        if isinstance(key, slice):  # the same rows of arrays of one row count: no check
            return NamedArrays.of_rows({name: array[key] for name, array in self.arrays.items()})
        return self.arrays[key]

    def __len__(self) -> int:
        """Rows, not names: the batcher counts a payload's rows with ``len``."""
        for array in self.arrays.values():  # the first (a loop: no call to iter and next)
            return len(array)
        raise ValueError("named arrays without arrays have no rows")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.arrays)

    @staticmethod
    def concatenate(
        parts: Sequence[NamedArrays], order: Sequence[int] | None = None
    ) -> NamedArrays:
        """The rows of ``parts`` one after the other (one part is returned as it is), then
        taken at the places ``order`` gives when given (a request's rows, sorted by length to
        be computed, back in its own order)."""
        if order is not None:
            joined = NamedArrays.concatenate(parts)
            places = np.asarray(order, dtype=np.intp)
            return NamedArrays({name: array[places] for name, array in joined.arrays.items()})
        if len(parts) == 1:
            return parts[0]
        return NamedArrays(
            {name: np.concatenate([part.arrays[name] for part in parts]) for name in parts[0].names}
        )


def pad_axis(array: Array, axis: int, length: int, value: float) -> Array:
    """``array`` padded with ``value`` at the end of ``axis`` up to ``length`` (as is if long
    enough already)."""
    missing = length - array.shape[axis]
    if missing <= 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, missing)
    return np.pad(array, widths, constant_values=value)
