"""Request bodies decoded and validated against an input spec: ``TensorLayout``, no torch."""

from __future__ import annotations

import io
import zipfile
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pytest
from numpy.lib import format as npy_format

from service.buckets import batch_group, group_and_cost
from service.errors import (
    BadRequestError,
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from service.frontend.bodies import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    NPZ_MEDIA_TYPE,
    answer_media_type,
    body_media_type,
    encode_npy,
    encode_npz,
    npz_members,
)
from service.frontend.inputs import InputLayout
from service.frontend.per_token import PaddedInstances
from service.frontend.tensor_layout import TensorLayout
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays
from service.types import Array

#: Pairs of floats, any value.
PAIRS = TensorLayout(TensorSpec(name="pairs", dtype="float32", shape=(-1, 2)))
#: Token ids 1..9, 0 pads, at most 4 tokens.
TOKENS = TensorLayout(
    TensorSpec(name="tokens", dtype="int64", shape=(-1, -1), max_length=4, min_value=1, max_value=9)
)
#: Sequences of 2-vectors, as long as the buckets allow.
VECTORS = TensorLayout(
    TensorSpec(name="vectors", dtype="float32", shape=(-1, -1, 2), pad_value=-1),
    length_edges=(2, 4, 8),
)


def layout(dtype: str = "float32", shape: tuple[int, ...] = (-1, 2), **spec: Any) -> TensorLayout:
    return TensorLayout(TensorSpec(name="x", dtype=dtype, shape=shape, **spec))  # type: ignore[arg-type]


def body(instances: object) -> bytes:
    return orjson.dumps({"instances": instances})


def npy(array: Array, **options: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **options)
    return buffer.getvalue()


