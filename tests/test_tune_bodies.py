"""``tuning.bodies``: what ``tune`` sends a model, generated for what its handler reads
(texts, images, tensors) or taken from ``--body`` files, each checked by the handler first.
Issue 37, item 1: tune sent tensors only, so it refused every model with a handler."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import orjson
import pytest
from PIL import Image

from service.config import Settings
from service.frontend.handlers.base import HandlerContext
from service.frontend.inputs import InputLayout
from service.manifest import Manifest
from service.repository import ModelRepository
from service.server.tuning.bodies import BodyError, generated, workload
from tests.fixtures import HandlerParsingItsOwnBodies


def manifest_of(name: str) -> tuple[Manifest, Settings]:
    settings = Settings(model_name=name)
    return ModelRepository(settings.model_repository).resolve(name), settings


def test_a_text_handler_gets_texts_of_a_spread_of_lengths() -> None:
    manifest, settings = manifest_of("sentiment")
    load = workload(manifest, settings)
    texts = [orjson.loads(body.content)["instances"] for body in load.bodies]
    assert all(len(text) == 1 and isinstance(text[0], str) for text in texts)
    assert {body.content_type for body in load.bodies} == {"application/json"}
    words = [len(text[0].split()) for text in texts]
    assert (min(words), max(words)) == (8, 64)  # 64: the ids input's max_length
    # The rows' lengths are the tokenizer's, within the model's longest.
    lengths = [length for length in load.lengths if length is not None]
    assert len(lengths) == len(load.bodies)
    assert max(lengths) == 64
    assert min(lengths) < 32
    assert load.description.startswith("256 texts of 8 to 64 words")


def test_an_image_handler_gets_small_pngs_and_jpegs() -> None:
    manifest, settings = manifest_of("digits_png")
    load = workload(manifest, settings)
    assert {body.content_type for body in load.bodies} == {"image/png", "image/jpeg"}
    sides = [Image.open(io.BytesIO(body.content)).size for body in load.bodies]
    assert min(min(side) for side in sides) >= 32
    assert max(max(side) for side in sides) <= 342
    assert set(load.lengths) == {None}  # fixed-shape input: no length buckets
    assert "images of 32 to 256 pixels a side (png and jpeg" in load.description


def test_a_model_without_a_handler_gets_tensor_instances() -> None:
    manifest, settings = manifest_of("textenc")
    load = workload(manifest, settings)
    instances = [orjson.loads(body.content)["instances"] for body in load.bodies]
    assert [len(instance[0]) for instance in instances] == list(load.lengths)
    assert load.rows_per_request == 1


def test_samples_are_sent_as_given_typed_by_their_suffix(tmp_path: Path) -> None:
    manifest, settings = manifest_of("sentiment")
    short, pair = tmp_path / "short.txt", tmp_path / "two.json"
    short.write_text("a fine day")
    pair.write_bytes(orjson.dumps({"instances": ["good", "a much longer text " * 3]}))
    load = workload(manifest, settings, [short, pair])
    assert [body.content_type for body in load.bodies] == ["text/plain", "application/json"]
    assert load.rows_per_request == 1.5
    # Each row padded to its request's longest, as the engine batches it.
    assert load.lengths[0] is not None
    assert load.lengths[1] == load.lengths[2] > load.lengths[0]
    assert load.description == "2 samples (--body)"


def test_a_sample_the_handler_refuses_stops_tune_naming_it(tmp_path: Path) -> None:
    manifest, settings = manifest_of("sentiment")
    sample = tmp_path / "tensor.json"
    sample.write_bytes(orjson.dumps({"instances": [[1, 2, 3]]}))
    with pytest.raises(BodyError, match=f"refuses {sample} \\(422\\): instances must be strings"):
        workload(manifest, settings, [sample])
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG")
    with pytest.raises(
        BodyError, match=r"\(415\): its handler reads \['application/json', 'text/pl"
    ):
        workload(manifest, settings, [picture])
    unknown = tmp_path / "body.bin"
    unknown.write_bytes(b"")
    with pytest.raises(BodyError, match=r"the suffix must say what it holds, one of \['.jpeg'"):
        workload(manifest, settings, [unknown])


def test_a_handler_reading_its_own_media_type_needs_samples() -> None:
    manifest, _ = manifest_of("digits_png")
    handler = HandlerParsingItsOwnBodies(
        HandlerContext(manifest, Path("."), InputLayout(manifest=manifest))
    )
    with pytest.raises(BodyError, match="reads \\['application/cbor'\\]\\): give samples with"):
        generated(handler, np.random.default_rng(0))


def test_a_sample_larger_than_the_server_takes_is_refused(tmp_path: Path) -> None:
    manifest, _ = manifest_of("sentiment")
    sample = tmp_path / "long.txt"
    sample.write_text("word " * 300)
    with pytest.raises(BodyError, match="holds 1,500 bytes, more than the server takes"):
        workload(manifest, Settings(max_body_bytes=1024), [sample])
