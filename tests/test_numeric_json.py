"""The numbers-only JSON fast path (``numeric_json``) builds exactly the general path's array,
and leaves every body it cannot prove plain to the general path, whose answer or refusal is
then unchanged: the same body parsed with and without the fast path, over many shapes and
edge values."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import ServiceError
from service.frontend.inputs import InputLayout
from service.frontend.numeric_json import plain_float_array, plain_float_rows
from service.frontend.tensor_layout import TensorLayout
from service.manifest import Architecture, Manifest, TensorSpec

F32_MAX = float(np.finfo(np.float32).max)
#: Values at the edges of what either path accepts or converts differently.
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
    2**53 + 1,  # int64 -> float32 and int64 -> float64 -> float32 may differ beyond here
    2**60 + 2**36 + 1,
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


def layouts(
    dtype: str, shape: tuple[int, ...], max_instances: int = 1024, **spec: Any
) -> tuple[TensorLayout, TensorLayout]:
    """The layout with its fast paths, and the same one with them turned off."""
    tensor = TensorSpec(name="x", dtype=dtype, shape=shape, **spec)  # type: ignore[arg-type]
    fast = TensorLayout(tensor, max_instances=max_instances)
    general = TensorLayout(fast.spec, max_instances=max_instances)
    object.__setattr__(general, "fast_instance_shape", None)  # the general path alone
    object.__setattr__(general, "plain_shape", None)
    assert fast.fast_instance_shape == shape[1:]
    assert fast.plain_shape == shape[1:]
    return fast, general


def plain_rows_alone(layout: TensorLayout) -> TensorLayout:
    """``layout`` with ``plain_float_rows`` and the general path, without ``plain_float_array``
    (which answers what the rows' path leaves, and would hide its mistakes)."""
    alone = TensorLayout(layout.spec, max_instances=layout.max_instances)
    object.__setattr__(alone, "fast_instance_shape", None)
    return alone


def outcome(layout: TensorLayout, body: bytes) -> tuple[str, Any]:
    try:
        array = layout.parse_json(body)
    except ServiceError as error:
        return "refused", (type(error).__name__, error.status_code, error.message)
    return "array", (array.dtype.str, array.shape, array.tobytes())


def assert_same(fast: TensorLayout, general: TensorLayout, body: bytes) -> None:
    expected = outcome(general, body)
    assert outcome(fast, body) == expected, body[:200]
    assert outcome(plain_rows_alone(fast), body) == expected, body[:200]


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
def test_fast_path_matches_the_general_path(
    data: st.DataObject, shape: tuple[int, ...], dtype: str, rows: int, ragged: bool
) -> None:
    fast, general = layouts(dtype, shape)
    values = VALUES if data.draw(st.booleans()) else st.floats(-1e6, 1e6) | st.integers(-9, 9)
    row_shapes = [
        tuple(
            max(0, size + data.draw(st.integers(-1, 1))) if ragged else size for size in shape[1:]
        )
        for _ in range(rows)
    ]
    instances = [data.draw(nested(row_shape, values)) for row_shape in row_shapes]
    assert_same(fast, general, json.dumps({"instances": instances}).encode())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", EDGE_VALUES, ids=repr)
def test_each_edge_value_is_answered_alike(dtype: str, value: Any) -> None:
    fast, general = layouts(dtype, (-1, 3))
    for instances in ([[1.0, value, 2.0]], [[1, value, 2]], [[value, value, value]], [value]):
        assert_same(fast, general, json.dumps({"instances": instances}).encode())


@pytest.mark.parametrize(
    "text",
    [
        '{"instances": [[1, 2]]}',
        '{ "instances" :\n\t[ [ 1.5e0 , -2E+1 ] ,[0.0e-0,-0] ] }',
        '{"instances": [[1e400, 2]]}',  # orjson reads it as infinity
        '{"instances": [[-1e400, 2]]}',
        '{"instances": [[1, 2], [3]]}',
        '{"instances": [[1, 2, 3]]}',
        '{"instances": [[[1, 2]]]}',
        '{"instances": [1, 2]}',
        '{"instances": [[]]}',
        '{"instances": []}',
        '{"instances": [[1, 2]], "extra": 1}',
        '{"instances": [[true, 2]]}',
        '{"instances": [[null, 2]]}',
        '{"instances": [["1", 2]]}',
        '{"instances": [[{"a": 1}, 2]]}',
        '{"instances": [[NaN, 2]]}',
        '{"instances": [[Infinity, 2]]}',
        '{"instances": [[1, 2]',
        '{"instan\\u0063es": [[1, 2]]}',
        '{"instances": [[1, 2]]}  ',
        '{"instances": [[18446744073709551616, 2]]}',
        '{"instances": [[-9223372036854775809, 2]]}',
        '{"instances": [[1' + "0" * 400 + ", 2]]}",
        '{"instances": ' + "[" * 70 + "1" + "]" * 70 + "}",
    ],
)
def test_written_numbers_are_answered_alike(text: str) -> None:
    for dtype in DTYPES:
        fast, general = layouts(dtype, (-1, 2))
        assert_same(fast, general, text.encode())


def test_a_value_range_is_still_checked() -> None:
    fast, general = layouts("float32", (-1, 2), min_value=-1.0, max_value=1.0)
    for instances in ([[0.5, -1.0]], [[0.5, 1.5]], [[-3, 0]]):
        assert_same(fast, general, json.dumps({"instances": instances}).encode())
    with pytest.raises(ServiceError, match=r"values must lie in \[-1, 1\].*got 1\.5"):
        fast.parse_json(b'{"instances": [[0.5, 1.5]]}')


@pytest.mark.parametrize(
    ("low", "high", "pad"),
    [(0.0, 1.0, 0), (0.0, 1.0, -1), (-0.1, 0.1, 0), (None, 0.5, 0), (-1e39, 1e39, 0)],
)
def test_a_value_range_is_answered_alike_at_nested_shapes(
    low: float | None, high: float | None, pad: int
) -> None:
    """The range is checked on the float64 values where the dtype holds both ends exactly
    (``plain_range``), else on the cast array as before: values at, just past and rounding
    onto either end, and the padding value outside the range, answered alike."""
    edges = [0, 1, -1, 0.1, -0.1, 0.5, 1.0000000001, 0.10000000001, 1.5, -0.0, 1e39]
    for dtype in DTYPES:
        fast, general = layouts(dtype, (-1, 2, 3), min_value=low, max_value=high, pad_value=pad)
        for edge in edges:
            instance = [[0.25, 0.5, edge], [0, 0.125, 0.375]]
            assert_same(fast, general, _dumps([instance, instance]))
    digits = TensorLayout(
        TensorSpec(name="x", dtype="float32", shape=(-1, 8, 8), min_value=0.0, max_value=1.0)
    )
    assert digits.plain_range == (0.0, 1.0)
    assert layouts("float32", (-1, 2), min_value=0.1, max_value=1.0)[0].plain_range is None
    assert layouts("float64", (-1, 2), min_value=0.1, max_value=1.0)[0].plain_range == (0.1, 1)


def test_the_fast_path_takes_plain_numbers_and_leaves_the_rest() -> None:
    shape = (2,)
    f32 = np.dtype(np.float32)
    taken = plain_float_array([[1.5, -2]], b'{"instances": [[1.5, -2]]}', f32, shape)
    assert taken is not None
    assert taken.dtype == f32
    assert taken.tolist() == [[1.5, -2.0]]
    for dtype in (f32, np.dtype(np.float64)):  # its own memory, as the general path's
        rows = plain_float_array(
            [[1.5, -2], [3, 4]], b'{"instances": [[1.5, -2], [3, 4]]}', dtype, shape
        )
        assert rows is not None
        assert rows.flags.writeable
        assert rows.flags.c_contiguous
    cases: list[tuple[list[Any], bytes]] = [
        ([[True, 2]], b'{"instances": [[true, 2]]}'),  # booleans: refused by the general path
        ([["1", 2]], b'{"instances": [["1", 2]]}'),  # a string numpy would read as 1
        ([[1, 2, 3]], b'{"instances": [[1, 2, 3]]}'),  # the wrong shape
        ([[2.0**53 + 2, 2]], b'{"instances": [[9007199254740994.0, 2]]}'),  # beyond 2**50
        ([[1, 2]], b""),  # a body that proves nothing
    ]
    for instances, body in cases:
        assert plain_float_array(instances, body, f32, shape) is None


def test_only_float_tensors_of_fixed_shape_take_it() -> None:
    assert (
        TensorLayout(TensorSpec(name="x", dtype="int64", shape=(-1, 2))).fast_instance_shape is None
    )
    assert (
        TensorLayout(TensorSpec(name="x", dtype="float16", shape=(-1, 2))).fast_instance_shape
        is None
    )
    assert (
        TensorLayout(TensorSpec(name="x", dtype="float32", shape=(-1, -1))).fast_instance_shape
        is None
    )
    assert TensorLayout(
        TensorSpec(name="x", dtype="float32", shape=(-1, 8, 8))
    ).fast_instance_shape == (8, 8)


#: Bodies where simdjson, orjson or the shape proof of ``plain_float_rows`` could part ways.
TRICKY_BODIES = [
    b'\xef\xbb\xbf{"instances": [[1, 2]]}',  # a byte-order mark: simdjson skips it, orjson refuses
    b'{"instances": [[1,\xc2\xa02]]}',  # a non-ASCII space
    b'{"instances": [[1, [2]], [3, 4]]}',  # as many numbers as a 2x2, one nested
    b'{"instances": [[1, 2], 3, [[4, 5]]]}',  # as many [ as 3 rows, one a number
    b'{"instances": [[1, []], [3, 4]]}',
    b'{"instances": [[1, {}]]}',
    b'{"instances": [{}, [1, 2]]}',
    b'{"instances": [[1, 2],]}',
    b'{"instances": [[1, 2, ], [3, 4]]}',
    b'{"instances": [[1, 2]],}',
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
    b'{"instances": [[18446744073709551615, 2]]}',  # 2**64 - 1: simdjson's uint64
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
]


@pytest.mark.parametrize("body", TRICKY_BODIES, ids=repr)
def test_tricky_bodies_are_answered_alike(body: bytes) -> None:
    for dtype in DTYPES:
        for shape in ((-1, 2), (-1, 3), (-1, 1)):
            fast, general = layouts(dtype, shape)
            assert_same(fast, general, body)


#: The instance shapes of several axes every tricky body is compared at.
NESTED_SHAPES = [(8, 8), (2, 3, 4), (1, 5), (5, 1)]


def _grid(shape: tuple[int, ...], start: int = 0) -> Any:
    """Nested lists shaped ``shape`` of distinct small numbers from ``start``."""
    values = (np.arange(int(np.prod(shape))) + start) / 4
    return values.reshape(shape).tolist()


def _dumps(instances: Any) -> bytes:
    return json.dumps({"instances": instances}).encode()


def nested_bodies(shape: tuple[int, ...]) -> list[bytes]:
    """Bodies for instances of ``shape`` written to break ``plain_float_rows``'s walk and its
    count of ``[``: the right number of values in the wrong nesting, and the like."""
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

    def flat_row(instance: Any) -> None:  # a row's values spliced into its parent: a level missing
        parents = [instance]
        for _ in shape[:-2]:
            parents = [row for parent in parents for row in parent]
        parents[0][:1] = parents[0][0]

    def empty_row(instance: Any) -> None:
        rows = rows_of(instance)
        rows[0].clear()

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
        b'{"instances": [' + json.dumps(good).encode().replace(b"[", b"[ ", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"]", b",]", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"]", b"]]", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"0.0", b"true", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"0.0", b"1e400", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"0.0", b"2e15", 1) + b"]}",
        b'{"instances": [' + json.dumps(good).encode().replace(b"0.0", b"-0", 1) + b"]}",
    ]
    return bodies


