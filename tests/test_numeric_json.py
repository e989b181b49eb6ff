"""The numbers-only JSON fast path (``numeric_json``) builds exactly the general path's array,
and leaves every body it cannot prove plain to the general path, whose answer or refusal is
then unchanged: the same body parsed with and without the fast path, over many shapes and
edge values."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import ServiceError
from service.frontend.numeric_json import plain_float_array
from service.frontend.tensor_layout import TensorLayout
from service.manifest import TensorSpec

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
SHAPES = [(-1, 1), (-1, 2), (-1, 3), (-1, 2, 2), (-1, 4, 3)]
DTYPES = ["float32", "float64"]


def layouts(dtype: str, shape: tuple[int, ...], **spec: Any) -> tuple[TensorLayout, TensorLayout]:
    """The layout with its fast path, and the same one with it turned off."""
    fast = TensorLayout(TensorSpec(name="x", dtype=dtype, shape=shape, **spec))  # type: ignore[arg-type]
    general = TensorLayout(fast.spec)
    object.__setattr__(general, "fast_instance_shape", None)  # the general path alone
    assert fast.fast_instance_shape == shape[1:]
    return fast, general


def outcome(layout: TensorLayout, body: bytes) -> tuple[str, Any]:
    try:
        array = layout.parse_json(body)
    except ServiceError as error:
        return "refused", (type(error).__name__, error.status_code, error.message)
    return "array", (array.dtype.str, array.shape, array.tobytes())


def assert_same(fast: TensorLayout, general: TensorLayout, body: bytes) -> None:
    assert outcome(fast, body) == outcome(general, body), body[:200]


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
