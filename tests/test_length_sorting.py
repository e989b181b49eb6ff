"""A request of rows of several lengths, queued sorted by length: a part per length bucket,
each trimmed to its longest row, and its answers put back in the request's own order. Pure
functions of the rows and the bucket edges, tested without a model or a clock."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.buckets import Run, sorted_runs
from service.engine.state import ServedModel
from service.manifest import TensorSpec
from service.tensors import NamedArrays
from tests.test_requests import tokens_model

EDGES = (8, 16, 32, 64)


def test_rows_are_sorted_by_length_and_cut_where_the_bucket_changes() -> None:
    order, runs = sorted_runs([5, 40, 3, 12, 3, 60, 7, 0], EDGES)
    assert order == [7, 2, 4, 0, 6, 3, 1, 5]  # equal lengths keep their order
    assert runs == [Run(0, 5, 7), Run(5, 6, 12), Run(6, 8, 60)]
    assert sorted_runs([9, 16, 10], EDGES) == ([0, 2, 1], [Run(0, 3, 16)])
    assert sorted_runs([], EDGES) == ([], [])


def served(**changes: Any) -> ServedModel:
    """The ``tokens`` model (ids of variable length padded with 0, two outputs a row) with
    buckets 8 and 16; only what ``queued`` reads is real."""
    manifest = tokens_model().manifest
    if changes:
        manifest = manifest.model_copy(update=changes)
    return ServedModel(manifest, (8, 16), None, None, 0)  # type: ignore[arg-type]


def padded(rows: list[list[int]]) -> NamedArrays:
    longest = max(map(len, rows))
    return NamedArrays({"ids": np.array([row + [0] * (longest - len(row)) for row in rows])})


def sums(part: NamedArrays) -> NamedArrays:
    """A model whose output row is its ids' sum and count: what a padded row would change."""
    ids = part["ids"]
    return NamedArrays({"out": np.stack([ids.sum(axis=1), ids.shape[1] + 0 * ids[:, 0]], 1)})


def test_a_request_is_queued_as_a_part_per_bucket_and_answered_in_its_order() -> None:
    rows = [[1] * 12, [2] * 3, [3] * 14, [4] * 5, [5] * 2]
    queued = served().queued(padded(rows))
    parts = [(queued.payload, queued.group, queued.cost_per_row), *queued.more]
    assert [(tuple(p[1]), p[2]) for p in parts] == [((8,), 8), ((16,), 16)]
    assert [p[0]["ids"].shape for p in parts] == [(3, 5), (2, 14)]  # trimmed to its longest
    assert parts[0][0]["ids"][:, 0].tolist() == [5, 2, 4]
    answered = NamedArrays.concatenate([sums(p[0]) for p in parts], queued.order)
    assert answered["out"][:, 0].tolist() == [sum(row) for row in rows]


def test_what_is_not_sorted_is_queued_whole() -> None:
    """One row; rows of one bucket; a model with an output that follows the input's length
    (each row's per-token output is cut to its request's length)."""
    request = padded([[1] * 12, [2] * 3])
    assert served().queued(padded([[1] * 12])).more == ()
    same_bucket = served().queued(padded([[1] * 12, [2] * 10]))
    assert same_bucket.more == ()
    assert same_bucket.order is None
    per_token = TensorSpec(name="tags", dtype="int64", shape=(-1, -1), length_of="ids")
    tagger = served(outputs=(per_token,))
    whole = tagger.queued(request)
    assert whole.more == ()
    assert whole.order is None
    assert whole.payload is request


def test_a_row_ends_after_its_last_position_that_is_not_padding() -> None:
    """Padding is the input's pad value past a row's last real position, whatever sits
    before it (a real token may equal the pad value)."""
    model = served(inputs=(replace_pad(tokens_model().manifest.inputs[0], 0),))
    request = padded([[7, 0, 7] + [0] * 9, [0, 0, 0, 7] + [0] * 8, [7] * 15])
    queued = model.queued(request)
    assert [part.payload["ids"].shape[1] for part in queued.more] == [15]
    assert queued.payload["ids"].shape == (2, 4)


def replace_pad(spec: TensorSpec, pad_value: int) -> TensorSpec:
    return spec.model_copy(update={"pad_value": pad_value, "max_length": 32})
