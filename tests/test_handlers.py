"""The built-in handlers, called directly with real ``tokenizers`` and Pillow (no server).

Each preprocess is checked against doing the same by hand with the library it wraps, and each
refusal by its status and the words the client reads.
"""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from service.errors import (
    BadRequestError,
    DeadlineExceededError,
    InvalidInputError,
    PayloadTooLargeError,
    ServiceError,
    UnsupportedMediaTypeError,
)
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.classification import ClassificationHandler
from service.frontend.handlers.image import ImageHandler
from service.frontend.handlers.text import TextHandler
from service.frontend.inputs import InputLayout
from service.manifest import Architecture, Manifest, TensorSpec
from service.tensors import NamedArrays

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "i", "loved", "this", "film", "hated", "it", "a"]
MAX_LENGTH = 8
DIGIT_LABELS = tuple(str(digit) for digit in range(10))


# --- building versions ---------------------------------------------------------------------


def make_context(
    folder: Path,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...] = (
        TensorSpec(name="logits", dtype="float32", shape=(-1, 10), labels=DIGIT_LABELS),
    ),
    files: tuple[str, ...] = (),
) -> HandlerContext:
    """A version in ``folder`` whose files are ``files`` (already written there)."""
    hashes = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in files}
    manifest = Manifest.create(
        name="demo",
        format="safetensors",
        artifact="model.safetensors",
        files={"model.safetensors": "0" * 64, **hashes},
        architecture=Architecture(import_path="demo.net:Net"),
        inputs=inputs,
        outputs=outputs,
        created_at=datetime.now(UTC),
    )
    return HandlerContext(manifest=manifest, folder=folder, layout=InputLayout(manifest))


def request(
    body: bytes, media_type: str, content_type: str | None = None, **query: str
) -> HandlerRequest:
    return HandlerRequest(
        body=body, media_type=media_type, content_type=content_type or media_type, query=query
    )


def json_request(document: object, **query: str) -> HandlerRequest:
    return request(orjson.dumps(document), "application/json", **query)


def refusal(call: Callable[[], object], error: type[ServiceError]) -> str:
    """The message of the ``error`` that ``call`` raises."""
    with pytest.raises(error) as raised:
        call()
    return raised.value.message


# --- text ----------------------------------------------------------------------------------


def ids_spec(max_value: int = len(WORDS) - 1) -> TensorSpec:
    return TensorSpec(
        name="input_ids",
        dtype="int64",
        shape=(-1, -1),
        max_length=MAX_LENGTH,
        min_value=1,
        max_value=max_value,
        pad_value=0,
    )


MASK = TensorSpec(
    name="attention_mask", dtype="int64", shape=(-1, -1), max_length=MAX_LENGTH, max_value=1
)
SENTIMENT = TensorSpec(
    name="logits", dtype="float32", shape=(-1, 2), labels=("negative", "positive")
)


