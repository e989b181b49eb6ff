"""Length buckets: which variable-length requests may share a batch, and their token cost.

Instances are grouped by the smallest bucket edge that holds their length, so a batch is only
padded up to its bucket, never to the longest sequence in the whole queue. Attention costs grow
with the square of the padded length, so mixing an 8-token and a 512-token request in one batch
would make the short one pay for the long one. For the same reason a request of many rows of
different lengths is sorted by length and cut where the bucket changes (``sorted_runs``):
each run joins the batches of its own bucket, trimmed to its longest row.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import NamedTuple

from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays

SMALLEST_DEFAULT_EDGE = 8
#: Longest variable length assumed when a spec gives no ``max_length`` and no buckets are set:
#: BERT's, and what most position embeddings hold (a longer one fails with "index out of range").
DEFAULT_MAX_LENGTH = 512


def length_edges(spec: TensorSpec, configured: Sequence[int]) -> tuple[int, ...]:
    """The bucket edges of ``spec``'s variable axis; none for an input of fixed shape."""
    if spec.variable_axis is None:
        return ()
    longest = spec.max_length or max(configured, default=DEFAULT_MAX_LENGTH)
    return resolve_edges(configured, longest)


def manifest_length_edges(manifest: Manifest, configured: Sequence[int]) -> tuple[int, ...]:
    """The bucket edges of the model's shared variable length; none when every input is fixed."""
    variable = manifest.variable_input
    return () if variable is None else length_edges(variable, configured)


def batch_group(
    manifest: Manifest, instances: NamedArrays, edges: Sequence[int]
) -> tuple[tuple[int, ...], int]:
    """``group_and_cost`` of a model's named inputs: decided by its variable-length input
    (every input with a variable axis shares that length), else by its first input."""
    spec = manifest.variable_input or manifest.input
    return group_and_cost(instances[spec.name].shape[1:], spec.variable_axis, edges)


def default_edges(max_length: int) -> tuple[int, ...]:
    """Powers of two from 8 below ``max_length``, then ``max_length`` itself."""
    edges = []
    edge = SMALLEST_DEFAULT_EDGE
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    edges.append(max_length)
    return tuple(edges)


def resolve_edges(configured: Sequence[int], max_length: int) -> tuple[int, ...]:
    """The configured edges (sorted, capped by ``max_length``), or the defaults when none."""
    if not configured:
        return default_edges(max_length)
    edges = sorted({min(edge, max_length) for edge in configured})
    if edges[-1] < max_length:
        edges.append(max_length)
    return tuple(edges)


def bucket_of(length: int, edges: Sequence[int]) -> int:
    """The smallest edge that is at least ``length`` (callers have checked the maximum)."""
    index = bisect.bisect_left(edges, length)
    if index == len(edges):
        raise ValueError(f"length {length} exceeds the largest bucket {edges[-1]}")
    return edges[index]


def group_and_cost(
    instance_shape: Sequence[int], variable_axis: int | None, edges: Sequence[int]
) -> tuple[tuple[int, ...], int]:
    """The batch group of instances of ``instance_shape`` (their shape, the variable axis
    rounded up to its bucket) and their cost per row (padded positions, or 0 without buckets).

    Front ends compute it for each request and engines for their warm-up batches, so that the
    warm-up's timings apply to the groups requests will be queued in."""
    shape = tuple(int(size) for size in instance_shape)
    if variable_axis is None or not edges:
        return shape, 0
    bucketed = list(shape)
    bucketed[variable_axis] = bucket_of(shape[variable_axis], edges)
    return tuple(bucketed), math.prod(bucketed)


class Run(NamedTuple):
    """Rows ``start:stop`` of a request sorted by length (``sorted_runs``), all in one bucket."""

    start: int
    stop: int
    longest: int
    """The longest row's length: the run is trimmed to it."""


def sorted_runs(lengths: Sequence[int], edges: Sequence[int]) -> tuple[list[int], list[Run]]:
    """The rows of a request in order of length (``order``: the request's row at each place;
    equal lengths keep their order), cut into runs where the bucket changes. A row of length
    0 counts as 1 (a batch holds at least one position)."""
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    own = [max(1, lengths[row]) for row in order]
    buckets = [bucket_of(length, edges) for length in own]
    runs: list[Run] = []
    start = 0
    for place in range(1, len(order) + 1):
        if place == len(order) or buckets[place] != buckets[start]:
            runs.append(Run(start, place, own[place - 1]))
            start = place
    return order, runs