def lifted(body: bytes) -> bytes:
    """A tricky body of two-wide rows as one instance of shape (rows + 1, 2): its rows after
    a plain one, so that its numbers and syntax are read inside a nested body."""
    head, _, tail = body.partition(b'"instances": [')
    if not tail:
        return body
    inner, bracket, rest = tail.rpartition(b"]")
    return head + b'"instances": [[[0.5, 0.25], ' + inner + bracket + b"]" + rest


ALL_NESTED_BODIES = [body for shape in NESTED_SHAPES for body in nested_bodies(shape)]


@pytest.mark.parametrize("shape", NESTED_SHAPES, ids=str)
def test_tricky_bodies_are_answered_alike_at_nested_shapes(shape: tuple[int, ...]) -> None:
    """Every tricky body, and the nested ones of every shape (a body of 1x5 sent to a 5x1
    model too), three ways at each shape."""
    for dtype in DTYPES:
        fast, general = layouts(dtype, (-1, *shape), max_instances=8)
        for body in [*TRICKY_BODIES, *ALL_NESTED_BODIES]:
            assert_same(fast, general, body)


def test_scalar_instances_are_answered_alike() -> None:
    """Instances of no axis (``shape=(-1,)``): the instances' ``[`` is the body's only one."""
    extra = [b'{"instances": [1, 2.5, -0]}', b'{"instances": [1, [2]]}', b'{"instances": [[]]}']
    for dtype in DTYPES:
        fast, general = layouts(dtype, (-1,), max_instances=8)
        for body in [*TRICKY_BODIES, *ALL_NESTED_BODIES, *extra]:
            assert_same(fast, general, body)
    assert outcome(fast, extra[0]) == outcome(general, extra[0])
    assert outcome(fast, extra[0])[0] == "array"


