"""Comparing a candidate's answer with the served version's (``service/comparison.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.comparison import (
    Disagreement,
    DisagreementLog,
    compare_answers,
    compare_row,
    output_kind,
    same_tokens,
)
from service.manifest import TensorSpec


def spec(
    name: str, dtype: str = "float32", shape: tuple[int, ...] = (-1, 3), **extra: object
) -> TensorSpec:
    return TensorSpec.model_validate({"name": name, "dtype": dtype, "shape": shape, **extra})


SCORES = spec("scores", labels=("a", "b", "c"))
TAGS = spec("tags", shape=(-1, -1, 2), labels=("O", "X"), length_of="input_ids")
IDS = spec("ids", dtype="int64", shape=(-1, -1))
EMBEDDING = spec("embedding", shape=(-1, 2, 2))


def test_each_output_is_compared_by_what_it_holds() -> None:
    assert output_kind(SCORES) == "class_scores"
    assert output_kind(TAGS) == "token_scores"
    assert output_kind(IDS) == "exact"
    assert output_kind(spec("flag", dtype="bool", shape=(-1,))) == "exact"
    assert output_kind(EMBEDDING) == "tensor"
    assert output_kind(spec("half", dtype="bfloat16")) == "tensor"


def test_class_scores_agree_on_their_argmax_whatever_the_scores() -> None:
    served = np.array([0.1, 0.7, 0.2], dtype=np.float32)
    assert compare_row(served, np.array([0.0, 0.4, 0.3]), "class_scores", 1e-4).agreed
    other = compare_row(served, np.array([0.5, 0.4, 0.1]), "class_scores", 1e-4)
    assert not other.agreed
    assert other.max_abs_diff == pytest.approx(0.4)
    assert other.token_agreement == 0.0


def test_per_token_scores_count_the_share_of_tokens_that_agree() -> None:
    served = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    candidate = served.copy()
    candidate[1] = [1.0, 0.0]
    result = compare_row(served, candidate, "token_scores", 1e-4)
    assert not result.agreed
    assert result.token_agreement == 0.75


def test_tensors_of_any_shape_agree_within_the_tolerance() -> None:
    served = np.zeros((2, 2, 2), dtype=np.float32)
    near = served + 5e-5
    assert compare_row(served, near, "tensor", 1e-4).agreed
    far = served.copy()
    far[1, 0, 1] = 0.25
    result = compare_row(served, far, "tensor", 1e-4)
    assert (result.agreed, result.max_abs_diff) == (False, 0.25)


def test_a_shape_or_nan_difference_never_agrees() -> None:
    assert compare_row(np.zeros(3), np.zeros(4), "tensor", 1e-4).max_abs_diff == math.inf
    nan = compare_row(np.zeros(3), np.array([0.0, np.nan, 0.0]), "tensor", 1e-4)
    assert (nan.agreed, nan.max_abs_diff) == (False, math.inf)


def test_integer_outputs_agree_exactly_token_by_token() -> None:
    result = compare_row(np.array([5, 6, 7, 8]), np.array([5, 6, 9, 8]), "exact", 1e-4)
    assert (result.agreed, result.token_agreement) == (False, 0.75)


def test_an_answer_disagrees_on_the_rows_where_any_output_does() -> None:
    specs = {"scores": SCORES, "embedding": EMBEDDING}
    served = {
        "scores": np.array([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=np.float32),
        "embedding": np.zeros((3, 2, 2), dtype=np.float32),
    }
    candidate = {name: array.copy() for name, array in served.items()}
    candidate["scores"][2] = [1, 0, 0]
    candidate["embedding"][0, 1, 1] = 0.5
    result = compare_answers(served, candidate, specs)
    assert result.rows == 3
    assert result.disagreeing_rows == (0, 2)
    assert result.max_abs_diff == 1.0
    assert result.first_disagreement is not None
    assert result.first_disagreement.startswith("scores row 2: class_scores")
    assert compare_answers(served, served, specs).agreed


def test_an_output_the_candidate_lacks_disagrees_on_every_row() -> None:
    served = {"scores": np.eye(3, dtype=np.float32)[:2]}
    result = compare_answers(served, {}, {"scores": SCORES})
    assert result.disagreeing_rows == (0, 1)


def test_generations_agree_only_on_the_same_token_ids() -> None:
    assert same_tokens((1, 2, 3), (1, 2, 3)).agreed
    different = same_tokens((1, 2, 3), (1, 2, 4, 5))
    assert not different.agreed
    assert different.token_agreement == 0.5
    assert same_tokens((), ()).agreed


def test_the_disagreement_log_keeps_the_last_entries_with_their_versions() -> None:
    log = DisagreementLog(capacity=3)
    for index in range(5):
        log.add(Disagreement("digits", "v1", "v2", f"r{index}", "scores row 0"))
    assert len(log) == 3
    assert [entry.request_id for entry in log.entries()] == ["r2", "r3", "r4"]
    assert log.entries()[0].to_json() == {
        "model": "digits",
        "served_version": "v1",
        "candidate_version": "v2",
        "request_id": "r2",
        "detail": "scores row 0",
    }
    with pytest.raises(ValueError, match="got 0"):
        DisagreementLog(capacity=0)
