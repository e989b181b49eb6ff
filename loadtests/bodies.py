"""Pre-generated ``/predict`` request bodies, so the inputs vary from request to request.

Every generator is seeded: the same sweep sends the same bodies. One instance per request.
"""

from __future__ import annotations

import io
import math

import numpy as np
import orjson

NPY_MEDIA_TYPE = "application/x-npy"
TOKEN_ID_RANGE = (1, 999)  # 0 is padding
IMAGE_SHAPE = (3, 224, 224)
MLP_FEATURES = 256


def _json(instance: object) -> bytes:
    return orjson.dumps({"instances": [instance]})


def digits_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """8x8 pixel intensities in [0, 1] on scikit-learn's 1/16 grid, like the real digits."""
    return [_json((rng.integers(0, 17, size=(8, 8)) / 16).tolist()) for _ in range(count)]


def mlp_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """256 standard-normal float32 features, 4 decimals (about 2 kB per body), as PEERS.md."""
    return [
        _json(rng.standard_normal(MLP_FEATURES, dtype=np.float32).round(4).tolist())
        for _ in range(count)
    ]


def token_lengths_log_uniform(
    rng: np.random.Generator, count: int, low: int = 8, high: int = 512
) -> list[int]:
    """Lengths drawn log-uniformly from ``low`` to ``high`` inclusive (mean about 121 for 8-512)."""
    logs = rng.uniform(math.log(low), math.log(high + 1), size=count)
    return [min(high, max(low, int(math.exp(value)))) for value in logs]


def token_bodies(rng: np.random.Generator, lengths: list[int]) -> list[bytes]:
    """One JSON list of token ids in 1..999 per body, of the given lengths."""
    low, high = TOKEN_ID_RANGE
    return [_json(rng.integers(low, high + 1, size=length).tolist()) for length in lengths]


def image_array(rng: np.random.Generator) -> np.ndarray:
    return rng.random(IMAGE_SHAPE, dtype=np.float32)


def image_json_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """A 3x224x224 float32 image as nested JSON lists (4 decimals: about 1 MB per body)."""
    return [_json(image_array(rng).round(4).tolist()) for _ in range(count)]


def image_npy_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """``np.save`` bytes of a (1, 3, 224, 224) float32 array (about 600 kB per body)."""
    bodies = []
    for _ in range(count):
        buffer = io.BytesIO()
        np.save(buffer, image_array(rng)[np.newaxis], allow_pickle=False)
        bodies.append(buffer.getvalue())
    return bodies