def test_tricky_bodies_inside_a_nested_instance_are_answered_alike() -> None:
    for dtype in DTYPES:
        for shape in ((-1, 2, 2), (-1, 3, 2)):
            fast, general = layouts(dtype, shape)
            for body in TRICKY_BODIES:
                assert_same(fast, general, lifted(body))


def test_the_walk_and_the_bracket_count_are_each_needed() -> None:
    """Bodies with the right number of values in the wrong nesting reach ``as_buffer`` (which
    flattens any nesting) unless the walk or the count of ``[`` refuses them."""
    shape = (2, 2)
    for body in [
        b'{"instances": [[[1, 2, 3], [4]]]}',  # as many [ and values: only the walk sees it
        b'{"instances": [[[1, [2]], [3, 4]]]}',  # right lengths: only the count sees it
        b'{"instances": [[[[], [1, 2]], [3, 4]]]}',
    ]:
        assert plain_float_rows(body, shape, 8) is None
        fast, general = layouts("float32", (-1, *shape))
        assert outcome(general, body)[0] == "refused"
        assert_same(fast, general, body)
    taken = plain_float_rows(b'{"instances": [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]}', shape, 8)
    assert taken is not None
    assert taken.shape == (2, 2, 2)
    assert taken.ravel().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_nested_instances_take_the_simdjson_path() -> None:
    """A digit (8x8) and a 2x3x4 instance are read by ``plain_float_rows``, not orjson."""
    for shape in NESTED_SHAPES:
        good = nested_bodies(shape)[1]
        rows = plain_float_rows(good, shape, 8)
        assert rows is not None
        assert rows.shape == (2, *shape)
        assert rows.tobytes() == np.array([_grid(shape), _grid(shape, 100)]).tobytes()


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
def test_written_decimals_round_alike(
    numbers: list[tuple[str, str, str | None, tuple[str, str, str] | None]], dtype: str
) -> None:
    """Numbers as a client may write them (long mantissas that round hard, leading zeros,
    exponents of any size), not only as Python prints them."""
    texts = [
        sign
        + whole
        + ("" if fraction is None else "." + fraction)
        + ("" if exp is None else "".join(exp))
        for sign, whole, fraction, exp in numbers
    ]
    fast, general = layouts(dtype, (-1, 2))
    assert_same(fast, general, ('{"instances": [[' + ", ".join(texts) + "]]}").encode())


