"""A model's traffic split: weights over its loaded versions, and the version a request gets.

The weights are whole percents summing to 100 (0: loaded, answering only requests that name
it). A request picks its version by a bucket in ``0..BUCKETS-1`` laid against the cumulative
weights: with a routing key the bucket is a hash of the model's name and the key, so one key
always meets one version while the weights stand; without one it is drawn at random, once per
request. Everything here is a pure function, shared by the engines (which hold the weights)
and the front ends (which choose).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from service.errors import InvalidInputError

#: The buckets a request falls into: a weight of 1 % covers 100 of them.
BUCKETS = 10_000
_BUCKETS_PER_POINT = BUCKETS // 100


def checked_weights(weights: Mapping[str, object]) -> dict[str, int]:
    """``weights`` as a split, or 422 quoting what is wrong: at least one version, each weight
    a whole number from 0 to 100, the sum 100."""
    if not weights:
        raise InvalidInputError('weights name no version; give at least one, e.g. {"<v>": 100}')
    split: dict[str, int] = {}
    for version, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
            raise InvalidInputError(
                f"the weight of version {version!r} is a whole number from 0 to 100, got {weight!r}"
            )
        split[version] = weight
    total = sum(split.values())
    if total != 100:
        raise InvalidInputError(f"the weights sum to 100, got {total} ({split})")
    return split


def bucket_of(model: str, routing_key: str) -> int:
    """The bucket of every request to ``model`` with ``routing_key``: the same on every front
    end and after any restart (blake2b, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{model}\0{routing_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def version_for(weights: Mapping[str, int], bucket: int) -> str:
    """The version whose share of ``0..BUCKETS-1`` holds ``bucket``, the shares laid out by
    version id (so the same weights give every bucket the same version, whatever order they
    came in). A version of weight 0 is never chosen."""
    edge = 0
    last = ""
    for version, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        edge += weight * _BUCKETS_PER_POINT
        last = version
        if bucket < edge:
            return version
    if not last:
        raise ValueError(f"no version has any weight: {dict(weights)}")
    return last


def primary_of(weights: Mapping[str, int], current: str | None = None) -> str:
    """The version with the most weight: the one a model's plain metadata describes and a
    request falls back to. Of equal weights, ``current`` (the primary now) stays, else the
    first given."""
    return max(weights, key=lambda version: (weights[version], version == current))
