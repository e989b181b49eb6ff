"""``HFTextHandler``: a ``transformers`` text model's requests, answered as its pipeline does.

What ``batchserve package --hf`` names for text classifiers (``text-classification``; the
reranking handler builds on it). It is the text handler (the folder's ``tokenizer.json``
through the ``tokenizers`` library; no ``transformers`` and no torch in the front end) with
two additions:

- an instance is a string or a pair ``{"text": "...", "text_pair": "..."}``, tokenized as one
  sequence pair (``[CLS] a [SEP] b [SEP]`` for BERT), as the pipeline takes pairs;
- ``scores`` (default ``"softmax"``): ``"sigmoid"`` scores each class alone, which is what the
  ``text-classification`` pipeline does for one label or a ``multi_label_classification``
  config.

Options and query parameters: the text handler's, and ``scores``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from tokenizers import Encoding

from service.errors import InvalidInputError
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.instances import json_instances, json_type
from service.frontend.handlers.text import TEXT_MEDIA_TYPE, TEXTS_PER_CALL, Cut, TextHandler
from service.frontend.preprocessing import check_deadline
from service.tensors import NamedArrays
from service.types import Array

ScoreFunction = Literal["softmax", "sigmoid"]
#: A text, or a text and its pair.
TextInstance = str | tuple[str, str]
_PAIR_KEYS = frozenset({"text", "text_pair"})


class HFTextHandler(TextHandler):
    """Texts or text pairs in; the pipeline's labels and scores (or features) out."""

    media_types: ClassVar[frozenset[str]] = frozenset({"application/json", TEXT_MEDIA_TYPE})

    def __init__(
        self, context: HandlerContext, *, scores: ScoreFunction = "softmax", **options: Any
    ) -> None:
        if scores not in ("softmax", "sigmoid"):
            raise ValueError(f"option scores must be 'softmax' or 'sigmoid', got {scores!r}")
        super().__init__(context, apply_softmax=scores == "softmax", **options)
        self.scores = scores

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        self.top_k(request)
        instances = self.bounded_instances(self.instances(request), request.deadline_s)
        return self.encode(instances, request.deadline_s)

    def bounded_instances(
        self, instances: list[TextInstance], deadline_s: float = math.inf, cut: Cut | None = None
    ) -> list[TextInstance]:
        """Texts cut as the text handler's ``bounded`` cuts them (``cut``: how, None for
        ``self.cut``). A pair's texts are never cut (which of the two truncation shortens
        depends on both whole lengths), so each is at most ``max_chars`` (413 above). All of
        them ``max_request_chars`` together."""
        prefixes = self.cuts_prefixes(cut)
        for index, item in enumerate(instances):
            if isinstance(item, tuple):
                for key, part in zip(("text", "text_pair"), item, strict=True):
                    self.check_length(part, f"instance {index}'s {key} (a pair is not cut)")
            elif not prefixes:
                self.check_length(item, f"instance {index}")
        bounded = list(instances)
        if prefixes:
            assert self.cutter is not None
            texts = {index: item for index, item in enumerate(instances) if isinstance(item, str)}
            cut_texts = self.cutter.prefixes(list(texts.values()), deadline_s)
            for (index, text), prefix in zip(texts.items(), cut_texts, strict=True):
                if prefix is None:
                    raise self.too_few_tokens(index, text)
                bounded[index] = prefix
        self.check_request_chars(
            [part for item in bounded for part in ((item,) if isinstance(item, str) else item)]
        )
        return bounded

    def instances(self, request: HandlerRequest) -> list[TextInstance]:
        """The request's texts and pairs (``text/plain``: the body, one text)."""
        if request.media_type == TEXT_MEDIA_TYPE:
            return list(self.texts(request))
        instances = json_instances(request.body, self.context.layout.max_instances, self.max_texts)
        return [_text_instance(index, instance) for index, instance in enumerate(instances)]

    def encode(
        self,
        texts: Sequence[TextInstance],
        deadline_s: float = math.inf,
        extra: Mapping[str, Array] | None = None,
        cut: Cut | None = None,
    ) -> NamedArrays:
        """The text handler's inputs, for texts and pairs (``tokenize`` takes both)."""
        return super().encode(texts, deadline_s, extra, cut)  # type: ignore[arg-type]

    def tokenize(
        self, texts: Sequence[TextInstance], deadline_s: float = math.inf, cut: Cut | None = None
    ) -> list[Encoding]:
        """A ``tokenizers`` call for each group of ``TEXTS_PER_CALL``; pairs as sequence
        pairs, cut longest first; 504 once ``deadline_s`` has passed between two calls."""
        tokenizer = self.tokenizer_cutting(cut)
        encodings: list[Encoding] = []
        for start in range(0, len(texts), TEXTS_PER_CALL):
            check_deadline(deadline_s, f"{start} of its {len(texts)} texts were tokenized")
            encodings.extend(tokenizer.encode_batch(list(texts[start : start + TEXTS_PER_CALL])))
        return encodings

    def classify(self, scores: np.ndarray[Any, Any], top_k: int) -> list[Any]:
        if self.scores == "softmax":
            return super().classify(scores, top_k)
        probabilities = 1.0 / (1.0 + np.exp(-np.asarray(scores, dtype=np.float64)))
        return super().classify(probabilities, top_k)

    def describe(self) -> dict[str, Any]:
        description = super().describe()
        text = {"type": "string", "description": "A text."}
        pair = {
            "type": "object",
            "required": ["text", "text_pair"],
            "additionalProperties": False,
            "properties": {"text": text, "text_pair": text},
            "description": "A text and its pair, tokenized as one sequence pair.",
        }
        request = description["request"]["application/json"]
        request["properties"]["instances"]["items"] = {"anyOf": [text, pair]}
        return {**description, "scores": self.scores}


def _text_instance(index: int, instance: object) -> TextInstance:
    if isinstance(instance, str):
        return instance
    if (
        isinstance(instance, dict)
        and set(instance) == _PAIR_KEYS
        and all(isinstance(value, str) for value in instance.values())
    ):
        return (instance["text"], instance["text_pair"])
    described = sorted(instance) if isinstance(instance, dict) else json_type(instance)
    raise InvalidInputError(
        f'an instance is a string or {{"text": ..., "text_pair": ...}} of strings, got '
        f"{described} at instance {index}"
    )
