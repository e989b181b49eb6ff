"""JSON bodies of numbers for a float tensor of fixed shape: answered as the API promises,
and alike with and without the fast path (``numeric_json.plain_float_rows``).

The promise, written here apart from the code that keeps it (``promised``): a body that
orjson does not read is 400; one that is not ``{"instances": [...]}`` with 1 to
``max_instances`` instances, each nested lists of exactly the instance shape with a number
(not a boolean, string, null, list or object) at every leaf, every value finite in the
tensor's dtype and within its range (or the padding value), is 422; any other is the array
numpy reads from the nested lists, cast to the dtype, in memory of its own. Every body is also
parsed by the general path alone (``parse_instances``): the answer, or the refusal and its
words, must be the same. Checked over bodies written to break a parser (tricky syntax, numbers
at the edges of float32 and float64, the right count of values in the wrong nesting), over
generated ones, and through a one-input model's ``InputLayout``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import ServiceError
from service.frontend.bodies import read_instances
from service.frontend.inputs import InputLayout
from service.frontend.numeric_json import plain_float_rows
from service.frontend.tensor_layout import TensorLayout
from service.manifest import Architecture, Manifest, TensorSpec
from service.types import Array

F32_MAX = float(np.finfo(np.float32).max)
#: Values at the edges of what a float tensor accepts, or of how numbers convert.
EDGE_VALUES: list[Any] = [
    0,
    -0.0,
    0.0,
    1,
    -1,
    0.5,
    1e-45,  # below float32's smallest subnormal
    1.4e-45,
    5e-324,  # float64's smallest subnormal
    1e-320,
    F32_MAX,
    -F32_MAX,
    3.4028235e38,  # rounds to float32's max, but beyond it in float64: refused
    3.5e38,
    1e39,
    1e308,
    -1e308,
    2**24 + 1,  # the first integer float32 rounds
    2**50,
    2**50 + 1,
    2**53,
    2**53 + 1,
    2**60 + 2**36 + 1,  # rounded once from int64 to float32, twice through float64
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
    float(2**53 + 2),
    True,
    False,
    None,
    "1.5",
    "",
    {},
    [],
    [1.0],
]
SHAPES = [(-1, 1), (-1, 2), (-1, 3), (-1, 2, 2), (-1, 4, 3), (-1, 1, 5), (-1, 5, 1), (-1, 2, 3, 4)]
DTYPES = ["float32", "float64"]


def layout_of(
    dtype: str, shape: tuple[int, ...], max_instances: int = 1024, **spec: Any
) -> TensorLayout:
    tensor = TensorSpec(name="x", dtype=dtype, shape=shape, **spec)  # type: ignore[arg-type]
    return TensorLayout(tensor, max_instances=max_instances)


def promised(layout: TensorLayout, body: bytes) -> int | Array:
    """The status the API promises for ``body``, or the array it promises (module docstring)."""
    spec = layout.spec
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 400
    if not (isinstance(document, dict) and document.keys() == {"instances"}):
        return 422
    instances = document["instances"]
    if not (isinstance(instances, list) and 1 <= len(instances) <= layout.max_instances):
        return 422
    leaves: list[int | float] = []
    if not all(_shaped(instance, spec.instance_shape, leaves) for instance in instances):
        return 422
    dtype = spec.numpy_dtype
    if any(abs(float(value)) > float(np.finfo(dtype).max) for value in leaves):
        return 422
    read = np.asarray(instances)
    if read.dtype.kind not in "iuf":
        return 422
    array = read.astype(dtype)
    low = -math.inf if spec.min_value is None else spec.min_value
    high = math.inf if spec.max_value is None else spec.max_value
    values = array.astype(np.float64)  # compared as float64: a bound may lie beyond float32
    if not (((values >= low) & (values <= high)) | (values == spec.pad_value)).all():
        return 422
    return array


def _shaped(value: Any, shape: tuple[int, ...], leaves: list[int | float]) -> bool:
    """Whether ``value`` is nested lists of exactly ``shape`` with numbers at the leaves,
    which it adds to ``leaves``."""
    if not shape:
        if type(value) not in (int, float):  # bool is a subclass of int: not a number here
            return False
        leaves.append(value)
        return True
    return (
        isinstance(value, list)
        and len(value) == shape[0]
        and all(_shaped(item, shape[1:], leaves) for item in value)
    )


def answered(layout: TensorLayout, body: bytes) -> int | Array:
    """The status ``layout`` refuses ``body`` with, or the array it parses; the same as the
    general path alone gives, word for word and byte for byte."""
    fast, general = outcome(layout.parse_json, body), outcome(general_path(layout), body)
    assert fast[:-1] == general[:-1], body[:200]
    return fast[-1]


def general_path(layout: TensorLayout) -> Callable[[bytes], Array]:
    return lambda body: layout.parse_instances(read_instances(body), body)


def outcome(parse: Callable[[bytes], Array], body: bytes) -> tuple[Any, ...]:
    """What ``parse`` makes of ``body``, comparable; its last item the status or the array."""
    try:
        array = parse(body)
    except ServiceError as error:
        return type(error).__name__, error.message, error.status_code
    return array.dtype.str, array.shape, array.tobytes(), array


def assert_as_promised(layout: TensorLayout, body: bytes) -> None:
    expected = promised(layout, body)
    actual = answered(layout, body)
    if isinstance(expected, int) or isinstance(actual, int):
        assert actual == expected, body[:200]
        return
    assert actual.dtype == expected.dtype, body[:200]
    assert actual.shape == expected.shape, body[:200]
    assert actual.tobytes() == expected.tobytes(), body[:200]
    assert actual.flags.writeable  # its own memory, which torch can wrap
    assert actual.flags.c_contiguous


def _dumps(instances: Any) -> bytes:
    return json.dumps({"instances": instances}).encode()


def nested(shape: tuple[int, ...], values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists shaped ``shape`` of ``values``."""
    strategy = values
    for size in reversed(shape):
        strategy = st.lists(strategy, min_size=size, max_size=size)
    return strategy