def write_tokenizer(folder: Path, *, special_tokens: bool = True) -> Tokenizer:
    """A real WordPiece tokenizer (BERT normaliser and pre-tokenizer) saved as tokenizer.json."""
    vocabulary = {word: index for index, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if special_tokens:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def text_handler(
    folder: Path,
    inputs: tuple[TensorSpec, ...] = (ids_spec(), MASK),
    *,
    special_tokens: bool = True,
    **options: Any,
) -> tuple[TextHandler, Tokenizer]:
    tokenizer = write_tokenizer(folder, special_tokens=special_tokens)
    context = make_context(folder, inputs, (SENTIMENT,), files=("tokenizer.json",))
    return TextHandler(context, **options), tokenizer


def padded(rows: list[list[int]], value: int = 0) -> np.ndarray[Any, Any]:
    longest = max(len(row) for row in rows)
    return np.array([row + [value] * (longest - len(row)) for row in rows], dtype=np.int64)


def test_text_instances_are_the_tokenizers_ids_padded_with_a_mask(tmp_path: Path) -> None:
    handler, tokenizer = text_handler(tmp_path)
    texts = ["I loved this film", "Hated it", "a"]

    inputs = handler.preprocess(json_request({"instances": texts}))

    ids = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    np.testing.assert_array_equal(inputs["input_ids"], padded(ids))
    np.testing.assert_array_equal(inputs["attention_mask"], padded([[1] * len(i) for i in ids]))
    assert inputs["input_ids"].dtype == np.int64
    assert inputs["input_ids"][1].tolist() == [2, 8, 9, 3, 0, 0]  # [CLS] hated it [SEP] pad


def test_a_text_plain_body_is_one_instance(tmp_path: Path) -> None:
    handler, tokenizer = text_handler(tmp_path)

    inputs = handler.preprocess(
        request(b"I loved this film", "text/plain", "text/plain; charset=UTF-8")
    )

    assert inputs["input_ids"].tolist() == [tokenizer.encode("I loved this film").ids]
    assert inputs["attention_mask"].tolist() == [[1] * 6]


def test_text_plain_that_is_not_utf8_is_a_bad_request(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path)

    message = refusal(
        lambda: handler.preprocess(request(b"caf\xe9", "text/plain")), BadRequestError
    )
    assert "not valid UTF-8" in message
    assert "charset=utf-8" in refusal(
        lambda: handler.preprocess(request(b"x", "text/plain", "text/plain; charset=latin-1")),
        UnsupportedMediaTypeError,
    )


def test_a_long_text_is_truncated_keeping_its_special_tokens(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path)

    inputs = handler.preprocess(json_request({"instances": ["a " * 20, "a"]}))

    assert inputs["input_ids"].shape == (2, MAX_LENGTH)
    assert inputs["input_ids"][0].tolist() == [2, *[10] * (MAX_LENGTH - 2), 3]


def test_a_long_text_is_refused_when_the_version_does_not_truncate(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path, truncate=False)

    message = refusal(
        lambda: handler.preprocess(json_request({"instances": ["a", "a " * 20]})),
        InvalidInputError,
    )
    assert message == (
        f"instance 1 is 22 tokens long; at most {MAX_LENGTH} are accepted (this version "
        "does not truncate)"
    )


@pytest.mark.parametrize("truncate", [True, False])
def test_a_route_may_cut_a_long_text_either_way_or_refuse_it(
    tmp_path: Path, truncate: bool
) -> None:
    """Whatever the version's option, a ``Cut`` passed per call decides: ``right`` keeps a
    text's first tokens, ``left`` its last (special tokens added after the cut), ``none``
    refuses it; a text that fits is the same every way."""
    handler, _ = text_handler(tmp_path, truncate=truncate)
    texts = ["i loved this film " + "a " * 10 + "hated it", "i loved it"]

    def ids(cut: Any) -> list[list[int]]:
        inputs = handler.encode(handler.bounded(texts, cut=cut), cut=cut)
        return [row[row != 0].tolist() for row in inputs["input_ids"]]

    assert ids("right") == [[2, 4, 5, 6, 7, 10, 10, 3], [2, 4, 5, 9, 3]]
    assert ids("left") == [[2, 10, 10, 10, 10, 8, 9, 3], [2, 4, 5, 9, 3]]
    message = refusal(lambda: ids("none"), InvalidInputError)
    assert message.startswith(f"input 0 is 18 tokens long, more than the {MAX_LENGTH}")
    assert handler.tokenizer_cutting(None) is handler.tokenizer


def test_empty_text_gives_what_the_tokenizer_gives(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path)
    inputs = handler.preprocess(json_request({"instances": [""]}))
    assert inputs["input_ids"].tolist() == [[2, 3]]  # [CLS] [SEP]

    bare, _ = text_handler(tmp_path, special_tokens=False)
    message = refusal(
        lambda: bare.preprocess(json_request({"instances": ["a", " "]})), InvalidInputError
    )
    assert message == "instance 1 gives no tokens (empty text); send some text"


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ({"instances": ["a", 3]}, "got a number at instance 1"),
        ({"instances": []}, "no instances"),
        ({"instances": "a"}, "'instances' must be a list, got a string"),
        (["a"], "must be a JSON object"),
        ({"instances": ["a"], "top_k": 1}, "unknown field(s) ['top_k']"),
    ],
)
def test_text_bodies_other_than_a_list_of_strings_are_refused(
    tmp_path: Path, document: object, words: str
) -> None:
    handler, _ = text_handler(tmp_path)
    assert words in refusal(lambda: handler.preprocess(json_request(document)), InvalidInputError)


