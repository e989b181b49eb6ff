"""Request and answer bodies: which media type a ``Content-Type`` or ``Accept`` header names,
a JSON body's ``instances``, and ``.npy``/``.npz`` archives read without pickles and within a
size, and written.

Nothing here knows a model: ``inputs.py`` and ``tensor_layout.py`` validate what these
functions decode against a version's input specs.
"""

from __future__ import annotations

import io
import math
import zipfile
from typing import IO, Any

import numpy as np
import orjson
from numpy.lib import format as npy_format

from service.errors import (
    BadRequestError,
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from service.tensors import NamedArrays
from service.types import Array

JSON_MEDIA_TYPE = "application/json"


NPY_MEDIA_TYPE = "application/x-npy"


NPZ_MEDIA_TYPE = "application/x-npz"


#: Media types read and written as a NumPy ``.npy`` array.
NPY_MEDIA_TYPES = frozenset({NPY_MEDIA_TYPE, "application/octet-stream"})


#: Media types a version without a handler reads.
TENSOR_MEDIA_TYPES = frozenset({JSON_MEDIA_TYPE, NPZ_MEDIA_TYPE} | NPY_MEDIA_TYPES)


#: How a zip file (an ``.npz`` archive, or an empty zip) starts.
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def body_media_type(content_type: str | None, accepted: frozenset[str] = TENSOR_MEDIA_TYPES) -> str:
    """The body's media type by ``Content-Type`` (a missing header is read as JSON; the
    ``.npy`` aliases as ``application/x-npy``), if among ``accepted``; else 415."""
    media_type = (content_type or JSON_MEDIA_TYPE).split(";", 1)[0].strip().lower()
    if media_type == "":
        media_type = JSON_MEDIA_TYPE
    if media_type in accepted:
        return NPY_MEDIA_TYPE if media_type in NPY_MEDIA_TYPES else media_type
    named = sorted(
        accepted - {"application/octet-stream"}, key=lambda name: (name != JSON_MEDIA_TYPE, name)
    )
    raise UnsupportedMediaTypeError(
        f"send the body as {', '.join(named[:-1])}{' or ' if len(named) > 1 else ''}{named[-1]}"
        f", got content-type {media_type!r}"
    )


def answer_media_type(accept: str | None) -> str:
    """The answer's media type the ``Accept`` header prefers: JSON, ``.npy`` or ``.npz``,
    whichever is named with the highest quality (``q`` is 1 unless given; ``q=0`` means not
    acceptable; JSON wins a tie, and is the answer when none of them is named)."""
    if not accept:
        return JSON_MEDIA_TYPE
    qualities = {JSON_MEDIA_TYPE: 0.0, NPY_MEDIA_TYPE: 0.0, NPZ_MEDIA_TYPE: 0.0}
    for part in accept.split(","):
        media_type, _, parameters = part.partition(";")
        media_type = media_type.strip().lower()
        media_type = NPY_MEDIA_TYPE if media_type in NPY_MEDIA_TYPES else media_type
        if media_type in qualities:
            qualities[media_type] = max(qualities[media_type], _quality(parameters))
    best = max(qualities.values())
    return next(media for media, quality in qualities.items() if quality == best)


def _quality(parameters: str) -> float:
    """The ``q`` of one ``Accept`` entry's parameters (``;q=0.5``); 1 when absent, 0 when
    unreadable or out of range, so a malformed entry is never preferred."""
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "q":
            try:
                quality = float(value.strip())
            except ValueError:
                return 0.0
            return quality if 0.0 <= quality <= 1.0 else 0.0
    return 1.0


def encode_npy(array: Array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def encode_npz(arrays: NamedArrays) -> bytes:
    """An uncompressed ``.npz`` archive, one ``.npy`` member per name (no pickles)."""
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays.arrays)
    return buffer.getvalue()


_MISSING = object()


def read_instances(body: bytes) -> list[Any]:
    """The ``instances`` list of a JSON body ``{"instances": [...]}``: 400 when the body is
    not JSON, 422 when it is not that object (handlers read their bodies with it too)."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidInputError(
            f'the body must be a JSON object {{"instances": [...]}}, got {json_type(document)}'
        )
    instances = document.get("instances", _MISSING) if len(document) == 1 else _MISSING
    if instances is _MISSING:  # the usual body (one key) builds no sets
        unknown = sorted(set(document) - {"instances"})
        if unknown:
            raise InvalidInputError(f"unknown field(s) {unknown}; the body takes only 'instances'")
        raise InvalidInputError("missing field 'instances' (a list of instances)")
    if not isinstance(instances, list):
        raise InvalidInputError(f"'instances' must be a list, got {json_type(instances)}")
    return instances


def npz_members(body: bytes, max_bytes: int) -> dict[str, bytes]:
    """The ``.npy`` members of an ``.npz`` archive by name (``ids.npy`` -> ``ids``), read
    with their inflated size capped at ``max_bytes`` in all."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        members = {}
        total = 0
        for info in archive.infolist():
            if not info.filename.endswith(".npy") or "/" in info.filename:
                raise BadRequestError(
                    f"an .npz archive holds only .npy members, got {info.filename[:64]!r}"
                )
            with archive.open(info) as member:
                data = member.read(max_bytes - total + 1)
            total += len(data)
            if total > max_bytes:
                raise PayloadTooLargeError(
                    f"the .npz archive inflates to more than {max_bytes} bytes"
                )
            members[info.filename[: -len(".npy")]] = data
        return members
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as error:
        raise BadRequestError(f"the body is not a valid .npz archive: {error}") from None


def check_npy_data_size(body: bytes) -> None:
    """Refuse a ``.npy`` header that declares more data than the body holds.

    ``np.load`` allocates the declared array before reading it, so a few bytes declaring a
    terabyte-sized shape would otherwise end in a MemoryError (a 500) or a huge allocation.
    """
    if not body.startswith(npy_format.MAGIC_PREFIX):
        return  # not a .npy file; np.load says why
    stream = io.BytesIO(body)
    shape, _, dtype = npy_header(stream)
    if dtype.hasobject:
        return  # np.load refuses object arrays before allocating
    declared = math.prod(shape) * dtype.itemsize
    present = len(body) - stream.tell()
    if declared > present:
        raise ValueError(
            f"the header declares shape {shape} of {dtype.name} ({declared} bytes), "
            f"but only {present} bytes of data follow"
        )


def npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """The shape, Fortran order and dtype the ``.npy`` header at the start of ``stream``
    declares, read past it; ``ValueError`` when numpy reads no header there."""
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        return npy_format.read_array_header_1_0(stream)
    if version == (2, 0):
        return npy_format.read_array_header_2_0(stream)
    raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")


def json_type(value: object) -> str:
    """What a JSON value is, in the words of an error message."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
