"""``ImageHandler``: PNG or JPEG images in, decoded and resized to the model's input, classified.

Bodies, each image an instance:

- ``image/png`` or ``image/jpeg``: the body is one image;
- ``application/json``: ``{"instances": [{"b64": "..."}, ...]}`` (the TF-Serving / KServe v1
  convention), or bare base64 strings (a ``data:image/png;base64,`` prefix is allowed);
- ``multipart/form-data``: every file part is an image, in order (``curl -F a=@cat.png``).

Each image is checked before its pixels are decoded: a PNG or JPEG (by content, not by the
declared type), at most ``max_pixels`` pixels as its header declares (a decompression bomb,
a few kilobytes declaring gigapixels, is refused with 413 without allocating them), and the
request's images together at most ``max_request_pixels``, checked from every image's header
before any is decoded. The request's deadline is checked before each image. Each image is
then turned upright (EXIF orientation), laid on white where transparent, converted to
``mode``, stretched to the input's height and width, scaled to [0, 1], optionally inverted,
normalised with ``mean`` and ``std`` per channel, and laid out as the input's axes.
Images are decoded one at a time and only their resized pixels kept, so a request holds at
most one full-size image in memory.

Options, besides the classification handler's (``output``, ``top_k``, ``apply_softmax``,
``postprocess``):

- ``mode`` (default ``"RGB"``): ``"RGB"`` (3 channels) or ``"L"`` (grey, 1 channel).
- ``layout`` (default ``"CHW"``): the input's axes after the batch: ``"CHW"``, ``"HWC"`` or
  ``"HW"`` (grey without a channel axis); height and width come from the input's shape.
- ``mean``, ``std`` (defaults 0 and 1 per channel): ``(x - mean) / std`` on values in [0, 1].
- ``invert`` (default false): ``1 - x`` before normalising, for models trained on light ink
  on a dark ground (the digits demo) fed dark drawings on white.
- ``fit_content`` (default false): crop to the box around what is darker than mid-grey and
  centre it in a white square before resizing, as MNIST-style digits were made: a drawing
  anywhere on a large canvas fills the model's input.
- ``resample`` (default ``"bilinear"``): Pillow's filter for resizing: ``"nearest"``,
  ``"box"``, ``"bilinear"``, ``"bicubic"`` or ``"lanczos"``.
- ``max_pixels`` (default 16,000,000, a 16-megapixel photo: 48 MB decoded as RGB): the most
  pixels an image may declare.
- ``max_request_pixels`` (default 64,000,000): the most pixels a request's images may declare
  together (413 above). Decoding costs about 5 ms a megapixel (a loaded 2-core machine), so
  the default bounds one request's decoding near a third of a second; raise it for
  batches of large photos.

The model must take one input, the images.

Query parameters: ``top_k`` (classification answers only).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps

from service.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.classification import ClassificationHandler, PostprocessMode
from service.frontend.handlers.image_files import open_image
from service.frontend.handlers.instances import check_count, json_instances, json_type
from service.frontend.handlers.multipart import multipart_files
from service.tensors import NamedArrays
from service.types import Array

ImageMode = Literal["RGB", "L"]
ImageLayout = Literal["CHW", "HWC", "HW"]
Floats = npt.NDArray[np.float32]
Resample = Literal["nearest", "box", "bilinear", "bicubic", "lanczos"]

IMAGE_MEDIA_TYPES = frozenset({"image/png", "image/jpeg"})
MULTIPART_MEDIA_TYPE = "multipart/form-data"
DEFAULT_MAX_PIXELS = 16_000_000
DEFAULT_MAX_REQUEST_PIXELS = 64_000_000
_CHANNELS: dict[str, int] = {"RGB": 3, "L": 1}
_RESAMPLING: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


class ImageHandler(ClassificationHandler):
    """PNG or JPEG images in, the model's image input, top-k labels (or raw tensors) out."""

    media_types: ClassVar[frozenset[str]] = frozenset(
        {"application/json", MULTIPART_MEDIA_TYPE, *IMAGE_MEDIA_TYPES}
    )

    def __init__(
        self,
        context: HandlerContext,
        *,
        mode: ImageMode = "RGB",
        layout: ImageLayout = "CHW",
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        invert: bool = False,
        fit_content: bool = False,
        resample: Resample = "bilinear",
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
        output: str | None = None,
        top_k: int = 1,
        apply_softmax: bool = True,
        postprocess: PostprocessMode = "classification",
    ) -> None:
        super().__init__(
            context,
            output=output,
            top_k=top_k,
            apply_softmax=apply_softmax,
            postprocess=postprocess,
        )
        manifest = context.manifest
        if mode not in _CHANNELS:
            raise ValueError(f"option mode must be 'RGB' or 'L', got {mode!r}")
        if resample not in _RESAMPLING:
            raise ValueError(
                f"option resample must be one of {sorted(_RESAMPLING)}, got {resample!r}"
            )
        if not (isinstance(max_pixels, int) and max_pixels >= 1):
            raise ValueError(f"option max_pixels must be a positive integer, got {max_pixels!r}")
        if not (isinstance(max_request_pixels, int) and max_request_pixels >= max_pixels):
            raise ValueError(
                "option max_request_pixels must be an integer at least max_pixels "
                f"({max_pixels}), got {max_request_pixels!r}"
            )
        if len(manifest.inputs) != 1:
            raise ValueError(
                f"an image handler feeds a model with one input, the images; {manifest.label} "
                f"takes {[spec.name for spec in manifest.inputs]}"
            )
        self.spec = manifest.input
        self.mode = mode
        self.layout = layout
        self.channels = _CHANNELS[mode]
        self.height, self.width = _spatial_size(self.spec.shape, layout, self.channels)
        self.resample = _RESAMPLING[resample]
        self.max_pixels = max_pixels
        self.max_request_pixels = max_request_pixels
        self.invert = invert
        self.fit_content = fit_content
        self.scale, self.offset = _affine(mean, std, invert, self.channels)
        self._check_range()

    def _check_range(self) -> None:
        """Refuse, at load, options whose values the input's declared range would refuse on
        every request (a mean and std mistaken for another model's)."""
        ends = np.stack([self.offset, 255 * self.scale + self.offset])
        low, high = float(ends.min()), float(ends.max())
        spec = self.spec
        if (spec.min_value is not None and low < spec.min_value - 1e-6) or (
            spec.max_value is not None and high > spec.max_value + 1e-6
        ):
            raise ValueError(
                f"options mean/std/invert give values in [{low:g}, {high:g}], outside the "
                f"range [{spec.min_value}, {spec.max_value}] of input {spec.name!r}"
            )

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        self.top_k(request)
        images = self.opened_images(self.encoded_images(request))
        decoded = []
        for index, image in enumerate(images):
            request.check_deadline(f"image {index} of {len(images)} was about to be decoded")
            decoded.append(self.decode(index, image))
        pixels = np.stack(decoded)
        return self.context.layout.check({self.spec.name: self.to_input(pixels)})

    def encoded_images(self, request: HandlerRequest) -> list[bytes]:
        """The request's encoded images, one per instance, still undecoded."""
        media_type = request.media_type
        if media_type in IMAGE_MEDIA_TYPES:
            return [request.body]
        if media_type == MULTIPART_MEDIA_TYPE:
            images = multipart_files(request.body, request.content_type)
            check_count(len(images), self.context.layout.max_instances)
            return images
        if media_type != "application/json":
            raise UnsupportedMediaTypeError(
                f"send images as {sorted(self.media_types)}, got {media_type!r}"
            )
        instances = json_instances(request.body, self.context.layout.max_instances)
        return [_base64_image(index, instance) for index, instance in enumerate(instances)]

    def opened_images(self, encoded: list[bytes]) -> list[Image.Image]:
        """Every image's header read, none decoded: 422 for what is no PNG or JPEG, 413 for
        an image above ``max_pixels`` or images above ``max_request_pixels`` together."""
        images = [open_image(index, data, self.max_pixels) for index, data in enumerate(encoded)]
        total = sum(image.width * image.height for image in images)
        if total > self.max_request_pixels:
            raise PayloadTooLargeError(
                f"the request's {len(images)} images declare {total:,} pixels together; at "
                f"most {self.max_request_pixels:,} are accepted in one request: send fewer or "
                "smaller images per request"
            )
        return images

    def decode(self, index: int, image: Image.Image) -> Array:
        """One opened image as ``(height, width, channels)`` uint8 pixels in ``mode``,
        resized."""
        kind = image.format
        try:
            if kind in ("JPEG", "MPO"):
                # libjpeg decodes at 1/2, 1/4 or 1/8 scale, still at least the target size
                # (either way up, in case EXIF turns it): a 12-megapixel photo for a 224x224
                # input decodes 64 times fewer pixels.
                side = max(self.width, self.height)
                image.draft(self.mode, (side, side))
            image.load()
            image = ImageOps.exif_transpose(image)
            image = _flattened(image).convert(self.mode)
            if self.fit_content:
                image = _fitted(image)
            if image.size != (self.width, self.height):
                image = image.resize((self.width, self.height), self.resample)
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise InvalidInputError(
                f"image {index} is a damaged or truncated {kind}: {error}"
            ) from None
        pixels = np.asarray(image, dtype=np.uint8)
        return pixels.reshape(self.height, self.width, self.channels)

    def to_input(self, pixels: Array) -> Array:
        """``(n, height, width, channels)`` uint8 -> the input's layout and dtype, scaled.

        The bytes are laid out first and scaled in place after: transposing the float
        array instead took 8 times as long for a 224x224 RGB image."""
        if self.layout == "CHW":
            pixels = np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))
            scale, offset = (
                self.scale[:, np.newaxis, np.newaxis],
                self.offset[:, np.newaxis, np.newaxis],
            )
        elif self.layout == "HW":
            pixels = pixels[..., 0]
            scale, offset = self.scale[0], self.offset[0]
        else:
            scale, offset = self.scale, self.offset
        values = pixels.astype(np.float32)
        values *= scale
        values += offset
        return values.astype(self.spec.numpy_dtype, copy=False)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "instances": "PNG or JPEG: an image/png or image/jpeg body, multipart/form-data "
            'files, or {"instances": [{"b64": ...}]}',
            "input": self.spec.name,
            "image": {"mode": self.mode, "height": self.height, "width": self.width},
            "max_pixels": self.max_pixels,
            "max_request_pixels": self.max_request_pixels,
            "request": {
                "image/png": {"type": "string", "format": "binary"},
                "image/jpeg": {"type": "string", "format": "binary"},
                "multipart/form-data": {
                    "type": "object",
                    "description": "Every file part is an image, in order.",
                    "additionalProperties": {"type": "string", "format": "binary"},
                },
                "application/json": {
                    "type": "object",
                    "required": ["instances"],
                    "additionalProperties": False,
                    "properties": {
                        "instances": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": self.context.layout.max_instances,
                            "items": {
                                "description": 'A base64 PNG or JPEG, bare or as {"b64": ...}.',
                                "anyOf": [
                                    {"type": "string", "contentEncoding": "base64"},
                                    {
                                        "type": "object",
                                        "required": ["b64"],
                                        "properties": {
                                            "b64": {"type": "string", "contentEncoding": "base64"}
                                        },
                                    },
                                ],
                            },
                        }
                    },
                },
            },
        }