def test_token_type_ids_are_built_when_the_model_takes_them(tmp_path: Path) -> None:
    types = TensorSpec(name="token_type_ids", dtype="int32", shape=(-1, -1), max_length=MAX_LENGTH)
    handler, _ = text_handler(tmp_path, (ids_spec(), MASK, types))

    inputs = handler.preprocess(json_request({"instances": ["a", "a a"]}))

    assert inputs.names == ("input_ids", "attention_mask", "token_type_ids")
    assert inputs["token_type_ids"].dtype == np.int32
    assert inputs["token_type_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_a_text_version_that_cannot_be_served_is_refused_when_its_handler_is_built(
    tmp_path: Path,
) -> None:
    other = TensorSpec(name="pixels", dtype="float32", shape=(-1, 4))
    with pytest.raises(ValueError, match=r"input\(s\) \['pixels'\]"):
        text_handler(tmp_path, (ids_spec(), MASK, other))
    with pytest.raises(ValueError, match="ids go up to 10, beyond the max_value 5"):
        text_handler(tmp_path, (ids_spec(max_value=5), MASK))
    write_tokenizer(tmp_path)
    unhashed = make_context(tmp_path, (ids_spec(), MASK), (SENTIMENT,))
    with pytest.raises(ValueError, match=r"'tokenizer\.json' is not a file of demo@"):
        TextHandler(unhashed)


def test_an_encoder_behind_the_text_handler_answers_tensors(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    embedding = TensorSpec(name="embedding", dtype="float32", shape=(-1, 3))
    context = make_context(tmp_path, (ids_spec(),), (embedding,), files=("tokenizer.json",))
    handler = TextHandler(context, postprocess="tensors")
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)

    answers = handler.postprocess(NamedArrays.of(embedding=rows), json_request({}))

    assert [answer.tolist() for answer in answers] == rows.tolist()
    assert "raw output tensors" in refusal(
        lambda: handler.preprocess(json_request({"instances": ["a"]}, top_k="1")),
        InvalidInputError,
    )


# --- images --------------------------------------------------------------------------------


def encode_image(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format)
    return buffer.getvalue()


