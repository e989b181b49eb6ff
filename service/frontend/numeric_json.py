"""The fast path of a JSON body that holds nothing but numbers: its instances into a float
array in one numpy call, with two cheap checks in place of the general path's passes.

The general path (``tensor_layout._json_to_array`` then ``TensorLayout.validated``) lets numpy
discover the nested lists' dtype, checks the kind, the magnitude before narrowing, booleans
and finiteness: five passes over the values, about half of a front end's own Python per
``/predict`` request on a 256-float instance (py-spy). Here the body's bytes prove there is no
string, boolean or null in it, numpy converts the lists to float64 directly (refusing
anything else), and their maximum and minimum prove every value finite and small enough
that float64 holds it exactly as an integer and the target dtype holds it finitely.
Whatever this path cannot prove it leaves to the general path (``None``), which then answers
or refuses exactly as before: the fast path only ever returns the array the general path
would have built. A body of instances of a fixed shape (``plain_float_rows``: feature vectors,
8x8 images) is not even read by orjson: simdjson writes its numbers straight into a buffer of
doubles.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from itertools import chain
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


def plain_float_array(
    instances: list[Any], body: bytes, dtype: np.dtype[Any], instance_shape: tuple[int, ...]
) -> Array | None:
    """``instances`` as an array of ``dtype`` (one of ``FAST_DTYPES``) shaped (len,
    *``instance_shape``), or None when the general path must decide.

    ``body`` is the whole JSON document, already read as an object whose only key is
    ``instances`` (``bodies.read_instances``).
    """
    if not _numbers_and_lists(body):
        return None
    try:
        array = _float64_rows(instances, instance_shape)
    except (ValueError, TypeError, OverflowError, RecursionError, struct.error):
        return None  # ragged, too deep, or an integer beyond float64: the general path says
    if array is None or array.shape[1:] != instance_shape or array.size == 0:
        return None
    # Two reductions (a dot product would be one, but warns when it overflows), called as
    # ufuncs: ``array.max()`` goes through a Python wrapper in numpy.
    if not (_max(array, None) < _MAX_MAGNITUDE and _min(array, None) > -_MAX_MAGNITUDE):
        return None
    return array.astype(dtype)  # a copy: the packed buffer is read-only


def plain_float_rows(
    body: bytes,
    instance_shape: tuple[int, ...],
    max_rows: int,
    low: float = -math.inf,
    high: float = math.inf,
) -> Array | None:
    """The instances of a body ``{"instances": [...]}`` of 1 to ``max_rows`` instances of
    ``instance_shape`` (any number of axes, each of at least one element: a feature vector,
    an 8x8 image) of plain numbers, shaped (count, *``instance_shape``), as float64 values
    that the ``_MAX_MAGNITUDE`` bound holds exactly and that lie in [``low``, ``high``],
    parsed without a Python object per value; None when the general path must decide.

    simdjson parses the body and writes its numbers straight into a buffer of doubles
    (``as_buffer``, which flattens nested arrays in document order), where orjson built a
    ``float`` per value that numpy or ``struct`` packed back. It answers only what it proves
    the general path reads alike: the body is ASCII (simdjson skips a byte-order mark that
    orjson refuses) and holds no string but its key and no literal (``_numbers_and_lists``);
    simdjson checks the whole document's grammar, as strict as orjson's, and rounds every
    number correctly, as orjson does (``-0`` is the integer 0 in both); the instances are
    ``count`` arrays, every array down to the innermost axis's rows is an array of its axis's
    length, and the body's ``[`` are exactly those arrays and the instances' (each found one
    at a time, where ``bytes.count`` cost 10,800 instructions on a 5 kB body), so no element
    of an innermost row is a list (``as_buffer`` refuses an object), and the values are
    within ``_MAX_MAGNITUDE`` (and the caller's range: the same two reductions).
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


def _float64_rows(instances: list[Any], instance_shape: tuple[int, ...]) -> Array | None:
    """The nested lists as float64. Rows of one axis (the common case, a feature vector)
    are packed as C doubles by ``struct`` (a fifth of ``np.array``'s cost, which discovers
    their shape first), once every row is known to be a list of the right length (``struct``
    refuses an item that is not a number); deeper instances go through ``np.array``."""
    if len(instance_shape) != 1:
        return np.array(instances, dtype=np.float64)
    width = instance_shape[0]
    for row in instances:
        if type(row) is not list or len(row) != width:
            return None
    count = len(instances) * width
    packed = _doubles(count).pack(*(instances[0] if len(instances) == 1 else chain(*instances)))
    return np.frombuffer(packed, np.float64).reshape(len(instances), width)


@functools.lru_cache(maxsize=64)
def _doubles(count: int) -> struct.Struct:
    return struct.Struct(f"{count}d")


def _numbers_and_lists(body: bytes) -> bool:
    """Whether ``body``, a JSON object whose only key is ``instances``, holds no other
    string (its two quotes are the key's) and no ``true``, ``false`` or ``null`` (a ``u`` or
    an ``l``; the key has neither): numbers, lists and empty objects are left, and the
    conversion to float64 refuses an object or a list where a number belongs. Five
    single-byte searches (``memchr``), where deleting the number bytes with
    ``bytes.translate`` cost 20,000 instructions on a 5 kB body."""
    first = body.find(b'"')
    second = body.find(b'"', first + 1)
    return (
        first >= 0
        and second > first
        and body.find(b'"', second + 1) < 0
        and body.find(b"u") < 0  # not ``b"u" not in body``: ``in`` first tries the byte as an
        and body.find(b"l") < 0  # integer and builds a TypeError (1,800 instructions)
    )
