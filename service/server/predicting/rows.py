"""A chunk of input rows as ``/predict`` requests, and their answers as one value per row.

A chunk goes to the engine as one request, prepared by the version's handler as ``/predict``
prepares a body of that many instances (``together``): each instance is validated as it would
be alone, and batch-mates share a forward anyway, so each row's answer is the one ``/predict``
gives it alone. Whenever that one request fails (a row that is not valid, a limit on a whole
request, a failed forward or postprocess) its rows are prepared and run one request each
(``alone``), so each row gets its own answer or its own error, the one ``/predict`` would give
a body holding that row alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import orjson

from service.bridge.interface import InferenceResult
from service.errors import BadRequestError, HandlerError, ServiceError
from service.frontend import per_token
from service.frontend.bodies import JSON_MEDIA_TYPE, NPY_MEDIA_TYPE
from service.frontend.handlers.base import Handler, HandlerRequest
from service.frontend.predict import handled
from service.manifest import Manifest
from service.server.predicting.sources import ArrayRows, Chunk
from service.tensors import NamedArrays
from service.types import Array


@dataclass(frozen=True, slots=True)
class RowsRequest:
    """Consecutive rows of the file, prepared as one request."""

    start: int
    """The first row's index in the file."""
    rows: int
    instances: NamedArrays
    """One instance per row."""
    handler_request: HandlerRequest
    """What the handler's ``postprocess`` reads (the body, the media type)."""


class RowPreparer:
    """Prepares rows with one version's handler, and reads its answers."""

    def __init__(self, handler: Handler, manifest: Manifest) -> None:
        self.handler = handler
        self.manifest = manifest
        self.tensors_only = type(handler) is Handler
        """No handler of its own: a JSON row is one instance, parsed by ``inputs.py``."""

    def unreadable(self, format: str) -> str | None:
        """Why this version cannot read rows of ``format`` (``sources``), or None."""
        media_types = self.handler.media_types
        if format in ("npy", "npz"):
            if self.tensors_only:
                return None
            texts = " or text lines" if "text/plain" in media_types else ""
            return (
                f"{self.manifest.label} has a handler of its own ({type(self.handler).__name__}) "
                f"that reads {sorted(media_types)}: give its rows as JSON Lines{texts}"
            )
        wanted = "text/plain" if format == "txt" else JSON_MEDIA_TYPE
        if wanted in media_types:
            return None
        return (
            f"{format} rows need a model that reads {wanted}; {self.manifest.label} reads "
            f"{sorted(media_types)}"
        )

    def together(self, chunk: Chunk) -> RowsRequest:
        """The chunk's rows as one request; a ``ServiceError`` if any of them fails."""
        if isinstance(chunk, ArrayRows):
            return self._arrays(chunk.start, chunk.arrays)
        values = [self._one_value(value, joined=True) for value in chunk.values]
        request = self._json(chunk.start, values)
        if len(request.instances) != len(values):  # a line of several values, or a fragment
            raise BadRequestError("a line is not one JSON value")
        return request

    def alone(self, chunk: Chunk) -> list[RowsRequest | ServiceError]:
        """Each row of the chunk as a request of its own, or its error."""
        prepared: list[RowsRequest | ServiceError] = []
        for offset in range(len(chunk)):
            try:
                prepared.append(self._row(chunk, offset))
            except ServiceError as error:
                prepared.append(error)
        return prepared

    def answers(self, request: RowsRequest, result: InferenceResult) -> list[Any]:
        """One JSON value per row, as ``/predict`` answers its instances."""
        result = per_token.at_own_lengths(result, request.instances, self.manifest)
        values = handled(self.handler.postprocess, result.outputs, request.handler_request)
        if len(values) != request.rows:
            raise HandlerError(
                f"the model's handler answered {len(values)} values for {request.rows} instances"
            )
        return values

    def _row(self, chunk: Chunk, offset: int) -> RowsRequest:
        row = chunk.start + offset
        if isinstance(chunk, ArrayRows):
            arrays = {name: array[offset : offset + 1] for name, array in chunk.arrays.items()}
            return self._arrays(row, arrays)
        return self._json(row, [self._one_value(chunk.values[offset], joined=False)])

    def _one_value(self, value: bytes | ServiceError, *, joined: bool) -> bytes:
        """``value`` if it is one JSON value; else the row's error (400).

        Joined with others into one body whose instances are then counted, a line of numbers
        and brackets is proved one value by its brackets alone: balanced, it starts and ends
        inside the ``instances`` list (a bracket closing the list early leaves text after the
        body's end), so it holds one or more whole values; as many instances as lines, one.
        """
        if isinstance(value, ServiceError):
            raise value
        if joined and self.tensors_only and _balanced_without_strings(value):
            return value
        if value.isspace() or value == b"":
            raise BadRequestError("the line is empty; each line must hold one JSON instance")
        try:
            orjson.loads(value)
        except orjson.JSONDecodeError as error:
            raise BadRequestError(
                f"the line is not one JSON value ({error}); each line must hold one JSON instance"
            ) from None
        return value

    def _json(self, start: int, values: list[bytes]) -> RowsRequest:
        body = b'{"instances":[' + b",".join(values) + b"]}"
        request = HandlerRequest(
            body=body, media_type=JSON_MEDIA_TYPE, content_type=JSON_MEDIA_TYPE
        )
        instances = handled(self.handler.preprocess, request)
        return RowsRequest(start, len(values), instances, request)

    def _arrays(self, start: int, arrays: dict[str, Array]) -> RowsRequest:
        request = HandlerRequest(body=b"", media_type=NPY_MEDIA_TYPE, content_type=NPY_MEDIA_TYPE)
        instances = self.handler.context.layout.check(arrays)
        return RowsRequest(start, len(instances), instances, request)


def _balanced_without_strings(line: bytes) -> bool:
    """Whether ``line`` holds a bracket or brace, no string, and as many closing brackets and
    braces as opening ones (a line without any, a bare number or a blank one, is for
    ``orjson`` to tell apart).

    Read from the line's skeleton, its brackets, braces and quotes in order: one pass over
    the line rather than five, and the lines of a file of alike rows share a few skeletons,
    whose checks are remembered."""
    skeleton = line.translate(None, _NOT_SKELETON)
    return skeleton != b"" and _balanced_skeleton(skeleton)


#: Every byte but brackets, braces and quotes: what ``bytes.translate`` deletes to leave a
#: line's skeleton.
_NOT_SKELETON = bytes(sorted(set(range(256)) - set(b'[]{}"')))


@functools.lru_cache(maxsize=64)
def _balanced_skeleton(skeleton: bytes) -> bool:
    """The counts of ``_balanced_without_strings``, remembered for a few skeletons: what the
    cache holds is at most 64 of them, each no larger than the line it came from."""
    return (
        b'"' not in skeleton
        and skeleton.count(b"[") == skeleton.count(b"]")
        and skeleton.count(b"{") == skeleton.count(b"}")
    )
