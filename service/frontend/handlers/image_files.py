"""Reading an image's header without decoding its pixels: PNG or JPEG only, size-checked.

Pillow is asked to try only PNG and JPEG (each parser is attack surface), and the pixel count
an image declares is checked before anything is allocated for them.
"""

from __future__ import annotations

import io

from PIL import Image

from service.errors import InvalidInputError, PayloadTooLargeError

#: The formats Pillow may parse: nothing else is even tried (each parser is attack surface).
#: MPO is how Pillow names a JPEG holding several pictures (phone cameras write them).
_OPENED_FORMATS = ("PNG", "JPEG")
_ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "MPO"})
#: How other files start, to tell a client what it sent instead of an image.
_MAGIC_NAMES: tuple[tuple[bytes, str], ...] = (
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"BM", "a BMP image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"%PDF", "a PDF document"),
    (b"<svg", "an SVG image"),
    (b"<?xml", "an XML document"),
    (b"\x00\x00\x01\x00", "an ICO image"),
)


def open_image(index: int, encoded: bytes, max_pixels: int) -> Image.Image:
    """The image's header read, its pixels not yet decoded: 422 for anything but PNG or
    JPEG, 413 for more than ``max_pixels`` pixels."""
    try:
        image = Image.open(io.BytesIO(encoded), formats=_OPENED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own limit (89 megapixels warns, twice that raises) is far above ours; the
        # warning is an exception only where warnings are errors (the tests).
        raise PayloadTooLargeError(
            f"image {index} declares more than {max_pixels:,} pixels; at most {max_pixels:,} "
            "are accepted"
        ) from None
    except Exception:
        raise InvalidInputError(
            f"image {index} is not a PNG or JPEG image: got {describe_bytes(encoded)}"
        ) from None
    if image.format not in _ACCEPTED_FORMATS:
        raise InvalidInputError(f"image {index} is not a PNG or JPEG image: got {image.format}")
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLargeError(
            f"image {index} is {width}x{height} ({width * height:,} pixels); at most "
            f"{max_pixels:,} are accepted"
        )
    return image


def describe_bytes(encoded: bytes) -> str:
    """What a body that is no PNG or JPEG seems to be, for the error message."""
    if not encoded:
        return "no bytes"
    if encoded.startswith(b"\x89PNG"):
        return "a damaged PNG"
    if encoded.startswith(b"\xff\xd8"):
        return "a damaged JPEG"
    if encoded[8:12] == b"WEBP" and encoded.startswith(b"RIFF"):
        return "a WebP image"
    for magic, name in _MAGIC_NAMES:
        if encoded.startswith(magic):
            return name
    try:
        encoded[:64].decode("utf-8")
    except UnicodeDecodeError:
        return f"{len(encoded)} bytes starting {encoded[:8]!r}"
    return f"text starting {encoded[:24].decode('utf-8', 'replace')!r}"