def _base64_image(index: int, instance: object) -> bytes:
    """A JSON instance's image: ``{"b64": "..."}`` or a bare base64 string."""
    if isinstance(instance, dict) and instance.keys() == {"b64"}:
        instance = instance["b64"]
    if not isinstance(instance, str):
        raise InvalidInputError(
            f'instance {index} must be {{"b64": "<base64 PNG or JPEG>"}} or a base64 string, '
            f"got {json_type(instance)}"
        )
    if instance.startswith("data:"):
        _, _, instance = instance.partition(",")
    try:
        return base64.b64decode(instance, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"instance {index} is not valid base64") from None


def _flattened(image: Image.Image) -> Image.Image:
    """A transparent image laid on white, as viewers show it (transparent pixels are often
    black underneath, which would read as ink)."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba)
    return image


def _fitted(image: Image.Image) -> Image.Image:
    """The dark content's bounding box, centred in a white square (as is when all light)."""
    dark = image.convert("L").point(lambda value: 255 if value < 128 else 0)
    box = dark.getbbox()
    if box is None:
        return image
    content = image.crop(box)
    side = max(content.size)
    square = Image.new(image.mode, (side, side), "white")
    square.paste(content, ((side - content.width) // 2, (side - content.height) // 2))
    return square


def _spatial_size(shape: tuple[int, ...], layout: str, channels: int) -> tuple[int, int]:
    """(height, width) from the input's shape, which must match ``layout`` and the mode's
    channels, with fixed sizes."""
    axes = {"CHW": "NCHW", "HWC": "NHWC", "HW": "NHW"}.get(layout)
    if axes is None:
        raise ValueError(f"option layout must be 'CHW', 'HWC' or 'HW', got {layout!r}")
    if len(shape) != len(axes) or -1 in shape[1:]:
        raise ValueError(
            f"an image input with layout {layout!r} has fixed axes {axes}, got shape {shape}"
        )
    sizes = dict(zip(axes, shape, strict=True))
    if sizes.get("C", 1) != channels:
        raise ValueError(f"the input has {sizes['C']} channels, mode has {channels}")
    return sizes["H"], sizes["W"]


def _affine(
    mean: Sequence[float] | None, std: Sequence[float] | None, invert: bool, channels: int
) -> tuple[Floats, Floats]:
    """Per channel ``scale`` and ``offset`` with ``pixel * scale + offset`` equal to
    ``(x - mean) / std``, ``x`` the pixel in [0, 1], inverted or not: one multiply-add."""
    means = np.asarray(mean if mean is not None else [0.0] * channels, dtype=np.float64)
    stds = np.asarray(std if std is not None else [1.0] * channels, dtype=np.float64)
    for name, values in (("mean", means), ("std", stds)):
        if values.shape != (channels,):
            raise ValueError(f"option {name} needs {channels} value(s), got {values.tolist()}")
    if not np.all(stds > 0):
        raise ValueError(f"option std must be positive, got {stds.tolist()}")
    sign, start = (-1.0, 1.0) if invert else (1.0, 0.0)
    scale = sign / (255.0 * stds)
    offset = (start - means) / stds
    return scale.astype(np.float32), offset.astype(np.float32)
