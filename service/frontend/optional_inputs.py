"""Inputs a request may leave out: those with a ``default_value`` (``TensorSpec``), as a
``forward()`` argument with a default is optional (an attention mask, token type ids).

``fill_defaults`` builds them at the request's rows and length, so a V2 or tensor client may
send the token ids alone, and the rest of the path (validation, batching, padding) sees every
input as if it had been sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from service.manifest import TensorSpec
from service.types import Array


def fill_defaults(
    specs: Sequence[TensorSpec], arrays: Mapping[str, Array], lengths: Sequence[int] | None = None
) -> dict[str, Array]:
    """``arrays`` with each input of ``specs`` it lacks and that has a ``default_value``,
    filled with it at the other inputs' rows and variable length; past each instance's own
    length (``lengths``, when the request's instances were padded together) with the input's
    ``pad_value``, as the instance would have been padded had it been sent."""
    given = [spec for spec in specs if spec.name in arrays]
    if len(given) == len(specs) or not given:
        return dict(arrays)
    rows = len(arrays[given[0].name])
    length = next(
        (
            arrays[spec.name].shape[spec.variable_axis + 1]
            for spec in given
            if spec.variable_axis is not None and arrays[spec.name].ndim > spec.variable_axis + 1
        ),
        1,
    )
    filled = dict(arrays)
    for spec in specs:
        if spec.name in arrays or spec.default_value is None:
            continue
        shape = (rows, *(length if size == -1 else size for size in spec.instance_shape))
        values = np.full(shape, spec.default_value, dtype=spec.numpy_dtype)
        if lengths is not None and spec.variable_axis is not None:
            beyond = np.arange(length) >= np.asarray(lengths)[:, np.newaxis]
            np.moveaxis(values, spec.variable_axis + 1, 1)[beyond] = spec.pad_value
        filled[spec.name] = values
    return filled