VALUES = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-100, max_value=100),
    st.sampled_from(EDGE_VALUES),
)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    data=st.data(),
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(min_value=0, max_value=4),
    ragged=st.booleans(),
)
def test_generated_bodies_are_answered_as_promised(
    data: st.DataObject, shape: tuple[int, ...], dtype: str, rows: int, ragged: bool
) -> None:
    layout = layout_of(dtype, shape)
    values = VALUES if data.draw(st.booleans()) else st.floats(-1e6, 1e6) | st.integers(-9, 9)
    row_shapes = [
        tuple(
            max(0, size + data.draw(st.integers(-1, 1))) if ragged else size for size in shape[1:]
        )
        for _ in range(rows)
    ]
    instances = [data.draw(nested(row_shape, values)) for row_shape in row_shapes]
    assert_as_promised(layout, _dumps(instances))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", EDGE_VALUES, ids=repr)
def test_each_edge_value_is_answered_as_promised(dtype: str, value: Any) -> None:
    layout = layout_of(dtype, (-1, 3))
    for instances in ([[1.0, value, 2.0]], [[1, value, 2]], [[value, value, value]], [value]):
        assert_as_promised(layout, _dumps(instances))


def test_integers_beyond_float64s_precision_round_once() -> None:
    """A body of integers is read as int64 and rounded once to float32 (2**60 + 2**36 + 1 is
    just past a tie: up), where reading it as float64 first would round it twice (down)."""
    value = 2**60 + 2**36 + 1
    parsed = layout_of("float32", (-1, 2)).parse_json(_dumps([[value, 1]]))
    assert parsed[0, 0] == np.float32(2**60 + 2**37)
    assert np.float32(float(value)) == np.float32(2**60)


