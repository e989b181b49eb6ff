"""Inputs with a ``default_value`` (a ``forward()`` argument with a default, such as an
attention mask) may be left out over ``/predict`` and V2: they are filled with it at the
request's shape, and with the padding value past each instance's own length."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from service.errors import BadRequestError, InvalidInputError
from service.frontend.inputs import InputLayout
from service.frontend.oip.tensors import InferInput, to_request
from service.frontend.optional_inputs import fill_defaults
from service.manifest import Manifest, TensorSpec

IDS = TensorSpec(
    name="input_ids", dtype="int64", shape=(-1, -1), max_length=16, max_value=99, pad_value=0
)
MASK = TensorSpec(
    name="attention_mask",
    dtype="int64",
    shape=(-1, -1),
    max_length=16,
    min_value=0,
    max_value=1,
    pad_value=0,
    default_value=1,
)
MANIFEST = Manifest.create(
    name="tagger",
    format="onnx",
    artifact="model.onnx",
    files={"model.onnx": "0" * 64},
    inputs=(IDS, MASK),
    outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, 2)),),
    created_at=datetime.now(UTC),
)
LAYOUT = InputLayout(MANIFEST)


def test_json_instances_leaving_out_the_mask_get_ones_then_padding() -> None:
    body = orjson.dumps({"instances": [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]})
    inputs = LAYOUT.parse(body, "application/json")
    assert inputs["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_instances_must_agree_on_which_inputs_they_give() -> None:
    body = orjson.dumps(
        {"instances": [{"input_ids": [5]}, {"input_ids": [8], "attention_mask": [1]}]}
    )
    with pytest.raises(InvalidInputError, match="every instance must give the same inputs"):
        LAYOUT.parse(body, "application/json")


def test_a_required_input_is_still_required() -> None:
    body = orjson.dumps({"instances": [{"attention_mask": [1, 1]}]})
    with pytest.raises(InvalidInputError, match=r"missing \['input_ids'\]"):
        LAYOUT.parse(body, "application/json")


def test_v2_requests_may_leave_out_the_mask_but_not_the_ids() -> None:
    ids = InferInput(name="input_ids", datatype="INT64", shape=(2, 3), data=[1, 2, 3, 4, 5, 6])
    inputs = to_request(MANIFEST, LAYOUT, [ids])
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]
    mask = InferInput(name="attention_mask", datatype="INT64", shape=(1, 2), data=[1, 1])
    with pytest.raises(BadRequestError, match=r"missing \['input_ids'\]"):
        to_request(MANIFEST, LAYOUT, [mask])


def test_a_default_outside_the_range_is_refused() -> None:
    with pytest.raises(ValidationError, match="default_value 2 is outside the accepted range"):
        TensorSpec.model_validate({**MASK.model_dump(), "default_value": 2})


def test_unset_defaults_leave_manifests_and_their_ids_as_they_were() -> None:
    assert "default_value" not in IDS.model_dump(mode="json")
    assert MASK.model_dump(mode="json")["default_value"] == 1
    assert np.isclose(MASK.default_value or 0, 1)


def test_an_optional_input_with_a_feature_axis_is_padded_along_its_variable_axis() -> None:
    positions = TensorSpec(
        name="positions", dtype="float32", shape=(-1, -1, 2), pad_value=0, default_value=0.5
    )
    ids = np.array([[5, 6, 7], [8, 0, 0]], dtype=np.int64)
    filled = fill_defaults((IDS, positions), {"input_ids": ids}, lengths=[3, 1])
    assert filled["positions"].shape == (2, 3, 2)
    assert filled["positions"][1].tolist() == [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]
    assert filled["positions"][0].tolist() == [[0.5, 0.5]] * 3
