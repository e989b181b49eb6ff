"""Per-token outputs (``length_of``): each instance answered at its own length, whatever its
batch-mates, through ``/predict`` (JSON and ``.npz``), V2 REST and gRPC; the tie declared in
the manifest, found by ``batchserve package``, and stated by OpenAPI."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton_grpc
from fastapi import FastAPI
from pydantic import ValidationError
from safetensors.torch import save_file
from torch import nn

from service.config import Settings
from service.engine.length_ties import tie_lengths
from service.engine.runner import TorchRunner
from service.frontend.bodies import NPZ_MEDIA_TYPE
from service.frontend.inputs import InputLayout
from service.frontend.per_token import PaddedInstances
from service.manifest import Manifest, TensorSpec
from service.packaging.spec import tensor_spec
from service.repository import ModelRepository
from service.server import cli
from service.server.single import create_app
from service.tensors import NamedArrays
from tests.apps import engine_of, registry_of
from tests.fixtures import lifespan, sample_total
from tests.processes import free_port, scraped, serve_with_engines, wait_until_serving
from tests.torch_models import TAG_CLASSES, TokenTagger

IDS = "input_ids:int64:-1,-1:max_length=32:min_value=1:max_value=99:pad_value=0"
TAGGER_OUTPUTS = ("logits:float32:-1,-1,5", "tags:int64:-1,-1")
LENGTHS = range(3, 15)  # 12 lengths, across two length buckets (8 and 16)


def package_tagger(folder: Path, *outputs: str) -> Manifest:
    """``batchserve package`` the ``TokenTagger`` as ``tagger`` into ``folder / "models"``."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "tagger.safetensors"
    save_file(dict(TokenTagger().state_dict()), str(weights))
    repository = folder / "models"
    arguments = [
        "package", "--repository", str(repository), "--name", "tagger",
        "--artifact", str(weights), "--format", "safetensors",
        "--architecture", "tests.torch_models:TokenTagger", "--input", IDS,
    ]  # fmt: skip
    for output in outputs:
        arguments += ["--output", output]
    assert cli.main(arguments) == 0
    return ModelRepository(repository).resolve("tagger")


def by_hand(ids: np.ndarray) -> dict[str, np.ndarray]:
    """What ``TokenTagger`` gives for ``ids`` (any shape), computed without it."""
    tags = ids % TAG_CLASSES
    logits = -np.abs(np.arange(TAG_CLASSES) - tags[..., np.newaxis]).astype(np.float32)
    return {"logits": logits, "tags": tags.astype(np.int64)}


def token_ids(rows: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 100, size=(rows, length), dtype=np.int64)


# The manifest key.


def test_length_of_names_an_input_with_a_variable_axis_from_an_output_with_one() -> None:
    ids = tensor_spec(IDS)
    fixed = TensorSpec(name="pixels", dtype="float32", shape=(-1, 4))
    tags = TensorSpec(name="tags", dtype="int64", shape=(-1, -1), length_of="input_ids")
    fields: dict[str, Any] = {
        "name": "m", "format": "torchscript", "artifact": "model.torchscript.pt",
        "files": {"model.torchscript.pt": "0" * 64}, "created_at": "2026-01-01T00:00:00Z",
    }  # fmt: skip
    Manifest.create(**fields, inputs=(ids,), outputs=(tags,))
    with pytest.raises(ValidationError, match="length_of must name an input with a variable"):
        Manifest.create(
            **fields, inputs=(ids,), outputs=(tags.model_copy(update={"length_of": "x"}),)
        )
    with pytest.raises(ValidationError, match=r"this model has none.*got 'pixels'"):
        Manifest.create(
            **fields, inputs=(fixed,), outputs=(tags.model_copy(update={"length_of": "pixels"}),)
        )
    with pytest.raises(ValidationError, match="needs a variable axis"):
        TensorSpec(name="label", dtype="int64", shape=(-1,), length_of="input_ids")
    with pytest.raises(ValidationError, match="length_of is a key of outputs"):
        Manifest.create(
            **fields, inputs=(ids.model_copy(update={"length_of": "input_ids"}),), outputs=(tags,)
        )
    # Absent, the key is not written: the manifests (and ids) of before stay as they were.
    assert "length_of" not in TensorSpec(name="t", dtype="int64", shape=(-1, -1)).model_dump()
    with_tie = Manifest.create(**fields, inputs=(ids,), outputs=(tags,))
    without = Manifest.create(
        **fields, inputs=(ids,), outputs=(tags.model_copy(update={"length_of": None}),)
    )
    assert with_tie.version != without.version


