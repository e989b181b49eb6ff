"""``tuning.ceiling``'s engine: zeros of each output's shape at once, a per-token output at
its input's length, so that a token-classification handler answers the HTTP ceiling's
requests as it answers the model's (one token long, its answers failed)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from service.bridge.interface import InferenceRequest, ModelInfo
from service.manifest import Architecture, Manifest, TensorSpec
from service.server.tuning.ceiling import ZeroEngine
from service.tensors import NamedArrays


def tagger() -> ModelInfo:
    manifest = Manifest.create(
        name="tagger",
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64},
        architecture=Architecture(import_path="service.models.mlp:PeerMLP"),
        inputs=(TensorSpec(name="input_ids", dtype="int64", shape=(-1, -1), max_length=32),),
        outputs=(
            TensorSpec(name="tags", dtype="float32", shape=(-1, -1, 5), length_of="input_ids"),
            TensorSpec(name="pooled", dtype="float32", shape=(-1, 3)),
        ),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return ModelInfo(manifest, "none", "fp32", False, length_edges=(8, 32))


async def test_per_token_outputs_follow_their_inputs_length() -> None:
    model = tagger()
    request = InferenceRequest(
        model="tagger",
        version=model.manifest.version,
        instances=NamedArrays({"input_ids": np.ones((3, 11), np.int64)}),
        priority="normal",
        deadline_s=float("inf"),
        request_id="r-1",
    )
    result = await ZeroEngine(model).infer(request)
    assert result.outputs["tags"].shape == (3, 11, 5)
    assert result.outputs["pooled"].shape == (3, 3)
    assert not result.outputs["tags"].any()
    assert result.version == model.manifest.version
