"""``ClassificationHandler``: tensors in, the top-k labels with their probabilities out.

Each instance is answered ``[{"label": "positive", "score": 0.93}, ...]``, best first. The
labels are the output's ``labels`` in the manifest (the class indices as strings without
them); ``k`` is the request's ``?top_k=`` or the ``top_k`` option. The text and image
handlers inherit this answer and replace only ``preprocess``.

Options (the manifest's ``handler.options``):

- ``output``: the output to classify from; default the first output with ``labels``, else the
  first output. It must be shaped ``(-1, classes)``.
- ``top_k`` (default 1): how many classes each instance is answered with when the request
  does not say; the single best class is what most clients want.
- ``apply_softmax`` (default true): false when the model outputs probabilities already.
- ``postprocess`` (default ``"classification"``): ``"tensors"`` answers the raw outputs as the
  base handler does, for a model with no classes (an encoder) behind a text or image handler.

Query parameters: ``top_k``, an integer from 1 to the number of classes.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

import numpy as np

from service.errors import InvalidInputError
from service.frontend.handlers.base import (
    Handler,
    HandlerContext,
    HandlerRequest,
    output_rows,
    softmax,
)
from service.manifest import Manifest, TensorSpec
from service.tensors import NamedArrays

PostprocessMode = Literal["classification", "tensors"]
_TOP_K_PATTERN = re.compile(r"^[0-9]{1,9}$")


class ClassificationHandler(Handler):
    """Tensors in (as the base handler), top-k ``{"label", "score"}`` lists out."""

    query_parameters: ClassVar[frozenset[str]] = frozenset({"top_k"})

    def __init__(
        self,
        context: HandlerContext,
        *,
        output: str | None = None,
        top_k: int = 1,
        apply_softmax: bool = True,
        postprocess: PostprocessMode = "classification",
    ) -> None:
        super().__init__(context)
        if postprocess not in ("classification", "tensors"):
            raise ValueError(
                f"option postprocess must be 'classification' or 'tensors', got {postprocess!r}"
            )
        self.classifies = postprocess == "classification"
        spec = _classified_output(context.manifest, output)
        self.output = spec.name
        self.classes = spec.shape[-1]
        self.labels: tuple[str, ...] = spec.labels or tuple(str(i) for i in range(self.classes))
        if self.classifies and (self.classes < 1 or len(spec.shape) != 2):
            raise ValueError(
                f"output {spec.name!r} must be shaped (-1, classes) to be classified, got "
                f"{spec.shape}; choose another with option 'output', or postprocess='tensors'"
            )
        if self.classifies and not 1 <= top_k <= self.classes:
            raise ValueError(f"option top_k must be from 1 to {self.classes}, got {top_k!r}")
        self.default_top_k = top_k
        self.apply_softmax = apply_softmax

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        """The base handler's tensors, once ``?top_k=`` is known to be valid: a bad query is
        refused before the model runs."""
        self.top_k(request)
        return super().preprocess(request)

    def postprocess(self, outputs: NamedArrays, request: HandlerRequest) -> list[Any]:
        if not self.classifies:
            return output_rows(outputs)
        return self.classify(outputs[self.output], self.top_k(request))

    def top_k(self, request: HandlerRequest) -> int:
        """``?top_k=`` when given (an integer from 1 to the number of classes), else the
        option; 422 for anything else, quoting the value."""
        text = request.query.get("top_k")
        if text is None:
            return self.default_top_k
        if not self.classifies:
            raise InvalidInputError(
                "top_k applies to classification answers; this version answers its raw "
                "output tensors (handler option postprocess='tensors')"
            )
        top_k = int(text) if _TOP_K_PATTERN.fullmatch(text) else 0
        if not 1 <= top_k <= self.classes:
            raise InvalidInputError(
                f"top_k must be an integer from 1 to {self.classes} (the model's classes), "
                f"got {text!r}"
            )
        return top_k

    def query_schemas(self) -> dict[str, dict[str, Any]]:
        return {
            "top_k": {
                "type": "integer",
                "minimum": 1,
                "maximum": self.classes,
                "description": "How many classes to answer per instance, best first "
                f"(default {self.default_top_k}); classification answers only.",
            }
        }

    def classify(self, scores: np.ndarray[Any, Any], top_k: int) -> list[Any]:
        """Per row, the ``top_k`` best ``{"label", "score"}``, best first (ties: lower index)."""
        probabilities = softmax(scores) if self.apply_softmax else np.asarray(scores, np.float64)
        best = np.argsort(-probabilities, axis=-1, kind="stable")[:, :top_k]
        chosen = np.take_along_axis(probabilities, best, axis=-1).tolist()
        labels = self.labels
        return [
            [
                {"label": labels[index], "score": score}
                for index, score in zip(indices, row_scores, strict=True)
            ]
            for indices, row_scores in zip(best.tolist(), chosen, strict=True)
        ]

    def describe(self) -> dict[str, Any]:
        if not self.classifies:
            return {**super().describe(), "answers": "tensors"}
        return {
            **super().describe(),
            "answers": "classification",
            "output": self.output,
            "labels": list(self.labels),
            "top_k": self.default_top_k,
            "response": {
                "type": "array",
                "minItems": 1,
                "maxItems": self.classes,
                "description": f"The top_k classes (default {self.default_top_k}), best first.",
                "items": {
                    "type": "object",
                    "required": ["label", "score"],
                    "properties": {
                        "label": {"type": "string", "enum": list(self.labels)},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                },
            },
        }


def _classified_output(manifest: Manifest, name: str | None) -> TensorSpec:
    """The output named ``name``; by default the first with labels, else the first."""
    if name is None:
        return next((spec for spec in manifest.outputs if spec.labels), manifest.output)
    for spec in manifest.outputs:
        if spec.name == name:
            return spec
    names = [spec.name for spec in manifest.outputs]
    raise ValueError(f"option output names no output of {manifest.label}: {name!r}, not in {names}")