# The engine.


def test_the_runner_answers_each_payload_at_its_own_length_whatever_its_batch_mates() -> None:
    ids = tensor_spec(IDS)
    outputs = tuple(tensor_spec(text + ":length_of=input_ids") for text in TAGGER_OUTPUTS)
    runner = TorchRunner(
        TokenTagger(), inputs=(ids,), outputs=outputs, device=torch.device("cpu"),
        max_batch_size=16,
    )  # fmt: skip
    try:
        payloads = [NamedArrays.of(input_ids=token_ids(2, length, length)) for length in LENGTHS]
        together = runner.run_batch(payloads)
        for payload, answer in zip(payloads, together, strict=True):
            alone = runner.run_batch([payload])[0]
            assert isinstance(answer, NamedArrays)
            assert isinstance(alone, NamedArrays)
            expected = by_hand(payload["input_ids"])
            for name in ("logits", "tags"):
                np.testing.assert_array_equal(answer[name], alone[name])
                np.testing.assert_array_equal(answer[name], expected[name])
    finally:
        runner.close()


# Packaging.


def test_package_ties_the_outputs_whose_length_follows_the_input(tmp_path: Path) -> None:
    manifest = package_tagger(tmp_path, *TAGGER_OUTPUTS)
    assert {spec.name: spec.length_of for spec in manifest.outputs} == {
        "logits": "input_ids",
        "tags": "input_ids",
    }
    assert manifest.version_matches_content
    # Given explicitly, the same version: the key is what the detection would have written.
    explicit = package_tagger(
        tmp_path / "explicit", *(text + ":length_of=input_ids" for text in TAGGER_OUTPUTS)
    )
    assert explicit.version == manifest.version