def picture(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels: every resampling or channel mistake shows in them."""
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels))
    return Image.fromarray(pixels.astype(np.uint8).squeeze(), mode)


RGB_INPUT = TensorSpec(name="pixels", dtype="float32", shape=(-1, 3, 16, 12))
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def rgb_handler(folder: Path, **options: Any) -> ImageHandler:
    return ImageHandler(make_context(folder, (RGB_INPUT,)), mean=MEAN, std=STD, **options)


def by_hand_rgb(encoded: bytes) -> np.ndarray[Any, Any]:
    """What the RGB handler must give: Pillow's bilinear resize to 12x16, [0, 1], normalised,
    channels first."""
    image = Image.open(io.BytesIO(encoded)).convert("RGB").resize((12, 16), Image.BILINEAR)
    values = np.asarray(image, dtype=np.float64) / 255.0
    values = (values - np.array(MEAN)) / np.array(STD)
    return values.transpose(2, 0, 1)


def test_a_png_body_is_decoded_resized_and_normalised(tmp_path: Path) -> None:
    png = encode_image(picture((40, 30)))

    inputs = rgb_handler(tmp_path).preprocess(request(png, "image/png"))

    assert inputs["pixels"].shape == (1, 3, 16, 12)
    assert inputs["pixels"].dtype == np.float32
    np.testing.assert_allclose(inputs["pixels"][0], by_hand_rgb(png), rtol=1e-5, atol=1e-5)


def test_a_jpeg_body_is_decoded(tmp_path: Path) -> None:
    jpeg = encode_image(picture((12, 16)), "JPEG")

    inputs = rgb_handler(tmp_path).preprocess(request(jpeg, "image/jpeg"))

    np.testing.assert_allclose(inputs["pixels"][0], by_hand_rgb(jpeg), rtol=1e-5, atol=1e-5)


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_close_to_the_full_one(tmp_path: Path) -> None:
    smooth = Image.linear_gradient("L").convert("RGB")  # 256x256, no detail lost at 1/8
    jpeg = encode_image(smooth, "JPEG")

    inputs = rgb_handler(tmp_path).preprocess(request(jpeg, "image/jpeg"))

    np.testing.assert_allclose(inputs["pixels"][0], by_hand_rgb(jpeg), atol=0.1)


def test_base64_instances_are_the_images_they_encode(tmp_path: Path) -> None:
    first, second = encode_image(picture((20, 20), seed=1)), encode_image(picture((9, 7), seed=2))
    second_b64 = base64.b64encode(second).decode()

    inputs = rgb_handler(tmp_path).preprocess(
        json_request(
            {
                "instances": [
                    {"b64": base64.b64encode(first).decode()},
                    second_b64,
                    f"data:image/png;base64,{second_b64}",
                ]
            }
        )
    )

    expected = np.stack([by_hand_rgb(first), by_hand_rgb(second), by_hand_rgb(second)])
    np.testing.assert_allclose(inputs["pixels"], expected, rtol=1e-5, atol=1e-5)


def test_invalid_base64_is_refused(tmp_path: Path) -> None:
    handler = rgb_handler(tmp_path)
    assert refusal(
        lambda: handler.preprocess(json_request({"instances": [{"b64": "not base64!"}]})),
        InvalidInputError,
    ) == ("instance 0 is not valid base64")
    assert "got a number" in refusal(
        lambda: handler.preprocess(json_request({"instances": [7]})), InvalidInputError
    )


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> bytes:
    """A ``multipart/form-data`` body of ``(field name, file name or None, content)``."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        body += b"Content-Type: image/png\r\n\r\n" + content + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()


MULTIPART = "multipart/form-data; boundary=b0undary"


def test_every_file_of_a_multipart_upload_is_an_instance_in_order(tmp_path: Path) -> None:
    first, second = encode_image(picture((20, 20), seed=3)), encode_image(picture((5, 50), seed=4))
    body = multipart([("a", "a.png", first), ("b", "b.jpg", second)])

    inputs = rgb_handler(tmp_path).preprocess(request(body, "multipart/form-data", MULTIPART))

    expected = np.stack([by_hand_rgb(first), by_hand_rgb(second)])
    np.testing.assert_allclose(inputs["pixels"], expected, rtol=1e-5, atol=1e-5)


def test_malformed_multipart_uploads_are_refused(tmp_path: Path) -> None:
    handler = rgb_handler(tmp_path)
    png = encode_image(picture((4, 4)))
    whole = multipart([("a", "a.png", png)])

    def preprocess(body: bytes, content_type: str = MULTIPART) -> Callable[[], object]:
        return lambda: handler.preprocess(request(body, "multipart/form-data", content_type))

    assert "boundary" in refusal(preprocess(whole, "multipart/form-data"), BadRequestError)
    assert "ends before its closing boundary" in refusal(
        preprocess(whole[: len(whole) // 2]), BadRequestError
    )
    assert "part 0 ('note') is not a file" in refusal(
        preprocess(multipart([("note", None, b"hello")])), InvalidInputError
    )
    assert "no instances" in refusal(preprocess(b"--b0undary--\r\n"), InvalidInputError)


def png_declaring(width: int, height: int) -> bytes:
    """A 57-byte PNG whose header declares ``width`` x ``height`` pixels and holds none: a
    decompression bomb's header, without the bomb (decoding it would fail as truncated)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("width", "height", "words"),
    [
        (100_000, 100_000, "image 0 declares more than 16,000,000 pixels"),
        (5_000, 5_000, "image 0 is 5000x5000 (25,000,000 pixels); at most 16,000,000"),
    ],
)
def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(
    tmp_path: Path, width: int, height: int, words: str
) -> None:
    handler = rgb_handler(tmp_path)
    bomb = png_declaring(width, height)

    message = refusal(lambda: handler.preprocess(request(bomb, "image/png")), PayloadTooLargeError)

    assert words in message  # not "truncated": the pixels were never decoded


def test_max_pixels_is_an_option(tmp_path: Path) -> None:
    png = encode_image(picture((20, 20)))
    handler = rgb_handler(tmp_path, max_pixels=399)
    assert "20x20 (400 pixels); at most 399" in refusal(
        lambda: handler.preprocess(request(png, "image/png")), PayloadTooLargeError
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (encode_image(picture((4, 4)), "GIF"), "image 0 is not a PNG or JPEG image: got a GIF"),
        (b"hello, world", "not a PNG or JPEG image: got text starting 'hello, world'"),
        (encode_image(picture((4, 4)), "BMP"), "got a BMP image"),
        (b"", "got no bytes"),
    ],
)
def test_anything_but_png_or_jpeg_is_refused(tmp_path: Path, body: bytes, words: str) -> None:
    handler = rgb_handler(tmp_path)
    assert words in refusal(
        lambda: handler.preprocess(request(body, "image/png")), InvalidInputError
    )


def test_a_truncated_png_is_refused(tmp_path: Path) -> None:
    png = encode_image(picture((64, 64)))
    handler = rgb_handler(tmp_path)

    message = refusal(
        lambda: handler.preprocess(request(png[: len(png) // 2], "image/png")), InvalidInputError
    )

    assert message.startswith("image 0 is a damaged or truncated PNG")


DIGIT_INPUT = TensorSpec(
    name="image", dtype="float32", shape=(-1, 8, 8), min_value=0.0, max_value=1.0
)


def digits_handler(folder: Path, **options: Any) -> ImageHandler:
    context = make_context(folder, (DIGIT_INPUT,))
    return ImageHandler(context, mode="L", layout="HW", invert=True, resample="box", **options)


def test_a_dark_drawing_on_white_becomes_high_values_on_zero(tmp_path: Path) -> None:
    drawing = Image.new("L", (32, 32), 255)
    drawing.paste(0, (8, 0, 16, 32))  # a black bar over columns 8-15

    inputs = digits_handler(tmp_path).preprocess(request(encode_image(drawing), "image/png"))

    expected = np.zeros((8, 8), dtype=np.float32)
    expected[:, 2:4] = 1.0
    np.testing.assert_allclose(inputs["image"][0], expected, atol=1e-6)


def test_transparent_pixels_are_white_not_ink(tmp_path: Path) -> None:
    stroke = Image.new("RGBA", (16, 16), (0, 0, 0, 0))  # transparent black
    stroke.paste((0, 0, 0, 255), (0, 0, 16, 2))  # an opaque black line on top

    inputs = digits_handler(tmp_path).preprocess(request(encode_image(stroke), "image/png"))

    assert inputs["image"][0, 0].tolist() == [1.0] * 8
    assert inputs["image"][0, 1:].max() == 0.0


def test_fit_content_fills_the_input_with_the_drawing(tmp_path: Path) -> None:
    canvas = Image.new("L", (100, 100), 255)
    canvas.paste(0, (70, 70, 90, 90))  # a small black square in a corner

    inputs = digits_handler(tmp_path, fit_content=True).preprocess(
        request(encode_image(canvas), "image/png")
    )

    assert inputs["image"][0].min() == 1.0


def test_image_options_that_do_not_fit_the_model_are_refused_when_built(
    tmp_path: Path,
) -> None:
    context = make_context(tmp_path, (DIGIT_INPUT,))
    with pytest.raises(ValueError, match="layout 'CHW' has fixed axes NCHW"):
        ImageHandler(context, mode="L")
    with pytest.raises(ValueError, match=r"values in \[-1, 0\], outside the range \[0.0, 1.0\]"):
        ImageHandler(context, mode="L", layout="HW", mean=[1.0])
    with pytest.raises(ValueError, match="the input has 3 channels, mode has 1"):
        ImageHandler(make_context(tmp_path, (RGB_INPUT,)), mode="L")


# --- classification ------------------------------------------------------------------------


def classifier(folder: Path, **options: Any) -> ClassificationHandler:
    return ClassificationHandler(make_context(folder, (DIGIT_INPUT,)), **options)


LOGITS = np.array([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0, 0, 2.0], [5.0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])


def test_top_k_from_the_query_answers_labels_best_first(tmp_path: Path) -> None:
    answers = classifier(tmp_path).postprocess(
        NamedArrays.of(logits=LOGITS.astype(np.float32)), json_request({}, top_k="3")
    )

    assert [[entry["label"] for entry in answer] for answer in answers] == [
        ["1", "9", "2"],
        ["0", "1", "2"],  # ties go to the lower index
    ]
    for answer in answers:
        scores = [entry["score"] for entry in answer]
        assert scores == sorted(scores, reverse=True)
        assert sum(scores) <= 1.0
        assert all(isinstance(score, float) for score in scores)
    expected = np.exp(LOGITS[0]) / np.exp(LOGITS[0]).sum()
    assert answers[0][0]["score"] == pytest.approx(expected[1])


def test_the_top_k_option_is_the_default(tmp_path: Path) -> None:
    answers = classifier(tmp_path, top_k=2).postprocess(
        NamedArrays.of(logits=LOGITS), json_request({})
    )
    assert [len(answer) for answer in answers] == [2, 2]
    with pytest.raises(ValueError, match="top_k must be from 1 to 10, got 11"):
        classifier(tmp_path, top_k=11)


@pytest.mark.parametrize("top_k", ["0", "11", "abc", "-1", " 3", "2.0", ""])
def test_a_top_k_outside_the_classes_is_refused_before_the_model_runs(
    tmp_path: Path, top_k: str
) -> None:
    handler = classifier(tmp_path)
    body = json_request({"instances": [[[0.5] * 8] * 8]}, top_k=top_k)

    message = refusal(lambda: handler.preprocess(body), InvalidInputError)

    assert message == (
        f"top_k must be an integer from 1 to 10 (the model's classes), got {top_k!r}"
    )


def test_without_labels_the_class_indices_are_the_labels(tmp_path: Path) -> None:
    outputs = (
        TensorSpec(name="hidden", dtype="float32", shape=(-1, 4)),
        TensorSpec(name="scores", dtype="float32", shape=(-1, 3)),
    )
    context = make_context(tmp_path, (DIGIT_INPUT,), outputs)
    handler = ClassificationHandler(context, output="scores", apply_softmax=False)
    probabilities = np.array([[0.2, 0.5, 0.3]], dtype=np.float32)

    answers = handler.postprocess(
        NamedArrays.of(hidden=np.zeros((1, 4), np.float32), scores=probabilities),
        json_request({}, top_k="2"),
    )

    assert answers == [
        [{"label": "1", "score": pytest.approx(0.5)}, {"label": "2", "score": pytest.approx(0.3)}]
    ]


def test_the_first_output_with_labels_is_classified_by_default(tmp_path: Path) -> None:
    outputs = (TensorSpec(name="embedding", dtype="float32", shape=(-1, 4)), SENTIMENT)
    handler = ClassificationHandler(make_context(tmp_path, (DIGIT_INPUT,), outputs))
    assert handler.output == "logits"
    assert handler.labels == ("negative", "positive")


# --- bounds on one request's preprocessing ---------------------------------------------------


def test_images_declaring_too_many_pixels_together_are_refused_before_any_is_decoded(
    tmp_path: Path,
) -> None:
    handler = rgb_handler(tmp_path, max_pixels=1_000_000, max_request_pixels=2_500_000)
    # Three headers of a megapixel each, no pixels: decoding any would fail as truncated.
    body = multipart([(f"image{i}", f"{i}.png", png_declaring(1000, 1000)) for i in range(3)])

    message = refusal(
        lambda: handler.preprocess(request(body, "multipart/form-data", MULTIPART)),
        PayloadTooLargeError,
    )

    assert message.startswith("the request's 3 images declare 3,000,000 pixels together")
    assert "at most 2,500,000" in message


def test_max_request_pixels_below_max_pixels_is_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_request_pixels must be an integer at least"):
        rgb_handler(tmp_path, max_pixels=100, max_request_pixels=99)


def test_images_are_not_decoded_past_the_requests_deadline(tmp_path: Path) -> None:
    handler = rgb_handler(tmp_path)
    png = encode_image(picture((20, 20)))
    late = HandlerRequest(png, "image/png", "image/png", deadline_s=time.monotonic() - 0.5)

    message = refusal(lambda: handler.preprocess(late), DeadlineExceededError)

    assert "image 0 of 1 was about to be decoded" in message


def test_a_long_text_costs_only_what_truncation_keeps(tmp_path: Path) -> None:
    handler, tokenizer = text_handler(tmp_path)
    short = handler.preprocess(json_request({"instances": ["i loved this film " * 4]}))
    started_s = time.perf_counter()

    long = handler.preprocess(json_request({"instances": ["i loved this film " * 15_000]}))

    elapsed_s = time.perf_counter() - started_s
    assert long["input_ids"].tolist() == short["input_ids"].tolist()
    # The whole text tokenized once, for comparison: the handler cut it first.
    whole_started_s = time.perf_counter()
    tokenizer.encode("i loved this film " * 15_000)
    assert elapsed_s < (time.perf_counter() - whole_started_s) / 5


@pytest.mark.parametrize(
    "text",
    [
        " " * 300 + "i loved this film " * 3,
        "\n" * 300 + "i loved this film " * 3,
        "\u200b" * 300 + "i loved this film " * 3,
        "x" * 250 + " hated it " * 30,
        "i loved this film " * 100,
        ("a" * 40 + " " * 20) * 30 + "hated it " * 3,
    ],
    ids=["spaces", "newlines", "zero-width spaces", "long word", "long text", "long words"],
)
def test_a_long_text_gives_the_tokens_of_the_whole_text_truncated(
    tmp_path: Path, text: str
) -> None:
    """Its first 8 tokens, however many characters precede them (the handler tokenizes
    256 characters first, 32 per token)."""
    handler, tokenizer = text_handler(tmp_path)
    tokenizer.enable_truncation(MAX_LENGTH)

    inputs = handler.preprocess(json_request({"instances": [text]}))

    assert inputs["input_ids"].tolist() == [tokenizer.encode(text).ids]


def byte_level_handler(folder: Path) -> tuple[TextHandler, Tokenizer]:
    """A GPT-2-style tokenizer (byte-level BPE: its split of spaces looks ahead) behind a text
    handler truncating at 8 tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(["i loved this film", "hated it", "a film"] * 5, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = ids_spec(max_value=tokenizer.get_vocab_size() - 1).model_copy(update={"min_value": 0})
    context = make_context(folder, (ids, MASK), (SENTIMENT,), files=("tokenizer.json",))
    return TextHandler(context), tokenizer


PIECES = [
    "i",
    "loved",
    "this",
    "film",
    "hated",
    "it",
    "a",
    "x" * 120,
    "!",
    ",",
    "\u00e9",
    "e\u0301",
]
GAPS = [" ", "  ", "\n", "\t", "\u200b", " \u200b ", "", " " * 50]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    pieces=st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(GAPS)), max_size=120),
    lead=st.sampled_from(["", " " * 300, "\u200b" * 300, "y" * 300]),
    kind=st.sampled_from(["wordpiece", "byte-level"]),
)
def test_any_text_gives_the_tokens_of_the_whole_text_truncated(
    tmp_path_factory: pytest.TempPathFactory, pieces: list[tuple[str, str]], lead: str, kind: str
) -> None:
    folder = tmp_path_factory.mktemp(kind)
    handlers = {"wordpiece": text_handler, "byte-level": byte_level_handler}
    handler, tokenizer = handlers[kind](folder)
    tokenizer.enable_truncation(MAX_LENGTH)
    text = lead + "".join(piece + gap for piece, gap in pieces)
    if not tokenizer.encode(text).ids:
        return  # refused as empty, whatever its length

    inputs = handler.preprocess(json_request({"instances": [text]}))

    assert inputs["input_ids"].tolist() == [tokenizer.encode(text).ids]


def test_a_text_whose_first_max_chars_hold_too_few_tokens_is_refused(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path, max_chars=1000)
    text = " " * 1200 + "i loved it"

    message = refusal(
        lambda: handler.preprocess(json_request({"instances": ["i loved it", text]})),
        PayloadTooLargeError,
    )

    assert message.startswith(
        "instance 1 is 1,210 characters long and its first 1,000 hold fewer than 8 tokens"
    )


def test_cutting_a_requests_texts_is_bounded_by_max_request_chars(tmp_path: Path) -> None:
    """Three texts whose first 8 tokens lie past 2,000 spaces: finding them would take
    3 * (256 + 512 + 1024 + 2048) characters tokenized, beyond the 3,000 allowed."""
    handler, _ = text_handler(tmp_path, max_chars=10_000, max_request_chars=3000)
    texts = [" " * 2000 + "i loved it"] * 3

    message = refusal(
        lambda: handler.preprocess(json_request({"instances": texts})), PayloadTooLargeError
    )

    assert message.startswith(
        "finding the first 8 tokens of the request's 3 texts takes more than 3,000 characters"
    )


def test_texts_above_the_character_limits_are_refused_before_tokenizing(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path, truncate=False, max_chars=50, max_request_chars=80)

    too_long = refusal(
        lambda: handler.preprocess(json_request({"instances": ["a", "a " * 30]})),
        PayloadTooLargeError,
    )
    too_many = refusal(
        lambda: handler.preprocess(json_request({"instances": ["a " * 20] * 3})),
        PayloadTooLargeError,
    )

    assert too_long == "instance 1 is 60 characters long; at most 50 are accepted"
    assert too_many == (
        "the request's 3 texts hold 120 characters together; at most 80 are accepted in one request"
    )


def test_texts_are_not_tokenized_past_the_requests_deadline(tmp_path: Path) -> None:
    handler, _ = text_handler(tmp_path)
    late = HandlerRequest(
        orjson.dumps({"instances": ["i loved it"] * 100}),
        "application/json",
        "application/json",
        deadline_s=time.monotonic() - 0.5,
    )

    message = refusal(lambda: handler.preprocess(late), DeadlineExceededError)

    assert "0 of its 100 texts were tokenized" in message
