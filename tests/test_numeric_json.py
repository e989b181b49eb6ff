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
SHAPES = [(-1, 1), (-1, 2), (-1, 3), (-1, 2, 2), (-1, 4, 3)]
DTYPES = ["float32", "float64"]


def layouts(dtype: str, shape: tuple[int, ...], **spec: Any) -> tuple[TensorLayout, TensorLayout]:
    """The layout with its fast paths, and the same one with them turned off."""
    fast = TensorLayout(TensorSpec(name="x", dtype=dtype, shape=shape, **spec))  # type: ignore[arg-type]
    general = TensorLayout(fast.spec)
    object.__setattr__(general, "fast_instance_shape", None)  # the general path alone
    object.__setattr__(general, "plain_width", None)
    assert fast.fast_instance_shape == shape[1:]
    assert fast.plain_width == (shape[1] if len(shape) == 2 else None)
    return fast, general


def plain_rows_alone(layout: TensorLayout) -> TensorLayout:
    """``layout`` with ``plain_float_rows`` and the general path, without ``plain_float_array``
    (which answers what the rows' path leaves, and would hide its mistakes)."""
    alone = TensorLayout(layout.spec)
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
    rows = plain_float_rows(b'{"instances": [[1.5, -2], [3e2, -0]]}', 2, 8)
    assert rows is not None
    assert rows.dtype == np.float64
    assert rows.tolist() == [[1.5, -2.0], [300.0, 0.0]]
    assert not np.signbit(rows[1, 1])  # -0 is the integer 0, as orjson reads it
    for body, width, max_rows in [
        (
            b'{"instances": [[1, 2], [3, 4]]}',
            2,
            1,
        ),  # more rows than accepted: the general path says
        (b'{"instances": [[1, 2]]}', 3, 8),
        (b'{"instances": [[1, [2]], [3, 4]]}', 2, 8),
        (b'{"instances": [[1125899906842624, 2]]}', 2, 8),
        (b"not json at all", 2, 8),
    ]:
        assert plain_float_rows(body, width, max_rows) is None
    again = plain_float_rows(b'{"instances": [[7, 8]]}', 2, 8)  # the parser is usable again
    assert again is not None
    assert again.tolist() == [[7.0, 8.0]]


def test_the_rows_path_parses_in_several_threads_at_once() -> None:
    bodies = [json.dumps({"instances": [[index, -index / 3]]}).encode() for index in range(400)]
    with ThreadPoolExecutor(4) as pool:
        parsed = list(pool.map(lambda body: plain_float_rows(body, 2, 8), bodies))
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
        object.__setattr__(tensor, "plain_width", None)
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
