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

import functools
import math
import threading

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
    the body alike: it is ASCII (simdjson skips a byte-order mark that orjson refuses);
    simdjson checks the whole document's grammar, as strictly as orjson, and rounds every
    number correctly, as orjson does (``-0`` is the integer 0 in both); the body's skeleton
    is that of ``count`` instances of the shape (``_instance_count``), so its one string is
    the key, it holds no object, and every array is one of the shape's, with its axis's
    count of elements (an innermost row of one element shows as ``[]``, as an empty one
    would: the count of numbers ``as_buffer`` writes tells them apart); the key is
    ``instances``; ``as_buffer`` refuses a ``true``, ``false`` or ``null`` where a number
    stands; and the values are within ``_MAX_MAGNITUDE`` and the caller's range.
    """
    if 0 in instance_shape or not body.isascii():
        return None
    count = _instance_count(body.translate(None, _NOT_SKELETON), instance_shape, max_rows)
    if count is None:
        return None
    parser = _parsers.__dict__.get("parser")
    if parser is None:
        parser = _parsers.parser = simdjson.Parser()
    try:
        document = parser.parse(body)
        rows = document.get("instances") if isinstance(document, simdjson.Object) else None
        if not isinstance(rows, simdjson.Array):
            return None
        packed = rows.as_buffer(of_type="d")
    except (ValueError, TypeError, KeyError, RuntimeError):
        return None  # not JSON, a number simdjson does not hold: the general path
    finally:
        # The parser parses the next body once its proxies are gone.
        document = rows = None
    if memoryview(packed).nbytes != count * math.prod(instance_shape) * 8:
        return None  # an empty innermost row where the shape has one element
    array = np.frombuffer(packed, np.float64).reshape(count, *instance_shape)
    # As Python floats: four comparisons of plain floats, not of numpy scalars.
    top, bottom = float(_max(array, None)), float(_min(array, None))
    if not (_MAX_MAGNITUDE > top <= high and -_MAX_MAGNITUDE < bottom >= low):
        return None
    return array


#: A simdjson parser per thread (handlers parse large bodies in a pool): one reuses its
#: buffers from body to body.
_parsers = threading.local()


#: Every byte but brackets, braces, commas and quotes: what ``bytes.translate`` deletes to
#: leave a body's skeleton.
_NOT_SKELETON = bytes(sorted(set(range(256)) - set(b'[]{},"')))


def _instance_count(skeleton: bytes, instance_shape: tuple[int, ...], max_rows: int) -> int | None:
    """How many instances of ``instance_shape`` a body of skeleton ``skeleton`` holds, when
    it is exactly ``{"instances": [...]}`` of 1 to ``max_rows`` of them; else None.

    In valid JSON with no string but the key, the skeleton fixes every array's place and,
    past one element, its count of elements (a ``true``, ``false`` or ``null`` would stand
    where a number does, and ``as_buffer`` refuses it): an instance of shape (2, 3)
    is ``[[,,],[,,]]``, and a body of two of them ``{""[[[,,],[,,]],[[,,],[,,]]]}``."""
    instance = _instance_skeleton(instance_shape)
    count, rest = divmod(len(skeleton) - len(b'{""[]}') + 1, len(instance) + 1)
    if rest or not 0 < count <= max_rows:
        return None
    expected = b'{""[' + b",".join([instance] * count) + b"]}"
    return count if skeleton == expected else None


@functools.lru_cache(maxsize=16)
def _instance_skeleton(instance_shape: tuple[int, ...]) -> bytes:
    """The skeleton of one instance of ``instance_shape`` (``_instance_count``)."""
    skeleton = b""
    for size in reversed(instance_shape):
        skeleton = b"[" + b",".join([skeleton] * size) + b"]"
    return skeleton