def npy_version(array: Array, version: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    npy_format.write_array(buffer, array, version=version)
    return buffer.getvalue()


def refusal(parse: Any, *arguments: object) -> str:
    """The message of the ``InvalidInputError`` that ``parse(*arguments)`` raises."""
    with pytest.raises(InvalidInputError) as refused:
        parse(*arguments)
    assert refused.value.status_code == 422
    return refused.value.message


def bad_request(parse: Any, *arguments: object) -> str:
    with pytest.raises(BadRequestError) as refused:
        parse(*arguments)
    assert refused.value.status_code == 400
    return refused.value.message


def same(actual: Array, expected: Array) -> None:
    """Equal values, shape and dtype (native byte order)."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


# --------------------------------------------------------------------------- media types


@pytest.mark.parametrize(
    ("content_type", "media_type"),
    [
        (None, JSON_MEDIA_TYPE),
        ("", JSON_MEDIA_TYPE),
        ("; charset=utf-8", JSON_MEDIA_TYPE),
        ("application/json", JSON_MEDIA_TYPE),
        (" Application/JSON ; charset=utf-8", JSON_MEDIA_TYPE),
        ("application/x-npy", NPY_MEDIA_TYPE),
        ("application/octet-stream; x=application/json", NPY_MEDIA_TYPE),
    ],
)
def test_the_body_is_read_by_its_content_type(content_type: str | None, media_type: str) -> None:
    assert body_media_type(content_type) == media_type


def test_another_content_type_is_415_naming_the_accepted_ones() -> None:
    with pytest.raises(UnsupportedMediaTypeError) as refused:
        body_media_type("Text/CSV; a=application/json")
    assert refused.value.status_code == 415
    assert refused.value.message == (
        "send the body as application/json, application/x-npy or application/x-npz, got "
        "content-type 'text/csv'"
    )


@pytest.mark.parametrize(
    ("accept", "npy_answer"),
    [
        (None, False),
        ("", False),
        ("application/json", False),
        ("application/x-npy", True),
        ("APPLICATION/OCTET-STREAM", True),
        ("text/html, application/x-npy;q=0.5", True),
        ("application/x-npy;q=0.5", True),
        ("application/x-npy; Q = 0.5 , application/json;q=0.4", True),
        ("application/x-npy;level=1;q=0.5, application/json;q=0.9", False),
        ("application/json, application/x-npy", False),  # a tie goes to JSON
        ("application/x-npy, application/json;q=1", False),
        ("application/x-npy;q=1, application/json;q=0.5", True),
        ("application/x-npy;q=0.2, application/octet-stream;q=0.8, application/json;q=0.5", True),
        ("application/json;q=0.1, application/json;q=0.9, application/x-npy;q=0.5", False),
        ("application/x-npy;q=0", False),
        ("application/x-npy;q=banana", False),
        ("application/x-npy;q=2, application/json;q=0.5", False),  # out of range: unreadable
        ("application/x-npy;q=-1", False),
    ],
)
def test_an_npy_answer_needs_a_higher_quality_than_json(
    accept: str | None, npy_answer: bool
) -> None:
    assert (answer_media_type(accept) == NPY_MEDIA_TYPE) is npy_answer


def test_answers_encode_as_npy_and_never_as_pickles() -> None:
    predictions = np.array([[0.25, -1.5]], dtype=np.float32)
    same(np.load(io.BytesIO(encode_npy(predictions)), allow_pickle=False), predictions)
    objects = np.array([{"a": 1}], dtype=object)
    with pytest.raises(ValueError, match="allow_pickle=False"):
        encode_npy(objects)


def test_parse_follows_the_media_type() -> None:
    expected = np.array([[1.0, 2.0]], dtype=np.float32)
    same(PAIRS.parse(npy(expected), NPY_MEDIA_TYPE), expected)
    same(PAIRS.parse(body([[1, 2]]), JSON_MEDIA_TYPE), expected)


# --------------------------------------------------------------------------- JSON, fixed shape


def test_json_floats_become_the_specs_dtype_exactly() -> None:
    """0.1 is not exactly a float32: it is rounded, not refused."""
    same(PAIRS.parse_json(body([[0.1, 2], [-3.5, 1e-3]])), np.array([[0.1, 2], [-3.5, 1e-3]], "f4"))
    same(layout("float16").parse_json(body([[0.1, 65504]])), np.array([[0.1, 65504]], "f2"))
    same(layout("float64").parse_json(body([[0.1, 1e300]])), np.array([[0.1, 1e300]], "f8"))


def test_the_largest_float32_is_accepted_and_beyond_it_is_not_finite() -> None:
    largest = float(np.finfo(np.float32).max)
    same(PAIRS.parse_json(body([[largest, 0]])), np.array([[largest, 0]], dtype=np.float32))
    assert refusal(PAIRS.parse_json, body([[1e39, 0]])) == (
        "instances contain values that are not finite in float32 (NaN, infinity, or beyond its "
        "range)"
    )
    assert "not finite in float16" in refusal(layout("float16").parse_json, body([[70000.0, 0]]))
    # An integer too: refused as such, with no overflow warning from the cast (an error here).
    assert "not finite in float16" in refusal(layout("float16").parse_json, body([[70000, 0]]))


@pytest.mark.parametrize(("dtype", "largest"), [("int64", 2**63 - 1), ("int32", 2**31 - 1)])
def test_integer_inputs_take_integers_within_their_dtype(dtype: str, largest: int) -> None:
    integers = layout(dtype)
    same(integers.parse_json(body([[largest, -3]])), np.array([[largest, -3]], dtype=dtype))
    assert refusal(integers.parse_json, body([[largest + 1]])) == (
        f"instances contain integers outside the range of {dtype}"
    )


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8"])
def test_integer_inputs_take_whole_numbers_written_with_a_fraction(dtype: str) -> None:
    """JSON Schema (and so every generated client) counts 3.0 as the integer 3."""
    integers = layout(dtype)
    same(integers.parse_json(body([[3.0, 255.0]])), np.array([[3, 255]], dtype=dtype))
    assert refusal(integers.parse_json, body([[3.0, 2.5]])) == (
        f"instances must contain only integers ({dtype}); got fractional numbers"
    )


@pytest.mark.parametrize(
    ("dtype", "value", "limits"),
    [("int64", 1e19, "[-9007199254740992, 9007199254740992]"), ("uint8", 256.0, "[0, 255]")],
)
def test_whole_numbers_beyond_the_dtype_or_exact_json_are_refused(
    dtype: str, value: float, limits: str
) -> None:
    assert refusal(layout(dtype).parse_json, body([[value, 1.0]])) == (
        f"instances contain integers outside {limits}, the range of {dtype} that JSON numbers "
        "hold exactly"
    )


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([[1.5]], "instances must contain only integers (int64); got fractional numbers"),
        ([["a"]], "instances must contain only integers (int64); got strings"),
        ([[True, False]], "instances must contain only integers (int64); got booleans"),
    ],
)
def test_integer_inputs_refuse_other_values(instances: object, message: str) -> None:
    assert refusal(layout("int64", (-1, -1)).parse_json, body(instances)) == message


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([[1, 2, 3]], "expected instances of shape (N, 2), got (1, 3)"),
        (
            [[1, 2], [3]],
            "instances must be nested lists of numbers shaped (N, 2); got lists of uneven lengths",
        ),
        ([1, 2], "expected instances of shape (N, 2), got (2)"),
        ([[]], "expected instances of shape (N, 2), got (1, 0)"),
        ([], "'instances' is empty; send at least one instance"),
        ([["a", 1]], "instances must contain only numbers (float32); got strings"),
        (
            [[None, 1]],
            "instances must contain only numbers (float32); got mixed values, nulls or objects",
        ),
        ([[True, False]], "instances must contain only numbers (float32); got booleans"),
        ([[True, 1]], "instances must contain only numbers (float32); got booleans"),
        ([[1, False]], "instances must contain only numbers (float32); got booleans"),
    ],
)
def test_json_instances_are_refused_with_what_was_expected(instances: object, message: str) -> None:
    assert refusal(PAIRS.parse_json, body(instances)) == message


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b"[1, 2]", 'the body must be a JSON object {"instances": [...]}, got a list'),
        (b'"abc"', 'the body must be a JSON object {"instances": [...]}, got a string'),
        (b"1.5", 'the body must be a JSON object {"instances": [...]}, got a number'),
        (b"true", 'the body must be a JSON object {"instances": [...]}, got a boolean'),
        (b"null", 'the body must be a JSON object {"instances": [...]}, got null'),
        (b"{}", "missing field 'instances' (a list of instances)"),
        (b'{"instances": {"a": 1}}', "'instances' must be a list, got an object"),
        (b'{"instances": 3}', "'instances' must be a list, got a number"),
        (
            b'{"instances": [[1, 2]], "b": 1, "a": 2}',
            "unknown field(s) ['a', 'b']; the body takes only 'instances'",
        ),
    ],
)
def test_a_body_of_another_form_is_refused(document: bytes, message: str) -> None:
    assert refusal(PAIRS.parse_json, document) == message


def test_a_body_that_is_not_json_is_400() -> None:
    assert bad_request(PAIRS.parse_json, b'{"instances": [').startswith(
        "the body is not valid JSON: "
    )


def test_at_most_max_instances_per_request() -> None:
    default = layout()
    assert default.parse_json(body([[0, 0]] * 1024)).shape == (1024, 2)
    assert refusal(default.parse_json, body([[0, 0]] * 1025)) == (
        "1025 instances in one request; at most 1024 are accepted"
    )
    three = TensorLayout(PAIRS.spec, max_instances=3)
    assert three.parse_json(body([[0, 0]] * 3)).shape == (3, 2)
    assert refusal(three.parse_json, body([[0, 0]] * 4)) == (
        "4 instances in one request; at most 3 are accepted"
    )
    assert refusal(three.parse_npy, npy(np.zeros((4, 2), np.float32))) == (
        "4 instances in one request; at most 3 are accepted"
    )


# --------------------------------------------------------------------------- value ranges


def test_values_must_lie_in_the_range_inclusive() -> None:
    pixels = layout(min_value=0, max_value=1)
    same(pixels.parse_json(body([[0, 1], [0.5, 1]])), np.array([[0, 1], [0.5, 1]], "f4"))
    assert refusal(pixels.parse_json, body([[0.5, 1.25]])) == (
        "values must lie in [0, 1] (or be the padding value 0), got 1.25"
    )
    assert refusal(pixels.parse_json, body([[-0.5, 0.5]])) == (
        "values must lie in [0, 1] (or be the padding value 0), got -0.5"
    )
    # The first value outside, in row order.
    assert refusal(pixels.parse_json, body([[0.5, 3], [-2, 0]])).endswith("got 3")


def test_a_range_open_on_one_side() -> None:
    at_least_one = layout(min_value=1, pad_value=-1)
    same(at_least_one.parse_json(body([[1, 1e30]])), np.array([[1, 1e30]], "f4"))
    assert refusal(at_least_one.parse_json, body([[0.5, 2]])) == (
        "values must lie in [1, inf] (or be the padding value -1), got 0.5"
    )
    at_most_one = layout(max_value=1)
    same(at_most_one.parse_json(body([[-1e30, 1]])), np.array([[-1e30, 1]], "f4"))
    assert refusal(at_most_one.parse_json, body([[0, 1.5]])) == (
        "values must lie in [-inf, 1] (or be the padding value 0), got 1.5"
    )


def test_the_padding_value_is_accepted_outside_the_range() -> None:
    same(TOKENS.parse_json(body([[0, 9, 1]])), np.array([[0, 9, 1]]))
    assert refusal(TOKENS.parse_json, body([[10]])) == (
        "values must lie in [1, 9] (or be the padding value 0), got 10"
    )


# --------------------------------------------------------------------------- variable length


def test_variable_length_instances_are_padded_to_the_longest() -> None:
    same(
        TOKENS.parse_json(body([[1, 2], [3], [4, 5, 6]])),
        np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]]),
    )
    same(
        VECTORS.parse_json(body([[[1, 2]], [[3, 4], [5, 6]]])),
        np.array([[[1, 2], [-1, -1]], [[3, 4], [5, 6]]], dtype=np.float32),
    )
    middle = layout(shape=(-1, 2, -1), pad_value=7)
    same(
        middle.parse_json(body([[[1], [2]], [[3, 4], [5, 6]]])),
        np.array([[[1, 7], [2, 7]], [[3, 4], [5, 6]]], dtype=np.float32),
    )


def test_one_token_is_enough_and_max_length_is_the_limit() -> None:
    same(TOKENS.parse_json(body([[5]])), np.array([[5]]))
    same(TOKENS.parse_json(body([[5]] * 6)), np.full((6, 1), 5))  # more instances than tokens
    same(TOKENS.parse_json(body([[1, 2, 3, 4]])), np.array([[1, 2, 3, 4]]))
    assert refusal(TOKENS.parse_json, body([[1, 2, 3, 4, 5]])) == (
        "instances must be 1 to 4 long on their variable axis, got 5"
    )


def test_without_max_length_the_largest_bucket_is_the_limit() -> None:
    same(VECTORS.parse_json(body([[[0, 0]] * 8])), np.zeros((1, 8, 2), np.float32))
    assert refusal(VECTORS.parse_json, body([[[0, 0]] * 9])) == (
        "instances must be 1 to 8 long on their variable axis, got 9"
    )
    capped = TensorLayout(VECTORS.spec.model_copy(update={"max_length": 3}), length_edges=(2, 4))
    assert refusal(capped.parse_json, body([[[0, 0]] * 4])) == (
        "instances must be 1 to 3 long on their variable axis, got 4"
    )


def test_without_max_length_or_buckets_any_length_is_accepted() -> None:
    unbounded = layout("int64", (-1, -1))
    same(unbounded.parse_json(body([list(range(100))])), np.arange(100)[np.newaxis])
    same(unbounded.parse_npy(npy(np.arange(5))), np.arange(5)[np.newaxis])


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        (
            [[1, 2], []],
            "instance 1 is empty; every instance needs at least one element on its variable axis",
        ),
        (
            [[]],
            "instance 0 is empty; every instance needs at least one element on its variable axis",
        ),
        (
            [[[1, 2]]],
            "expected instances of shape (N, L); got an instance with 2 dimension(s) instead of 1",
        ),
        (
            [7],
            "expected instances of shape (N, L); got an instance with 0 dimension(s) instead of 1",
        ),
        ([[1.5]], "instances must contain only integers (int64); got fractional numbers"),
        ([[1], [True]], "instances must contain only integers (int64); got booleans"),
    ],
)
def test_variable_length_instances_are_refused_with_what_was_expected(
    instances: object, message: str
) -> None:
    assert refusal(TOKENS.parse_json, body(instances)) == message


def test_instances_differing_outside_the_variable_axis_are_refused() -> None:
    assert refusal(VECTORS.parse_json, body([[[1, 2]], [[1, 2, 3]]])) == (
        "expected instances of shape (N, L, 2)"
    )
    assert refusal(VECTORS.parse_json, body([[[1, 2, 3]]])) == (
        "expected instances of shape (N, L, 2), got (1, 1, 3)"
    )


def test_the_length_checked_is_the_variable_axis() -> None:
    """Not the batch axis, nor a fixed one."""
    too_long = np.zeros((1, 9, 2), dtype=np.float32)
    assert refusal(VECTORS.parse_npy, npy(too_long)).endswith("got 9")
    wide = layout(shape=(-1, -1, 16), max_length=4)
    same(wide.parse_npy(npy(np.zeros((8, 4, 16), "f4"))), np.zeros((8, 4, 16), "f4"))


def test_group_and_cost_follow_the_length_bucket() -> None:
    def grouped(layout: TensorLayout, array: np.ndarray) -> tuple[tuple[int, ...], int]:
        return group_and_cost(array.shape[1:], layout.spec.variable_axis, layout.length_edges)

    assert grouped(TOKENS, np.zeros((5, 3), np.int64)) == ((3,), 0)  # no buckets
    assert grouped(VECTORS, np.zeros((5, 3, 2), np.float32)) == ((4, 2), 8)
    assert grouped(PAIRS, np.zeros((5, 2), np.float32)) == ((2,), 0)


# --------------------------------------------------------------------------- .npy bodies


def test_npy_bodies_of_one_instance_or_a_batch() -> None:
    batch = np.array([[1.5, -2]], dtype=np.float32)
    same(PAIRS.parse_npy(npy(batch)), batch)
    same(PAIRS.parse_npy(npy(batch[0])), batch)  # one instance, no batch axis
    same(TOKENS.parse_npy(npy(np.array([[1, 2, 3]]))), np.array([[1, 2, 3]]))


def test_npy_in_another_byte_order_or_layout_is_read_natively() -> None:
    values = np.array([[1.5, -2], [3, 4]], dtype=np.float32)
    same(PAIRS.parse_npy(npy(values.astype(">f4"))), values)
    same(TOKENS.parse_npy(npy(np.array([[1, 2]], dtype=">i8"))), np.array([[1, 2]]))
    parsed = PAIRS.parse_npy(npy(np.asfortranarray(values)))
    same(parsed, values)
    assert parsed.flags.c_contiguous


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((1, 2), np.float64), "expected dtype float32, got float64"),
        (np.zeros((1, 2), ">f8"), "expected dtype float32, got float64"),
        (np.zeros((1, 2), np.int32), "expected dtype float32, got int32"),
        (np.zeros((1, 2), np.float16), "expected dtype float32, got float16"),
        (np.zeros((0, 2), np.float32), "'instances' is empty; send at least one instance"),
        (np.zeros((1, 3), np.float32), "expected instances of shape (N, 2), got (1, 3)"),
        (np.zeros((1, 1, 2), np.float32), "expected instances of shape (N, 2), got (1, 1, 2)"),
        (
            np.array([[np.nan, 0]], np.float32),
            "instances contain values that are not finite in float32 (NaN, infinity, or beyond "
            "its range)",
        ),
        (
            np.array([[0, -np.inf]], np.float32),
            "instances contain values that are not finite in float32 (NaN, infinity, or beyond "
            "its range)",
        ),
    ],
)
def test_npy_bodies_are_validated_like_json(array: Array, message: str) -> None:
    assert refusal(PAIRS.parse_npy, npy(array)) == message


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((1, 2), np.int32), "expected dtype int64, got int32"),
        (np.zeros((1, 0), np.int64), "instances must be 1 to 4 long on their variable axis, got 0"),
        (np.array([[1, 11]]), "values must lie in [1, 9] (or be the padding value 0), got 11"),
    ],
)
def test_npy_token_bodies_are_validated(array: Array, message: str) -> None:
    assert refusal(TOKENS.parse_npy, npy(array)) == message


def test_npy_format_version_2_is_read_and_its_size_checked() -> None:
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    same(PAIRS.parse_npy(npy_version(values, (2, 0))), values)
    assert bad_request(PAIRS.parse_npy, npy_version(values, (2, 0))[:-4]) == (
        "the body is not a valid .npy array: the header declares shape (3, 2) of float32 "
        "(24 bytes), but only 20 bytes of data follow"
    )
    assert bad_request(PAIRS.parse_npy, npy_version(values, (3, 0))) == (
        "the body is not a valid .npy array: unsupported .npy format version 3.0"
    )


def test_a_header_claiming_more_data_than_the_body_holds_is_refused_before_allocating() -> None:
    body = npy(np.arange(6, dtype=np.float32).reshape(3, 2))
    assert bad_request(PAIRS.parse_npy, body[:-4]) == (
        "the body is not a valid .npy array: the header declares shape (3, 2) of float32 "
        "(24 bytes), but only 20 bytes of data follow"
    )
    header = io.BytesIO()
    npy_format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 2)}
    )
    assert bad_request(PAIRS.parse_npy, header.getvalue() + bytes(24)) == (
        "the body is not a valid .npy array: the header declares shape (1000000000000, 2) of "
        "float32 (8000000000000 bytes), but only 24 bytes of data follow"
    )


def test_object_arrays_are_refused_without_unpickling() -> None:
    objects = np.array([{"a": 1}, None], dtype=object)
    assert bad_request(PAIRS.parse_npy, npy(objects, allow_pickle=True)) == (
        "the body is not a valid .npy array: Object arrays cannot be loaded when allow_pickle=False"
    )


@pytest.mark.parametrize("body", [b"PK\x03\x04rest of an npz", b"PK\x05\x06" + bytes(18)])
def test_npz_archives_are_refused(body: bytes) -> None:
    assert bad_request(PAIRS.parse_npy, body) == (
        "the body must be one .npy array, not an .npz archive"
    )


@pytest.mark.parametrize("body", [b"", b"garbage", b"\x93NUMPY\x01\x00garbage"])
def test_other_bodies_are_not_npy(body: bytes) -> None:
    assert bad_request(PAIRS.parse_npy, body).startswith("the body is not a valid .npy array: ")


# --------------------------------------------------------------------------- named inputs


def manifest_of(*inputs: TensorSpec) -> Manifest:
    return Manifest.create(
        name="m",
        format="torchscript",
        artifact="model.torchscript.pt",
        files={"model.torchscript.pt": "0" * 64},
        inputs=inputs,
        outputs=(TensorSpec(name="y", dtype="float32", shape=(-1, 2)),),
        created_at=datetime.now(UTC),
    )


IDS = TensorSpec(
    name="ids", dtype="int64", shape=(-1, -1), max_length=6, min_value=1, max_value=9, pad_value=0
)
MASK = TensorSpec(name="mask", dtype="bool", shape=(-1, -1), max_length=6)
SCALE = TensorSpec(name="scale", dtype="uint8", shape=(-1,))
PAIR = InputLayout(manifest_of(IDS, MASK, SCALE), length_edges=(2, 6))


def npz(**arrays: Array) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_named_instances_become_one_padded_array_per_input() -> None:
    parsed = PAIR.parse_json(
        body(
            [
                {"ids": [3, 4, 5], "mask": [True, True, False], "scale": 7},
                {"scale": 255, "ids": [9], "mask": [True]},
            ]
        )
    )
    assert parsed.names == ("ids", "mask", "scale")
    same(parsed["ids"], np.array([[3, 4, 5], [9, 0, 0]], dtype=np.int64))
    same(parsed["mask"], np.array([[True, True, False], [True, False, False]]))
    same(parsed["scale"], np.array([7, 255], dtype=np.uint8))
    assert batch_group(PAIR.manifest, parsed, PAIR.length_edges) == ((6,), 6)
    assert PAIR.parse(body([{"ids": [1], "mask": [True], "scale": 0}]), JSON_MEDIA_TYPE)[
        "ids"
    ].shape == (1, 1)


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        (
            [{"ids": [3, 4], "mask": [True], "scale": 1}],
            "instance 0: inputs with a variable axis must be equally long, got lengths "
            "{'ids': 2, 'mask': 1}",
        ),
        (
            [{"ids": [3], "mask": [True]}],
            "instance 0 must have exactly the inputs ['ids', 'mask', 'scale']; missing ['scale']",
        ),
        (
            [{"ids": [3], "mask": [True], "scale": 1, "extra": 2}],
            "instance 0 must have exactly the inputs ['ids', 'mask', 'scale']; unknown ['extra']",
        ),
        (
            [[3]],
            "instance 0 must be an object keyed by input name ['ids', 'mask', 'scale'], got a list",
        ),
        ([], "'instances' is empty; send at least one instance"),
        (
            [{"ids": [3], "mask": [True], "scale": 256}],
            "instances contain integers outside the range of uint8",
        ),
        (
            [{"ids": [3], "mask": [True], "scale": -1}],
            "instances contain integers outside the range of uint8",
        ),
        (
            [{"ids": [3], "mask": [1], "scale": 1}],
            "instances must contain only true or false (bool); got int64",
        ),
        (
            [{"ids": [3, 4, 5, 6, 7, 8, 9], "mask": [True] * 7, "scale": 1}],
            "instances must be 1 to 6 long on their variable axis, got 7",
        ),
    ],
)
def test_named_instances_are_refused_naming_the_problem(instances: object, message: str) -> None:
    assert refusal(PAIR.parse_json, body(instances)) == message


def test_an_npz_body_carries_one_array_per_input() -> None:
    ids = np.array([[1, 2], [3, 0]], dtype=np.int64)
    mask = np.array([[True, True], [True, False]])
    scale = np.array([1, 2], dtype=np.uint8)
    parsed = PAIR.parse(npz(ids=ids, mask=mask, scale=scale), NPZ_MEDIA_TYPE)
    same(parsed["ids"], ids)
    same(parsed["mask"], mask)
    same(parsed["scale"], scale)

    assert refusal(PAIR.parse_npz, npz(ids=ids, mask=mask)) == (
        "the .npz archive must hold exactly the arrays ['ids', 'mask', 'scale'], "
        "got ['ids', 'mask']"
    )
    assert refusal(PAIR.parse_npz, npz(ids=ids, mask=mask, scale=scale[:1])) == (
        "every input needs one row per instance, got {'ids': 2, 'mask': 2, 'scale': 1}"
    )
    assert refusal(PAIR.parse_npz, npz(ids=ids.astype(np.int32), mask=mask, scale=scale)) == (
        "input 'ids': expected dtype int64, got int32"
    )
    assert refusal(PAIR.parse_npz, npz(ids=ids, mask=mask[:, :1], scale=scale)) == (
        "inputs with a variable axis must be equally long, got lengths {'ids': 2, 'mask': 1}"
    )
    assert bad_request(PAIR.parse_npz, b"PK\x03\x04 torn").startswith(
        "the body is not a valid .npz archive"
    )
    assert "this model takes 3 inputs" in refusal(PAIR.parse, npy(ids), NPY_MEDIA_TYPE)


def test_answers_encode_as_npz_one_member_per_name_and_never_as_pickles() -> None:
    logits, label = np.array([[0.5, -1]], np.float32), np.array([1])
    with np.load(io.BytesIO(encode_npz(NamedArrays.of(logits=logits, label=label)))) as loaded:
        same(loaded["logits"], logits)
        same(loaded["label"], label)
    with pytest.raises(ValueError, match="allow_pickle=False"):
        encode_npz(NamedArrays.of(x=np.array([{"a": 1}], dtype=object)))


def test_npz_members_are_read_up_to_their_limit_exactly() -> None:
    archive = npz(ids=np.ones((1, 2), np.int64), mask=np.ones((1, 2), bool))
    members = npz_members(archive, 1 << 20)
    size = sum(len(member) for member in members.values())
    assert npz_members(archive, size) == members
    with pytest.raises(PayloadTooLargeError):
        npz_members(archive, size - 1)
    foldered = io.BytesIO()
    with zipfile.ZipFile(foldered, "w") as zipped:
        zipped.writestr("inner/ids.npy", members["ids"])
    assert bad_request(PAIR.parse_npz, foldered.getvalue()) == (
        "an .npz archive holds only .npy members, got 'inner/ids.npy'"
    )


def test_an_npz_archive_holding_other_members_or_inflating_too_far_is_refused() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ids.npy", npy(np.ones((1, 2), np.int64)))
        archive.writestr("../evil.txt", b"x")
    assert bad_request(PAIR.parse_npz, buffer.getvalue()) == (
        "an .npz archive holds only .npy members, got '../evil.txt'"
    )
    bomb = io.BytesIO()
    np.savez_compressed(
        bomb,
        ids=np.ones((1, 2), np.int64),
        mask=np.ones((1, 2), bool),
        scale=np.zeros(4_000_000, np.uint8),
    )
    with pytest.raises(PayloadTooLargeError):
        PAIR.parse_npz(bomb.getvalue())


def test_named_instances_of_fixed_shape_and_each_instances_own_length() -> None:
    pair = TensorSpec(name="pair", dtype="float32", shape=(-1, 2))
    fixed = InputLayout(manifest_of(pair, SCALE)).parse_json(
        body([{"pair": [1, 2], "scale": 3}, {"pair": [4, 5], "scale": 6}])
    )
    same(fixed["pair"], np.array([[1, 2], [4, 5]], "f4"))
    same(fixed["scale"], np.array([3, 6], np.uint8))
    # Instances of 3 and 1 ids keep their own lengths: per-token outputs answer each at it.
    padded = PAIR.parse_json(
        body(
            [
                {"ids": [3, 4, 5], "mask": [True] * 3, "scale": 1},
                {"ids": [9], "mask": [True], "scale": 2},
            ]
        )
    )
    assert isinstance(padded, PaddedInstances)
    assert padded.lengths.tolist() == [3, 1]


def test_every_instance_gives_the_same_optional_inputs() -> None:
    types = TensorSpec(name="types", dtype="int64", shape=(-1, -1), max_length=6, default_value=0)
    optional = InputLayout(manifest_of(IDS, types))
    assert refusal(optional.parse_json, body([{"ids": [1]}, {"ids": [1], "types": [0]}])) == (
        "every instance must give the same inputs: instance 0 gives ['ids'], instance 1 "
        "['ids', 'types']"
    )
    assert refusal(optional.parse_json, body([{"ids": [1], "types": [0]}, {"ids": [1]}])) == (
        "every instance must give the same inputs: instance 0 gives ['ids', 'types'], "
        "instance 1 ['ids']"
    )


def test_each_instance_keeps_its_own_length_on_a_deeper_variable_axis() -> None:
    deeper = TensorSpec(name="v", dtype="float32", shape=(-1, 2, -1))
    single = InputLayout(manifest_of(deeper))
    for instances in (
        [[[1], [2]], [[3, 4], [5, 6]]],
        [{"v": [[1], [2]]}, {"v": [[3, 4], [5, 6]]}],
    ):
        padded = single.parse_json(body(instances))
        assert isinstance(padded, PaddedInstances)
        assert padded.lengths.tolist() == [1, 2]


def test_a_handlers_arrays_are_checked_like_a_request() -> None:
    ids = np.array([[1, 2]], dtype=np.int64)
    mask = np.array([[True, True]])
    scale = np.array([3], dtype=np.uint8)
    checked = PAIR.check({"ids": ids, "mask": mask, "scale": scale})
    same(checked["ids"], ids)
    assert refusal(PAIR.check, {"ids": ids, "mask": mask}) == (
        "the handler built inputs ['ids', 'mask']; the model takes ['ids', 'mask', 'scale']"
    )
    assert refusal(PAIR.check, {"ids": ids.astype(np.int32), "mask": mask, "scale": scale}) == (
        "input 'ids' must be int64, got int32"
    )
    assert refusal(PAIR.check, {"ids": ids * 10, "mask": mask, "scale": scale}) == (
        "values must lie in [1, 9] (or be the padding value 0), got 10"
    )
    assert refusal(PAIR.check, {"ids": ids, "mask": mask, "scale": np.zeros(2, np.uint8)}) == (
        "every input needs one row per instance, got {'ids': 1, 'mask': 1, 'scale': 2}"
    )


def test_a_one_input_model_takes_an_object_keyed_by_its_name_too() -> None:
    layout_ = InputLayout(manifest_of(IDS))
    same(
        layout_.parse_json(body([{"ids": [1, 2]}, {"ids": [3]}]))["ids"],
        np.array([[1, 2], [3, 0]], dtype=np.int64),
    )
    same(layout_.parse_json(body([[1, 2]]))["ids"], np.array([[1, 2]], dtype=np.int64))


def test_a_one_input_float_model_reads_plain_bodies_and_refuses_the_rest() -> None:
    """A plain body takes the fast path (``numeric_json``), any other the general one."""
    pairs = InputLayout(manifest_of(PAIRS.spec))
    same(pairs.parse_json(body([[1, 2.5]]))["pairs"], np.array([[1, 2.5]], "f4"))
    assert refusal(pairs.parse_json, body([[True, 1]])) == (
        "instances must contain only numbers (float32); got booleans"
    )
    assert refusal(InputLayout(manifest_of(IDS)).parse_json, body([[1]] * 1025)) == (
        "1025 instances in one request; at most 1024 are accepted"
    )


def test_only_float32_and_float64_inputs_of_fixed_shape_take_the_fast_path() -> None:
    """``tests/test_numeric_json.py`` holds the fast path to the general path's answers."""
    plain = body([[1, 2]])
    assert PAIRS.parse_plain_json(plain) is not None
    assert layout("float64").parse_plain_json(plain) is not None
    for other in (layout("float16"), layout("int64"), layout(shape=(-1, -1))):
        assert other.parse_plain_json(plain) is None
    # A range the dtype holds exactly is checked on the values read; another after the cast.
    assert layout(min_value=0, max_value=1).plain_range == (0, 1)
    assert layout(min_value=0.1, max_value=1).plain_range is None
    assert refusal(layout(min_value=0.1, max_value=1).parse_json, body([[0.5, 2]])).endswith(
        "got 2"
    )


def test_bfloat16_inputs_travel_as_float32() -> None:
    layout_ = InputLayout(manifest_of(TensorSpec(name="x", dtype="bfloat16", shape=(-1, 2))))
    same(layout_.parse_json(body([[0.5, 1]]))["x"], np.array([[0.5, 1]], dtype=np.float32))


@pytest.mark.parametrize(
    ("accept", "answer"),
    [
        (None, JSON_MEDIA_TYPE),
        ("application/x-npz", NPZ_MEDIA_TYPE),
        ("application/x-npy", NPY_MEDIA_TYPE),
        ("application/octet-stream", NPY_MEDIA_TYPE),
        ("application/json, application/x-npz", JSON_MEDIA_TYPE),
        ("application/json;q=0.5, application/x-npz", NPZ_MEDIA_TYPE),
        ("application/x-npz;q=0, application/x-npy;q=0.1", NPY_MEDIA_TYPE),
        ("text/html", JSON_MEDIA_TYPE),
    ],
)
def test_the_answer_type_is_the_most_wanted_of_json_npy_and_npz(
    accept: str | None, answer: str
) -> None:
    assert answer_media_type(accept) == answer


def test_every_variable_input_of_an_instance_is_as_long_as_the_others() -> None:
    # Three inputs sharing the length; the request's longest is 3 for each, so only the
    # instance-by-instance check sees that instance 1 has 2 ids but 3 type ids.
    types = TensorSpec(name="types", dtype="int64", shape=(-1, -1), max_length=6)
    three = InputLayout(manifest_of(IDS, MASK, types))
    instances = [
        {"ids": [1, 2, 3], "mask": [True] * 3, "types": [0, 0, 0]},
        {"ids": [1, 2], "mask": [True] * 2, "types": [0, 0, 1]},
    ]
    assert refusal(three.parse_json, body(instances)) == (
        "instance 1: inputs with a variable axis must be equally long, got lengths "
        "{'ids': 2, 'mask': 2, 'types': 3}"
    )
    # A value that is not a list at all is the tensor's own shape error.
    assert refusal(three.parse_json, body([{"ids": 5, "mask": [True], "types": [0]}])).startswith(
        "expected instances of shape (N, L)"
    )


def test_the_variable_axis_of_a_deeper_input_is_its_length() -> None:
    vectors = TensorSpec(name="v", dtype="float32", shape=(-1, -1, 2), max_length=6)
    mixed = InputLayout(manifest_of(IDS, vectors))
    parsed = mixed.parse_npz(npz(ids=np.ones((1, 3), np.int64), v=np.zeros((1, 3, 2), np.float32)))
    assert parsed["v"].shape == (1, 3, 2)
    assert (
        refusal(
            mixed.parse_npz, npz(ids=np.ones((1, 3), np.int64), v=np.zeros((1, 2, 2), np.float32))
        )
        == "inputs with a variable axis must be equally long, got lengths {'ids': 3, 'v': 2}"
    )


def test_a_one_input_model_reads_npy_and_npz_alike() -> None:
    single = InputLayout(manifest_of(IDS))
    ids = np.array([[1, 2]], dtype=np.int64)
    same(single.parse(npy(ids), NPY_MEDIA_TYPE)["ids"], ids)
    same(single.parse(npz(ids=ids), NPZ_MEDIA_TYPE)["ids"], ids)


def test_a_large_stored_npz_within_the_body_limit_is_read() -> None:
    """Members stored (not compressed) inflate to about the body's size: a few MiB pass; only
    archives inflating beyond 64 times their size are refused."""
    scale = np.zeros(3 << 20, np.uint8)
    ids = np.ones((3 << 20, 1), np.int64)
    wide = InputLayout(manifest_of(IDS, MASK, SCALE), max_instances=4 << 20)
    parsed = wide.parse_npz(npz(ids=ids, mask=np.ones((3 << 20, 1), bool), scale=scale))
    assert len(parsed) == 3 << 20