def test_a_value_range_is_checked() -> None:
    layout = layout_of("float32", (-1, 2), min_value=-1.0, max_value=1.0)
    for instances in ([[0.5, -1.0]], [[0.5, 1.5]], [[-3, 0]]):
        assert_as_promised(layout, _dumps(instances))
    with pytest.raises(ServiceError, match=r"values must lie in \[-1, 1\].*got 1\.5"):
        layout.parse_json(b'{"instances": [[0.5, 1.5]]}')


@pytest.mark.parametrize(
    ("low", "high", "pad"),
    [(0.0, 1.0, 0), (0.0, 1.0, -1), (-0.1, 0.1, 0), (None, 0.5, 0), (-1e39, 1e39, 0)],
)
def test_a_value_range_is_checked_at_nested_shapes(
    low: float | None, high: float | None, pad: int
) -> None:
    """Values at, just past and rounding onto either end (0.1 is not a float32: the cast value
    is compared), and the padding value outside the range."""
    edges = [0, 1, -1, 0.1, -0.1, 0.5, 1.0000000001, 0.10000000001, 1.5, -0.0, 1e39]
    for dtype in DTYPES:
        layout = layout_of(dtype, (-1, 2, 3), min_value=low, max_value=high, pad_value=pad)
        for edge in edges:
            instance = [[0.25, 0.5, edge], [0, 0.125, 0.375]]
            assert_as_promised(layout, _dumps([instance, instance]))