def test_the_rows_path_takes_plain_rows_and_leaves_the_rest() -> None:
    rows = plain_float_rows(b'{"instances": [[1.5, -2], [3e2, -0]]}', (2,), 8)
    assert rows is not None
    assert rows.dtype == np.float64
    assert rows.tolist() == [[1.5, -2.0], [300.0, 0.0]]
    assert not np.signbit(rows[1, 1])  # -0 is the integer 0, as orjson reads it
    for body, shape, max_rows in [
        (
            b'{"instances": [[1, 2], [3, 4]]}',
            (2,),
            1,
        ),  # more rows than accepted: the general path says
        (b'{"instances": [[1, 2]]}', (3,), 8),
        (b'{"instances": [[1, [2]], [3, 4]]}', (2,), 8),
        (b'{"instances": [[1125899906842624, 2]]}', (2,), 8),
        (b"not json at all", (2,), 8),
        (b'{"instances": [[[1, 2], [3]]]}', (2, 2), 8),
        (b'{"instances": [[[1, 2, 3], [4]]]}', (2, 2), 8),  # ragged, as many numbers
        (b'{"instances": [[[1, [2]], [3, 4]]]}', (2, 2), 8),  # a list in a row
        (b'{"instances": [[[1, 2], [3, 4]]]}', (2, 0), 8),  # an empty axis: never taken
    ]:
        assert plain_float_rows(body, shape, max_rows) is None
    again = plain_float_rows(b'{"instances": [[7, 8]]}', (2,), 8)  # the parser is usable again
    assert again is not None
    assert again.tolist() == [[7.0, 8.0]]


def test_the_rows_path_parses_in_several_threads_at_once() -> None:
    bodies = [json.dumps({"instances": [[index, -index / 3]]}).encode() for index in range(400)]
    with ThreadPoolExecutor(4) as pool:
        parsed = list(pool.map(lambda body: plain_float_rows(body, (2,), 8), bodies))
    for index, rows in enumerate(parsed):
        assert rows is not None
        assert rows.tolist() == [[index, -index / 3]]


def test_a_one_input_model_takes_the_rows_path_and_answers_alike() -> None:
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
    layout = InputLayout(manifest)
    general = InputLayout(manifest)
    for tensor in general.tensors.values():
        object.__setattr__(tensor, "fast_instance_shape", None)
        object.__setattr__(tensor, "plain_shape", None)
    for body in [
        *TRICKY_BODIES,
        b'{"instances": [[1, 2, 3]]}',
        b'{"instances": [{"features": [1, 2, 3]}]}',
    ]:
        assert named_outcome(layout, body) == named_outcome(general, body), body


def named_outcome(layout: InputLayout, body: bytes) -> tuple[str, Any]:
    try:
        arrays = layout.parse_json(body)
    except ServiceError as error:
        return "refused", (type(error).__name__, error.status_code, error.message)
    return "arrays", [
        (name, array.dtype.str, array.shape, array.tobytes())
        for name, array in arrays.arrays.items()
    ]
