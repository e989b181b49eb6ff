"""The request bodies ``tune`` sends, and the rows they make in the model.

Generated for what the version's handler reads (tensors, texts or images), one instance a
request, lengths and sizes spread log-uniformly so that short and long requests come alike;
or the user's own samples (``--body FILE``, each file a body, its ``Content-Type`` from its
suffix). Every body is first run through the version's handler, as a front end runs it: one
it refuses stops ``tune`` with the handler's own message, and the rows it makes give the
padded length of each row, at which the model limit is measured.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from service.buckets import DEFAULT_MAX_LENGTH, manifest_length_edges
from service.config import Settings
from service.errors import ServiceError, UnsupportedMediaTypeError
from service.frontend.handlers.base import Handler, HandlerContext, HandlerRequest, build_handler
from service.frontend.inputs import InputLayout
from service.manifest import Manifest
from service.repository import ModelRepository
from service.server.tuning.load import Body

SHORTEST_LENGTH = 8
#: Bodies generated for texts and tensors; images are fewer (each takes longer to draw).
GENERATED_BODIES = 256
GENERATED_IMAGES = 64
SMALLEST_IMAGE_SIDE = 32
LARGEST_IMAGE_SIDE = 256
#: Times a generated text is halved when the handler refuses it (a handler that does not
#: truncate, or a tokenizer that cuts words into many tokens).
SHORTER_TRIES = 6
MOST_SAMPLES = 10_000
TEXT = "text/plain"
JSON = "application/json"
PNG = "image/png"
JPEG = "image/jpeg"
#: ``--body`` files' ``Content-Type``, by suffix.
SAMPLE_TYPES = {
    ".json": JSON,
    ".txt": TEXT,
    ".png": PNG,
    ".jpg": JPEG,
    ".jpeg": JPEG,
    ".npy": "application/x-npy",
    ".npz": "application/x-npz",
}
#: Common words: one token each in most vocabularies, so a text's token count follows its
#: number of words.
_COMMON_WORDS = (
    "the of and to in is was for that with as on by at from his her they this which be "
    "are have had not but what all were when we there can an your one so out if about "
    "who get would make like time just him know take people into year good some could "
    "them see other than then now look only come its over think also back after use two "
    "how our work first well way even new want because any these give day most us city "
    "river music train house water night morning market garden window story paper phone "
    "price coffee ticket letter school doctor family friend service order answer model "
    "great small large quick late early happy quiet bright simple clear open short long"
)
WORDS = tuple(_COMMON_WORDS.split())


@dataclass(frozen=True)
class Workload:
    """What ``tune`` sends, and the padded length of each row it makes (None for inputs of
    fixed shape)."""

    bodies: tuple[Body, ...]
    lengths: tuple[int | None, ...]
    description: str
    """What the bodies are, for the report."""

    @property
    def rows_per_request(self) -> float:
        return len(self.lengths) / len(self.bodies)


class BodyError(ValueError):
    """Bodies ``tune`` cannot send: a sample the handler refuses, or a handler whose bodies
    it cannot generate."""


def workload(
    manifest: Manifest,
    settings: Settings,
    samples: Sequence[Path] = (),
    seed: int = 0,
) -> Workload:
    """The bodies for ``manifest``'s version (``samples`` when given), each checked by its
    handler."""
    layout = InputLayout(
        manifest=manifest,
        length_edges=manifest_length_edges(manifest, settings.length_buckets),
        max_instances=settings.max_instances_per_request,
    )
    if len(samples) > MOST_SAMPLES:
        raise BodyError(f"--body is given {len(samples)} times; at most {MOST_SAMPLES}")
    repository = ModelRepository(settings.model_repository)
    folder = repository.version_folder(manifest.name, manifest.version)
    if manifest.handler is None:
        handler = Handler(HandlerContext(manifest, folder, layout))
        return _checked(handler, samples, settings.max_body_bytes, seed)
    with repository.verified_copy(manifest) as copy:
        try:
            handler = build_handler(HandlerContext(manifest, copy.folder, layout))
        except Exception as error:  # operator code: whatever it raises, it cannot be tuned
            raise BodyError(f"the handler of {manifest.label} cannot be built: {error}") from None
        return _checked(handler, samples, settings.max_body_bytes, seed)


def _checked(handler: Handler, samples: Sequence[Path], max_body_bytes: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    if samples:
        bodies = [sample_body(path) for path in samples]
        description = f"{len(bodies)} samples (--body)"
        for path, body in zip(samples, bodies, strict=True):
            if len(body.content) > max_body_bytes:
                raise BodyError(
                    f"--body {path} holds {len(body.content):,} bytes, more than the server "
                    f"takes (BATCHSERVE_MAX_BODY_BYTES, {max_body_bytes:,})"
                )
    else:
        bodies, description = generated(handler, rng)
    lengths: list[int | None] = []
    for index, body in enumerate(bodies):
        try:
            lengths += row_lengths(handler, body)
        except ServiceError as error:
            where = str(samples[index]) if samples else f"the generated body {index}"
            raise BodyError(
                f"{handler.context.manifest.label} refuses {where} ({error.status_code}): "
                f"{error.message}" + ("" if samples else "; give samples with --body FILE")
            ) from None
    return Workload(tuple(bodies), tuple(lengths), description)


def row_lengths(handler: Handler, body: Body) -> list[int | None]:
    """The padded length of each row ``body`` makes (its request's longest, as the engine
    groups a request's rows), after the handler's preprocessing."""
    media_type = body.content_type.split(";")[0].strip().lower()
    if media_type not in handler.media_types:
        raise UnsupportedMediaTypeError(
            f"its handler reads {sorted(handler.media_types)}, not {media_type}"
        )
    arrays = handler.preprocess(HandlerRequest(body.content, media_type, body.content_type))
    rows = len(arrays)
    spec = handler.context.manifest.variable_input
    if spec is None or spec.variable_axis is None:
        return [None] * rows
    length = int(arrays[spec.name].shape[1 + spec.variable_axis])
    return [length] * rows


def sample_body(path: Path) -> Body:
    """A ``--body`` file as a body, typed by its suffix."""
    content_type = SAMPLE_TYPES.get(path.suffix.lower())
    if content_type is None:
        raise BodyError(
            f"--body {path}: the suffix must say what it holds, one of {sorted(SAMPLE_TYPES)}"
        )
    try:
        return Body(path.read_bytes(), content_type)
    except OSError as error:
        raise BodyError(f"--body {path}: {error.strerror}") from None


def generated(handler: Handler, rng: np.random.Generator) -> tuple[list[Body], str]:
    """Bodies for what ``handler`` reads, and what they are."""
    manifest = handler.context.manifest
    reads = handler.media_types
    if TEXT in reads:
        spec = manifest.variable_input
        longest = (spec.max_length if spec else None) or DEFAULT_MAX_LENGTH
        return text_bodies(handler, rng, longest), (
            f"{GENERATED_BODIES} texts of {SHORTEST_LENGTH} to {longest} words "
            "(one a request, JSON)"
        )
    images = [kind for kind in (PNG, JPEG) if kind in reads]
    if images:
        return image_bodies(images, rng), (
            f"{GENERATED_IMAGES} images of {SMALLEST_IMAGE_SIDE} to {LARGEST_IMAGE_SIDE} "
            f"pixels a side ({' and '.join(kind.removeprefix('image/') for kind in images)}, "
            "one a request)"
        )
    if type(handler).preprocess is Handler.preprocess:
        return tensor_bodies(manifest, rng), (
            f"{GENERATED_BODIES} tensor instances generated from the inputs (one a request, JSON)"
        )
    assert manifest.handler is not None
    raise BodyError(
        f"tune cannot generate bodies for {manifest.label}'s handler "
        f"{manifest.handler.import_path} (it reads {sorted(reads)}): give samples with "
        "--body FILE"
    )


def log_uniform_lengths(rng: np.random.Generator, count: int, low: int, high: int) -> list[int]:
    """Lengths from ``low`` to ``high`` inclusive, log-uniformly: as many short as long."""
    logs = rng.uniform(math.log(low), math.log(high + 1), size=count)
    return [min(high, max(low, int(math.exp(value)))) for value in logs]


def tensor_bodies(manifest: Manifest, rng: np.random.Generator) -> list[Body]:
    """One instance of every input a body, each within its declared values."""
    variable = manifest.variable_input
    lengths: list[int | None]
    if variable is None:
        lengths = [None] * GENERATED_BODIES
    else:
        high = variable.max_length or DEFAULT_MAX_LENGTH
        low = min(SHORTEST_LENGTH, high)
        lengths = list(log_uniform_lengths(rng, GENERATED_BODIES, low, high))
    bodies = []
    for length in lengths:
        instance = {
            spec.name: spec.example_instances(1, length or 1, rng)[0].tolist()
            for spec in manifest.inputs
        }
        value = next(iter(instance.values())) if len(instance) == 1 else instance
        bodies.append(Body(orjson.dumps({"instances": [value]})))
    return bodies


def text_bodies(handler: Handler, rng: np.random.Generator, longest: int) -> list[Body]:
    """Texts of a spread of lengths, each shortened until ``handler`` takes it."""
    low = min(SHORTEST_LENGTH, longest)
    bodies = []
    for count in log_uniform_lengths(rng, GENERATED_BODIES, low, longest):
        words = [WORDS[index] for index in rng.integers(0, len(WORDS), size=count)]
        for _ in range(SHORTER_TRIES):
            body = Body(orjson.dumps({"instances": [" ".join(words)]}))
            try:
                row_lengths(handler, body)
                break
            except ServiceError:
                words = words[: max(1, len(words) // 2)]
        bodies.append(body)  # one still refused is reported by the check that follows
    return bodies


def image_bodies(kinds: Sequence[str], rng: np.random.Generator) -> list[Body]:
    """Small pictures, in ``kinds`` (PNG, JPEG) in turn."""
    from PIL import Image, ImageDraw

    bodies = []
    sides = log_uniform_lengths(rng, GENERATED_IMAGES, SMALLEST_IMAGE_SIDE, LARGEST_IMAGE_SIDE)
    for index, side in enumerate(sides):
        width = side
        height = max(SMALLEST_IMAGE_SIDE, int(side * rng.uniform(0.75, 1.33)))
        ground = tuple(int(value) for value in rng.integers(200, 256, size=3))
        picture = Image.new("RGB", (width, height), ground)
        draw = ImageDraw.Draw(picture)
        for _ in range(int(rng.integers(2, 6))):
            box = sorted(rng.integers(0, width, size=2)), sorted(rng.integers(0, height, size=2))
            colour = tuple(int(value) for value in rng.integers(0, 160, size=3))
            corners = [int(box[0][0]), int(box[1][0]), int(box[0][1]), int(box[1][1])]
            draw.ellipse(corners, fill=colour)
            draw.line(corners, fill=colour, width=max(1, side // 32))
        kind = kinds[index % len(kinds)]
        encoded = io.BytesIO()
        picture.save(encoded, format="PNG" if kind == PNG else "JPEG", quality=90)
        bodies.append(Body(encoded.getvalue(), kind))
    return bodies