#: Bodies where a JSON reader, or a check of the nesting, could go wrong.
TRICKY_BODIES = [
    b'\xef\xbb\xbf{"instances": [[1, 2]]}',  # a byte-order mark
    b'{"instances": [[1,\xc2\xa02]]}',  # a non-ASCII space
    b'{"instances": [[1, [2]], [3, 4]]}',  # as many numbers as a 2x2, one nested
    b'{"instances": [[1, 2], 3, [[4, 5]]]}',  # as many [ as 3 rows, one a number
    b'{"instances": [[1, []], [3, 4]]}',
    b'{"instances": [[1, {}]]}',
    b'{"instances": [{}, [1, 2]]}',
    b'{"instances": [[[1, 2, 3], [4]]]}',  # ragged, as many values as a 2x2
    b'{"instances": [[[1, [2]], [3, 4]]]}',  # rows of the right lengths, one value a list
    b'{"instances": [[[[], [1, 2]], [3, 4]]]}',
    b'{"instances": [[1, 2],]}',
    b'{"instances": [[1, 2, ], [3, 4]]}',
    b'{"instances": [[1, 2]],}',
    b'{ "instances" :\n\t[ [ 1.5e0 , -2E+1 ] ,[0.0e-0,-0] ] }',
    b'{"instances": [[1, 2], [3]]}',
    b'{"instances": [[1, 2, 3]]}',
    b'{"instances": [[[1, 2]]]}',
    b'{"instances": [[1, 2]], "extra": 1}',
    b'{"instances": [[{"a": 1}, 2]]}',
    b'{"instan\\u0063es": [[1, 2]]}',
    b'{"instances": [[1, 2]]}  ',
    b'{"instances": [[1' + b"0" * 400 + b", 2]]}",
    b'{"instances": [[1, 2]]}\x0b',
    b'{"instances": [[1, 2]]}\x0c',
    b'{"instances": [[1, 2]]}\x00',
    b'{"instances": [[1,\x0b2]]}',
    b'{"instances": [[1, 2]]} // a comment',
    b'{"instances": [[1, 2]]} /* a comment */',
    b'{"instances": [[1, 2]]}{}',
    b'{"instances": [[1, 2]]} [',
    b'\r\n\t {\r\n\t "instances"\r\n\t :\r\n\t [\r\n\t [\r\n\t 1\r\n\t ,2]]\r\n\t ',
    b'{"instances": [[-0, -0.0]]}',
    b'{"instances": [[-0, 0]]}',
    b'{"instances": [[-0e0, -0E-0]]}',
    b'{"instances": [[1.5, -2], [3e2, -0]]}',
    b'{"instances": [[01, 2]]}',
    b'{"instances": [[-01, 2]]}',
    b'{"instances": [[1., 2]]}',
    b'{"instances": [[.5, 2]]}',
    b'{"instances": [[+1, 2]]}',
    b'{"instances": [[1e, 2]]}',
    b'{"instances": [[1e+, 2]]}',
    b'{"instances": [[-, 2]]}',
    b'{"instances": [[0x10, 2]]}',
    b'{"instances": [[1_000, 2]]}',
    b'{"instances": [[1 2]]}',
    b'{"instances": [[1,, 2]]}',
    b'{"instances": [[Infinity, -Infinity]]}',
    b'{"instances": [[NaN, 2]]}',
    b'{"instances": [[nan, inf]]}',
    b'{"instances": [[1e400, 2]]}',
    b'{"instances": [[1e-400, 2]]}',
    b'{"instances": [[1e308, 1.7976931348623157e308]]}',
    b'{"instances": [[4.9e-324, 2.2250738585072011e-308]]}',
    b'{"instances": [[1125899906842623, -1125899906842623]]}',  # 2**50 - 1
    b'{"instances": [[1125899906842624, 2]]}',  # 2**50
    b'{"instances": [[1125899906842623.5, 2]]}',
    b'{"instances": [[9007199254740993, 2]]}',  # 2**53 + 1
    b'{"instances": [[18446744073709551615, 2]]}',  # 2**64 - 1
    b'{"instances": [[18446744073709551616, 2]]}',
    b'{"instances": [[-9223372036854775808, 2]]}',
    b'{"instances": [[-9223372036854775809, 2]]}',
    b'{"instances": [[123456789012345678901234567890, 2]]}',
    b'{"instances": [[0.1000000000000000055511151231257827, 2]]}',
    b'{"instances": [[3.4028235e38, 3.4028234663852886e38]]}',
    b'{"instances": [[2.4703282292062327e-324, 2.4703282292062328e-324]]}',
    b'{"instances": [[true, 2]]}',
    b'{"instances": [[null, 2]]}',
    b'{"instances": [["1", 2]]}',
    b'{"instances": [[1, 2]], "instances": [[3, 4]]}',
    b'{"instances": 5}',
    b'{"instances": [5, 6]}',
    b'{"instances": []}',
    b'{"instances": [[]]}',
    b'["instances", [[1, 2]]]',
    b'"instances"',
    b'{"\\u0069nstances": [[1, 2]]}',
    b'{"inst\\"ances": [[1, 2]]}',
    b'{"Instances": [[1, 2]]}',
    b'{"instances": [[1, 2]]',
    b'{"instances": [[1, 2]]}}',
    b"{'instances': [[1, 2]]}",
    b'{"instances": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}",
    b"",
    b" ",
    b"not json at all",
]


@pytest.mark.parametrize("body", TRICKY_BODIES, ids=repr)
def test_tricky_bodies_are_answered_as_promised(body: bytes) -> None:
    for dtype in DTYPES:
        for shape in ((-1, 2), (-1, 3), (-1, 1), (-1, 2, 2)):
            assert_as_promised(layout_of(dtype, shape), body)


#: The instance shapes of several axes every tricky body is tried at.
NESTED_SHAPES = [(8, 8), (2, 3, 4), (1, 5), (5, 1)]


def _grid(shape: tuple[int, ...], start: int = 0) -> Any:
    """Nested lists shaped ``shape`` of distinct small numbers from ``start``."""
    values = (np.arange(int(np.prod(shape))) + start) / 4
    return values.reshape(shape).tolist()


