"""A batch's output rows go back to the payloads that brought them, whatever their rows."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.output_split import split_rows
from service.tensors import NamedArrays


def _payloads(rows_each: list[int]) -> list[NamedArrays]:
    return [NamedArrays.of(x=np.zeros((rows, 3), np.float32)) for rows in rows_each]


@pytest.mark.parametrize("rows_each", [[1, 1, 1, 1], [1], [2, 1, 1], [0, 2], [1, 0, 1, 2], [3]])
def test_each_payload_gets_its_own_rows_in_order(rows_each: list[int]) -> None:
    total = sum(rows_each)
    outputs = {"y": np.arange(total * 2, dtype=np.float32).reshape(total, 2)}
    split = split_rows(outputs, _payloads(rows_each), rows_each, ())
    assert [len(rows) for rows in split] == rows_each
    assert all(isinstance(rows, NamedArrays) and rows.names == ("y",) for rows in split)
    np.testing.assert_array_equal(np.concatenate([rows["y"] for rows in split]), outputs["y"])
    assert all(np.shares_memory(rows["y"], outputs["y"]) for rows in split if len(rows))


def test_a_row_each_split_reads_as_slices_of_one_row() -> None:
    outputs = {"y": np.arange(12).reshape(4, 3)}
    split = split_rows(outputs, _payloads([1] * 4), [1] * 4, ())
    for row, rows in enumerate(split):
        assert rows.names == ("y",)
        assert rows["y"].shape == (1, 3)
        np.testing.assert_array_equal(rows["y"], outputs["y"][row : row + 1])


def test_several_outputs_and_tied_lengths_are_cut_per_payload() -> None:
    payloads = [NamedArrays.of(ids=np.zeros((1, length), np.int64)) for length in (2, 4, 3)]
    outputs = {"tags": np.arange(12).reshape(3, 4), "score": np.arange(3.0)}
    split = split_rows(outputs, payloads, [1, 1, 1], (("tags", 1, "ids", 1),))
    assert [rows["tags"].shape for rows in split] == [(1, 2), (1, 4), (1, 3)]
    assert [rows["score"].tolist() for rows in split] == [[0.0], [1.0], [2.0]]
