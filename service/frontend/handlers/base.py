"""``Handler``: a version's own pre- and post-processing, run in the front ends.

A handler turns a request body into the model's named input tensors (``preprocess``) and the
model's output rows into the JSON each instance is answered with (``postprocess``). It runs in
every front end, never in the engine's device thread, so tokenizing or decoding images uses
every core while the engine batches tensors. The base class does what a version without a
handler does: tensors in (JSON, ``.npy`` or ``.npz``), tensors out.

A handler is operator configuration, packaged and hashed with the version (``HandlerSpec``):
its class is named by the manifest, its options come from the manifest, and a request can
only send it a body and the query parameters it chooses to read. Raise the service's errors
(``InvalidInputError`` for 422, ``BadRequestError`` for 400, ``UnsupportedMediaTypeError``,
``PayloadTooLargeError``) for what the client got wrong; any other exception is answered 500
and logged, and never fails another request. ``preprocess`` runs in a handler thread (a small
tensor body excepted), never on the event loop; one that loops over costly steps calls
``request.check_deadline`` between them, so a request nobody waits for any more stops.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from service.bundled import import_attribute
from service.errors import ModelLoadError
from service.frontend.inputs import InputLayout
from service.frontend.per_token import PaddedInstances
from service.frontend.preprocessing import check_deadline
from service.manifest import Manifest
from service.tensors import NamedArrays


@dataclass(frozen=True)
class HandlerContext:
    """What a handler is built with: the version it serves and its verified files."""

    manifest: Manifest
    folder: Path
    """Where the version's files are: ``folder / "tokenizer.json"``. Served, a private copy
    of the files but the weights, written from the bytes whose hashes were checked, kept as
    long as the handler."""
    layout: InputLayout
    """Parses and validates tensors against the manifest's inputs (the default preprocess)."""
    max_client_batch_size: int | None = None
    """Most texts an embedding or reranking request may carry (the ``max_client_batch_size``
    setting; None: only ``layout.max_instances``)."""


@dataclass(frozen=True)
class HandlerRequest:
    """One ``/predict`` request as a handler sees it."""

    body: bytes
    media_type: str
    """The ``Content-Type`` without parameters, lower case (``image/png``)."""
    content_type: str
    """The whole ``Content-Type`` header (a multipart body's boundary is a parameter)."""
    query: Mapping[str, str] = field(default_factory=dict)
    """The URL's query parameters (``?top_k=3``); each handler reads only those it documents."""
    deadline_s: float = math.inf
    """When the request must be answered (``time.monotonic()``); past it, its answer is 504."""

    def check_deadline(self, what: str) -> None:
        """504 once the deadline has passed: a handler calls it between costly steps (each
        image, each group of texts), so work nobody waits for stops soon."""
        check_deadline(self.deadline_s, what)


class Handler:
    """Tensors in, tensors out; subclasses override ``preprocess`` and/or ``postprocess``."""

    #: Media types ``preprocess`` reads; others are answered 415 before the body is read.
    media_types: ClassVar[frozenset[str]] = frozenset(
        {"application/json", "application/x-npy", "application/octet-stream", "application/x-npz"}
    )
    #: Query parameters the handler reads; any other is answered 422 (a typo must not pass
    #: silently).
    query_parameters: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, context: HandlerContext, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")
        self.context = context

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        """The body as the model's named input tensors, validated (one row per instance)."""
        return self.context.layout.parse(request.body, request.media_type)

    def postprocess(self, outputs: NamedArrays, request: HandlerRequest) -> list[Any]:
        """One JSON value per instance: the output row (one output), or an object keyed by
        output name (several)."""
        return output_rows(outputs)

    def describe(self) -> dict[str, Any]:
        """What the OpenAPI schema says about this handler's requests and answers."""
        return {"handler": type(self).__name__}

    def query_schemas(self) -> dict[str, dict[str, Any]]:
        """The JSON schema (with a description) of each of ``query_parameters`` that says
        more than "a string": the OpenAPI document declares each of ``query_parameters``
        with its schema from here."""
        return {}


def build_handler(context: HandlerContext) -> Handler:
    """The handler the context's version names (its class imported from the version's folder
    or batchserve, built with the manifest's options), or the base ``Handler`` when it names
    none. Raises ``ModelLoadError`` for a class that is not a ``Handler``, and whatever the
    operator's constructor raises."""
    spec = context.manifest.handler
    if spec is None:
        return Handler(context)
    cls = import_attribute(spec.import_path, context.manifest, context.folder)
    if not (isinstance(cls, type) and issubclass(cls, Handler)):
        raise ModelLoadError(
            f"{spec.import_path!r} is not a subclass of service.frontend.handlers.base.Handler"
        )
    handler: Handler = cls(context, **spec.options)
    return handler


def output_rows(outputs: NamedArrays) -> list[Any]:
    """Per instance: the bare row of a single output, or ``{name: row}`` for several (a
    per-token output at the instance's own length)."""
    if isinstance(outputs, PaddedInstances):
        return outputs.rows()
    if len(outputs.names) == 1:
        return list(outputs[outputs.names[0]])
    return [{name: outputs[name][index] for name in outputs.names} for index in range(len(outputs))]


def softmax(logits: np.ndarray[Any, np.dtype[Any]]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Softmax over the last axis, in float64 (stable: the maximum is subtracted first)."""
    values = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(values - values.max(axis=-1, keepdims=True))
    result: np.ndarray[Any, np.dtype[np.float64]] = shifted / shifted.sum(axis=-1, keepdims=True)
    return result
