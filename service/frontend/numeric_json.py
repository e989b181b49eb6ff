"""The one fast path for JSON bodies: instances of plain numbers read straight into doubles.

A body ``{"instances": [...]}`` of float instances of a fixed shape (feature vectors, 8x8
images) is the common request. The general path (``bodies.read_instances``, then
``tensor_layout``) builds a Python float per value, which numpy reads back: for the MLP's 256
floats, most of what parsing costs. Here simdjson writes the numbers straight into a buffer of
doubles. The path answers only what it proves the general path reads alike, and leaves every
other body to it (``None``), which then answers or refuses as it always does: it only ever
returns the array the general path would have built. ``tests/test_numeric_json.py`` checks
that, differentially, on written and generated bodies; ``docs/architecture.md`` gives what it
saves.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import simdjson

from service.types import Array

#: Values below this in magnitude are finite in float32 and float64, and integers among them
#: are held exactly by float64 (beyond 2**53 the general path's int64 -> float32 rounding
#: could differ from float64 -> float32). NaN fails the comparisons.
_MAX_MAGNITUDE = 2.0**50
_max, _min = np.maximum.reduce, np.minimum.reduce
#: The target dtypes whose arrays this path builds as the general path does.
FAST_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def plain_float_rows(
    body: bytes,
    instance_shape: tuple[int, ...],
    max_rows: int,
    low: float = -math.inf,
    high: float = math.inf,
) -> Array | None:
    """The instances of a body ``{"instances": [...]}`` of 1 to ``max_rows`` instances of
    ``instance_shape`` (any number of axes, each of at least one element) of plain numbers,
    shaped (count, *``instance_shape``), as float64 values that ``_MAX_MAGNITUDE`` bounds
    and that lie in [``low``, ``high``]; None when the general path must decide.

    simdjson parses the body and writes its numbers into a buffer of doubles (``as_buffer``,
    which flattens nested arrays in document order). What proves the general path would read
    the body alike: it is ASCII (simdjson skips a byte-order mark that orjson refuses) and
    holds no string but its key and no literal (``_numbers_and_lists``); simdjson checks the
    whole document's grammar, as strictly as orjson, and rounds every number correctly, as
    orjson does (``-0`` is the integer 0 in both); the instances are ``count`` arrays, every
    array down to the innermost axis's rows is an array of its axis's length, and the body's
    ``[`` are exactly those arrays and the instances' (so no element of an innermost row is a
    list, which ``as_buffer`` would flatten; it refuses an object); and the values are within
    ``_MAX_MAGNITUDE`` and the caller's range.
    """
    if 0 in instance_shape or not (body.isascii() and _numbers_and_lists(body)):
        return None
    parser = _parsers.__dict__.get("parser")
    if parser is None:
        parser = _parsers.parser = simdjson.Parser()
    innermost = len(instance_shape) - 1
    try:
        document = parser.parse(body)
        rows = document.get("instances") if isinstance(document, simdjson.Object) else None
        if not isinstance(rows, simdjson.Array):
            return None
        count = len(rows)
        if not 0 < count <= max_rows:
            return None
        bracket = body.find(b"[")  # the instances'
        level: Any = rows  # the arrays of one axis, instances first
        for axis, size in enumerate(instance_shape):
            inner: list[Any] = []  # the next axis's arrays (not the innermost rows' numbers)
            for node in level:
                if type(node) is not simdjson.Array or len(node) != size:
                    return None
                bracket = body.find(b"[", bracket + 1)  # its own (a list's opens in it)
                if axis < innermost:
                    inner.extend(node)
            level = inner
        if body.find(b"[", bracket + 1) >= 0:
            return None  # more [ than arrays walked: a list inside an innermost row
        packed = rows.as_buffer(of_type="d")
    except (ValueError, TypeError, KeyError, RuntimeError):
        return None  # not JSON, not this object, a number simdjson does not hold: the general path
    finally:
        # The parser parses the next body once its proxies are gone.
        document = rows = level = node = None
        inner = []
    array = np.frombuffer(packed, np.float64).reshape(count, *instance_shape)
    # As Python floats: four comparisons of plain floats, not of numpy scalars.
    top, bottom = float(_max(array, None)), float(_min(array, None))
    if not (_MAX_MAGNITUDE > top <= high and -_MAX_MAGNITUDE < bottom >= low):
        return None
    return array


#: A simdjson parser per thread (handlers parse large bodies in a pool): one reuses its
#: buffers from body to body.
_parsers = threading.local()


def _numbers_and_lists(body: bytes) -> bool:
    """Whether ``body``, a JSON object whose only key is ``instances``, holds no other
    string (its two quotes are the key's) and no ``true``, ``false`` or ``null`` (a ``u`` or
    an ``l``; the key has neither): numbers, lists and empty objects are left, which the walk
    of ``plain_float_rows`` and ``as_buffer`` tell apart. Single-byte searches (``find``:
    ``in`` first tries the byte as an integer, and fails)."""
    first = body.find(b'"')
    second = body.find(b'"', first + 1)
    return (
        first >= 0
        and second > first
        and body.find(b'"', second + 1) < 0
        and body.find(b"u") < 0
        and body.find(b"l") < 0
    )