def nested_bodies(shape: tuple[int, ...]) -> list[bytes]:
    """Bodies for instances of ``shape`` with the right number of values in the wrong
    nesting, and the like."""
    good = _grid(shape)
    innermost = shape[-1]
    bodies = [_dumps([good]), _dumps([good, _grid(shape, 100)]), _dumps(good)]

    def variant(change: Any) -> bytes:
        instance = json.loads(json.dumps(good))
        change(instance)
        return _dumps([instance, good])

    def rows_of(instance: Any) -> list[list[Any]]:
        """The innermost rows, in order."""
        rows = [instance]
        for _ in shape[:-1]:
            rows = [row for parent in rows for row in parent]
        return rows

    def ragged(instance: Any) -> None:  # one value moved to the next row: the same count
        rows = rows_of(instance)
        if len(rows) > 1:
            rows[1].insert(0, rows[0].pop())
        else:
            rows[0].append(rows[0].pop())

    def ragged_first(instance: Any) -> None:  # a value moved to the previous row
        rows = rows_of(instance)
        if len(rows) > 1:
            rows[0].append(rows[1].pop(0))

    def wrapped_value(instance: Any) -> None:  # one more level around one value
        rows = rows_of(instance)
        rows[-1][-1] = [rows[-1][-1]]

    def wrapped_pair(instance: Any) -> None:  # [] and [a, b] in place of a and b: as many values
        rows = rows_of(instance)
        if innermost > 1:
            rows[0][0], rows[0][1] = [], [rows[0][0], rows[0][1]]
        elif len(rows) > 1:
            rows[0][0], rows[1][0] = [], [rows[0][0], rows[1][0]]

    def wrapped_row(instance: Any) -> None:  # one more level around a whole row
        rows = rows_of(instance)
        rows[0][:] = [list(rows[0])]

    def scalar_row(instance: Any) -> None:  # a number where a row belongs
        parents = [instance]
        for _ in shape[:-2]:
            parents = [row for parent in parents for row in parent]
        parents[0][0] = 1.0

    def flat_row(instance: Any) -> None:  # a row's values spliced into its parent
        parents = [instance]
        for _ in shape[:-2]:
            parents = [row for parent in parents for row in parent]
        parents[0][:1] = parents[0][0]

    def empty_row(instance: Any) -> None:
        rows_of(instance)[0].clear()

    def empty_inside(instance: Any) -> None:  # [] beside a row's values
        rows_of(instance)[0].append([])

    def object_row(instance: Any) -> None:
        rows_of(instance)[0].append({})

    for change in (
        ragged,
        ragged_first,
        wrapped_value,
        wrapped_pair,
        wrapped_row,
        scalar_row,
        flat_row,
        empty_row,
        empty_inside,
        object_row,
    ):
        bodies.append(variant(change))
    flat = np.ravel(good).tolist()
    text = json.dumps(good).encode()
    bodies += [
        _dumps([flat]),  # every level but one missing
        _dumps([[good]]),  # one level too many around the instance
        _dumps([good, flat]),
        _dumps([np.reshape(flat, (-1, 1)).tolist()]),  # 1xN and Nx1, the same values
        _dumps([np.reshape(flat, (1, -1)).tolist()]),
        _dumps([np.reshape(flat, shape[::-1]).tolist()]),  # the axes reversed
        _dumps([[[] for _ in range(shape[0])]]),
        _dumps([[]]),
        _dumps([good] * 9),  # more instances than accepted
        b'{"instances": [' + text.replace(b"[", b"[ ", 1) + b"]}",
        b'{"instances": [' + text.replace(b"]", b",]", 1) + b"]}",
        b'{"instances": [' + text.replace(b"]", b"]]", 1) + b"]}",
        b'{"instances": [' + text.replace(b"0.0", b"true", 1) + b"]}",
        b'{"instances": [' + text.replace(b"0.0", b"1e400", 1) + b"]}",
        b'{"instances": [' + text.replace(b"0.0", b"2e15", 1) + b"]}",
        b'{"instances": [' + text.replace(b"0.0", b"-0", 1) + b"]}",
    ]
    return bodies