class FirstTwoTokens(nn.Module):
    """Its output has a variable axis that does not follow the input's: always 2 long."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids[:, :2]


def test_an_output_whose_length_does_not_follow_the_input_is_left_untied() -> None:
    fields: dict[str, Any] = {
        "name": "m", "format": "torchscript", "artifact": "model.torchscript.pt",
        "files": {"model.torchscript.pt": "0" * 64}, "created_at": "2026-01-01T00:00:00Z",
        "inputs": (tensor_spec(IDS),),
    }  # fmt: skip
    untied = Manifest.create(**fields, outputs=(tensor_spec("first:int64:-1,-1"),))
    assert tie_lengths(FirstTwoTokens(), untied) is untied
    short = Manifest.create(
        **{**fields, "inputs": (tensor_spec("input_ids:int64:-1,-1:max_length=1"),)},
        outputs=(tensor_spec("tags:int64:-1,-1"),),
    )
    assert tie_lengths(TokenTagger(), short) is short  # one length tells nothing


def test_the_cli_reads_length_of_and_refuses_an_unknown_input(tmp_path: Path) -> None:
    assert tensor_spec("tags:int64:-1,-1:length_of=input_ids").length_of == "input_ids"
    weights = tmp_path / "tagger.safetensors"
    save_file(dict(TokenTagger().state_dict()), str(weights))
    status = cli.main(
        [
            "package", "--repository", str(tmp_path / "models"), "--name", "tagger",
            "--artifact", str(weights), "--format", "safetensors",
            "--architecture", "tests.torch_models:TokenTagger", "--input", IDS,
            "--output", "tags:int64:-1,-1:length_of=token_ids",
        ]
    )  # fmt: skip
    assert status == 1
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


# Served: JSON, .npz, V2 REST and gRPC, concurrently.


@pytest.fixture
async def tagger(tmp_path: Path) -> AsyncIterator[FastAPI]:
    package_tagger(tmp_path, *TAGGER_OUTPUTS)
    settings = Settings(
        model_repository=tmp_path / "models", model_name="tagger", device="cpu",
        max_wait_ms=50.0, host="127.0.0.1",
    )  # fmt: skip
    app = create_app(settings)
    async with lifespan(app):
        await app.state.loading
        assert engine_of(app).state.load_error is None
        yield app


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


async def _json(http: httpx.AsyncClient, rows: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    instances = [row.tolist() for row in rows]
    response = await http.post("/predict", json={"instances": instances})
    assert response.status_code == 200, response.text
    return [
        {name: np.asarray(value) for name, value in prediction.items()}
        for prediction in response.json()["predictions"]
    ]


async def _npz_answer(http: httpx.AsyncClient, ids: np.ndarray) -> dict[str, np.ndarray]:
    response = await http.post(
        "/predict",
        content=_npz({"input_ids": ids}),
        headers={"content-type": NPZ_MEDIA_TYPE, "accept": NPZ_MEDIA_TYPE},
    )
    assert response.status_code == 200, response.text
    with np.load(io.BytesIO(response.content), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


async def _v2_rest(http: httpx.AsyncClient, ids: np.ndarray) -> dict[str, np.ndarray]:
    request = {
        "inputs": [
            {
                "name": "input_ids",
                "datatype": "INT64",
                "shape": list(ids.shape),
                "data": ids.reshape(-1).tolist(),
            }
        ]
    }
    response = await http.post("/v2/models/tagger/infer", json=request)
    assert response.status_code == 200, response.text
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {
        output["name"]: np.asarray(output["data"], dtypes[output["datatype"]]).reshape(
            output["shape"]
        )
        for output in response.json()["outputs"]
    }


async def _grpc(client: triton_grpc.InferenceServerClient, ids: np.ndarray) -> dict[str, Any]:
    """With tritonclient, as users call it. Its gRPC module and the server's cannot share a
    process (both register the protocol's messages), so gRPC is asked of server processes."""
    tensor = triton_grpc.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    result = await client.infer("tagger", [tensor])
    return {name: result.as_numpy(name) for name in ("logits", "tags")}


async def concurrent_and_alone(
    http: httpx.AsyncClient, grpc_address: str | None, batches_run: Callable[[], float]
) -> tuple[int, int, float]:
    """12 requests of lengths 3 to 14 on each of JSON, .npz, V2 REST and (given its address)
    gRPC, all at once, twice; then each alone. Returns the answers checked, the wrong ones
    (not equal to the same request alone and to ``by_hand``), and the batches the concurrent
    rounds took."""
    client = None if grpc_address is None else triton_grpc.InferenceServerClient(grpc_address)
    try:
        # (protocol, what is sent, how): JSON requests hold two instances of different
        # lengths (the first one is `length` long); the others are rectangular.
        cases: list[tuple[str, Any, Any]] = []
        for length in LENGTHS:
            rows = [token_ids(1, length, length)[0], token_ids(1, 17 - length, 50 + length)[0]]
            cases.append(("json", rows, lambda rows=rows: _json(http, rows)))
            ids = token_ids(2, length, 100 + length)
            cases.append(("npz", ids, lambda ids=ids: _npz_answer(http, ids)))
            cases.append(("v2", ids, lambda ids=ids: _v2_rest(http, ids)))
            if client is not None:
                cases.append(("grpc", ids, lambda ids=ids: _grpc(client, ids)))
        batches_before = batches_run()
        rounds = [await asyncio.gather(*(ask() for _, _, ask in cases)) for _ in range(2)]
        batches = batches_run() - batches_before
        alone = [await ask() for _, _, ask in cases]
    finally:
        if client is not None:
            await client.close()
    checked = wrong = 0
    for answers in rounds:
        for (protocol, sent, _), answer, by_itself in zip(cases, answers, alone, strict=True):
            if protocol == "json":  # each instance at its own length
                pairs = [
                    (got[name], by_itself[row][name], by_hand(sent[row])[name])
                    for row, got in enumerate(answer)
                    for name in ("logits", "tags")
                ]
                assert len(answer) == len(sent)
            else:
                pairs = [
                    (answer[name], by_itself[name], by_hand(sent)[name])
                    for name in ("logits", "tags")
                ]
            checked += 1
            wrong += not all(
                np.array_equal(got, same) and np.array_equal(got, expected)
                for got, same, expected in pairs
            )
    print(f"per-token answers checked: {checked}, wrong: {wrong}, batches: {batches:g}")
    return checked, wrong, batches


async def test_concurrent_requests_of_many_lengths_get_what_each_gets_alone(
    tagger: FastAPI,
) -> None:
    """Today's main answered per-token outputs at the padded length of whatever batch a
    request landed in, padded tail included (real-looking tags): 84 wrong of 96."""
    registry = registry_of(tagger)
    transport = httpx.ASGITransport(app=tagger)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        checked, wrong, batches = await concurrent_and_alone(
            http, None, lambda: sample_total(registry, "batchserve_batch_size_rows_count")
        )
    assert batches < 2 * len(LENGTHS)  # requests of different lengths shared batches
    assert (checked, wrong) == (2 * 3 * len(LENGTHS), 0)


async def test_through_the_bridge_with_two_front_ends_too(tmp_path: Path) -> None:
    package_tagger(tmp_path, *TAGGER_OUTPUTS)
    grpc_port = free_port()
    with serve_with_engines(
        tmp_path,
        2,
        BATCHSERVE_MODEL_REPOSITORY=str(tmp_path / "models"),
        BATCHSERVE_MODEL_NAME="tagger",
        BATCHSERVE_MAX_WAIT_MS="50",
        BATCHSERVE_GRPC_PORT=str(grpc_port),
    ) as server:
        wait_until_serving(server, 2)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            checked, wrong, batches = await concurrent_and_alone(
                http,
                f"127.0.0.1:{grpc_port}",
                lambda: scraped(server.url, "batchserve_batch_size_rows_count"),
            )
    assert batches < 4 * len(LENGTHS)  # requests did share batches
    assert (checked, wrong) == (2 * 4 * len(LENGTHS), 0)


async def test_json_rows_have_each_instances_own_length_and_openapi_says_so(
    tagger: FastAPI,
) -> None:
    transport = httpx.ASGITransport(app=tagger)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        rows = [token_ids(1, 3, 1)[0], token_ids(1, 7, 2)[0]]
        predictions = await _json(http, rows)
        document = (await http.get("/openapi.json")).json()
    assert [len(prediction["tags"]) for prediction in predictions] == [3, 7]
    assert [prediction["logits"].shape for prediction in predictions] == [(3, 5), (7, 5)]
    answer = document["paths"]["/predict"]["post"]["responses"]["200"]["content"]
    row = answer["application/json"]["schema"]["properties"]["predictions"]["items"]
    tags = row["properties"]["tags"]
    assert tags["x-batchserve-tensor"]["length_of"] == "input_ids"
    assert "each instance's own length of `input_ids`" in tags["description"]


def test_parsed_json_instances_carry_their_own_lengths(tmp_path: Path) -> None:
    manifest = package_tagger(tmp_path, *TAGGER_OUTPUTS)
    layout = InputLayout(manifest)
    ragged = layout.parse_json(b'{"instances": [[1, 2, 3], [4, 5, 6, 7, 8]]}')
    assert isinstance(ragged, PaddedInstances)
    assert ragged.lengths.tolist() == [3, 5]
    assert ragged["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    even = layout.parse_json(b'{"instances": [[1, 2, 3], [4, 5, 6]]}')
    assert type(even) is NamedArrays  # nothing to cut: the tensors' fast path stays