ALL_NESTED_BODIES = [body for shape in NESTED_SHAPES for body in nested_bodies(shape)]


@pytest.mark.parametrize("shape", NESTED_SHAPES, ids=str)
def test_tricky_bodies_are_answered_as_promised_at_nested_shapes(shape: tuple[int, ...]) -> None:
    """Every tricky body, and the nested ones of every shape (a body of 1x5 sent to a 5x1
    model too)."""
    for dtype in DTYPES:
        layout = layout_of(dtype, (-1, *shape), max_instances=8)
        for body in [*TRICKY_BODIES, *ALL_NESTED_BODIES]:
            assert_as_promised(layout, body)


def test_scalar_instances_are_answered_as_promised() -> None:
    """Instances of no axis (``shape=(-1,)``)."""
    extra = [b'{"instances": [1, 2.5, -0]}', b'{"instances": [1, [2]]}', b'{"instances": [[]]}']
    for dtype in DTYPES:
        layout = layout_of(dtype, (-1,), max_instances=8)
        for body in [*TRICKY_BODIES, *ALL_NESTED_BODIES, *extra]:
            assert_as_promised(layout, body)
    assert layout.parse_json(extra[0]).tolist() == [1.0, 2.5, 0.0]


def lifted(body: bytes) -> bytes:
    """A tricky body of two-wide rows as one instance of shape (rows + 1, 2): its rows after
    a plain one, so that its numbers and syntax are read inside a nested body."""
    head, _, tail = body.partition(b'"instances": [')
    if not tail:
        return body
    inner, bracket, rest = tail.rpartition(b"]")
    return head + b'"instances": [[[0.5, 0.25], ' + inner + bracket + b"]" + rest


def test_tricky_bodies_inside_a_nested_instance_are_answered_as_promised() -> None:
    for dtype in DTYPES:
        for shape in ((-1, 2, 2), (-1, 3, 2)):
            layout = layout_of(dtype, shape)
            for body in TRICKY_BODIES:
                assert_as_promised(layout, lifted(body))


def test_plain_bodies_take_the_fast_path() -> None:
    """Without this, the comparisons above could pass with a fast path that takes nothing."""
    for shape in NESTED_SHAPES:
        good = nested_bodies(shape)[1]
        rows = plain_float_rows(good, shape, 8)
        assert rows is not None
        assert rows.shape == (2, *shape)
        assert rows.tobytes() == np.array([_grid(shape), _grid(shape, 100)]).tobytes()
    rows = plain_float_rows(b'{"instances": [[1.5, -2], [3e2, -0]]}', (2,), 8)
    assert rows is not None
    assert rows.tolist() == [[1.5, -2.0], [300.0, 0.0]]
    assert not np.signbit(rows[1, 1])  # -0 is the integer 0, as orjson reads it
    digits = layout_of("float32", (-1, 8, 8), min_value=0.0, max_value=1.0)
    assert digits.plain_range == (0.0, 1.0)
    pixels = (np.arange(64) / 64).reshape(8, 8).tolist()
    assert digits.parse_plain_json(_dumps([pixels])) is not None
    assert layout_of("float32", (-1, 2), min_value=0.1, max_value=1.0).plain_range is None
    assert layout_of("float64", (-1, 2), min_value=0.1, max_value=1.0).plain_range == (0.1, 1)
    for dtype, shape in [("int64", (-1, 2)), ("float16", (-1, 2)), ("float32", (-1, -1))]:
        assert layout_of(dtype, shape).plain_shape is None


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        (b'{"instances": [[[1, 2, 3], [4]]]}', (2, 2)),  # as many [ and values: the walk sees it
        (b'{"instances": [[[1, [2]], [3, 4]]]}', (2, 2)),  # right lengths: the [ count sees it
        (b'{"instances": [[[[], [1, 2]], [3, 4]]]}', (2, 2)),
        (b'{"instances": [[1, 2], [3, 4]]}', (2,)),  # more rows than max_rows (1, below)
        (b'{"instances": [[1125899906842624, 2]]}', (2,)),  # 2**50: beyond the exact bound
        (b'{"instances": [[[1, 2], [3, 4]]]}', (2, 0)),  # an empty axis
        (b"not json at all", (2,)),
    ],
)
def test_the_fast_path_leaves_what_it_cannot_prove(body: bytes, shape: tuple[int, ...]) -> None:
    """The right number of values in the wrong nesting reaches ``as_buffer`` (which flattens
    any nesting) unless the walk or the count of ``[`` refuses it."""
    assert plain_float_rows(body, shape, 1) is None
    again = plain_float_rows(b'{"instances": [[7, 8]]}', (2,), 8)  # the parser is usable again
    assert again is not None
    assert again.tolist() == [[7.0, 8.0]]


def test_the_fast_path_parses_in_several_threads_at_once() -> None:
    """One simdjson parser per thread: handlers parse in a pool."""
    bodies = [json.dumps({"instances": [[index, -index / 3]]}).encode() for index in range(400)]
    with ThreadPoolExecutor(4) as pool:
        parsed = list(pool.map(lambda body: plain_float_rows(body, (2,), 8), bodies))
    for index, rows in enumerate(parsed):
        assert rows is not None
        assert rows.tolist() == [[index, -index / 3]]


DIGITS = st.text("0123456789", min_size=1, max_size=25)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    numbers=st.lists(
        st.tuples(
            st.sampled_from(["", "-"]),
            DIGITS,
            st.none() | DIGITS,
            st.none() | st.tuples(st.sampled_from("eE"), st.sampled_from(["", "+", "-"]), DIGITS),
        ),
        min_size=2,
        max_size=2,
    ),
    dtype=st.sampled_from(DTYPES),
)
def test_written_decimals_are_rounded_correctly(
    numbers: list[tuple[str, str, str | None, tuple[str, str, str] | None]], dtype: str
) -> None:
    """Numbers as a client may write them (long mantissas that round hard, leading zeros,
    exponents of any size), not only as Python prints them: a decimal is the float64 nearest
    to it (Python's own reading), then cast."""
    texts = [
        sign
        + whole
        + ("" if fraction is None else "." + fraction)
        + ("" if exp is None else "".join(exp))
        for sign, whole, fraction, exp in numbers
    ]
    layout = layout_of(dtype, (-1, 2))
    body = ('{"instances": [[' + ", ".join(texts) + "]]}").encode()
    assert_as_promised(layout, body)
    parsed = answered(layout, body)
    decimals = all("." in text or "e" in text.lower() for text in texts)
    if not isinstance(parsed, int) and decimals:
        nearest = np.array([[float(text) for text in texts]]).astype(dtype)
        assert parsed.tobytes() == nearest.tobytes()


def test_a_one_input_model_answers_as_its_tensor_does() -> None:
    """Through the model's ``InputLayout``, bare instances or objects keyed by the input's name."""
    manifest = Manifest.create(
        name="m",
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64},
        architecture=Architecture(import_path="service.models.mlp:PeerMLP"),
        inputs=(TensorSpec(name="features", dtype="float32", shape=(-1, 3)),),
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, 2)),),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    model = InputLayout(manifest)
    tensor = model.tensors["features"]
    for body in [*TRICKY_BODIES, b'{"instances": [[1, 2, 3]]}']:
        try:
            named: int | Array = model.parse_json(body)["features"]
        except ServiceError as error:
            named = error.status_code
        expected = promised(tensor, body)
        if isinstance(expected, int) or isinstance(named, int):
            assert named == expected, body
        else:
            assert named.tobytes() == expected.tobytes(), body
    keyed = model.parse_json(b'{"instances": [{"features": [1, 2, 3]}, {"features": [4, 5, 6]}]}')
    assert keyed["features"].tolist() == [[1, 2, 3], [4, 5, 6]]
