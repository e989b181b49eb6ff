"""``TokenClassificationHandler``: raw strings in, each token's label with its place in the text
out, as Hugging Face's ``token-classification`` pipeline answers.

Bodies are the text handler's (``{"instances": ["some text", ...]}`` or one ``text/plain``
body), tokenized the same way. The model returns per-token scores, an output shaped
``(-1, -1, classes)`` whose ``length_of`` names the ids input. Each instance is answered with
a list, one entry per token, special tokens (``[CLS]``, ``[SEP]``) and padding never
included::

    {"entity": "B-LOC", "score": 0.98, "index": 3, "word": "paris", "start": 10, "end": 15}

``entity`` is the best label (the output's ``labels``, else the class index), ``score`` its
probability, ``index`` the token's position among the model's tokens (special tokens
counted, as HF counts them), ``word`` the token as the vocabulary writes it (``##ing``; the
text itself for an unknown token) and ``start``/``end`` its characters in the text
(``text[start:end]``). With ``aggregation_strategy="simple"`` adjacent tokens of one entity
are grouped as HF's ``"simple"`` strategy groups them (a ``B-`` label starts a new entity, an
``I-`` label or a bare label continues one of the same type)::

    {"entity_group": "LOC", "score": 0.97, "word": "new york", "start": 10, "end": 18}

where ``score`` is the mean of its tokens' scores and ``word`` its tokens joined by the
tokenizer's decoder (space-joined without one). Entries whose label is in ``ignore_labels``
are left out after grouping, as in HF.

Options, besides the text handler's tokenizing options (``tokenizer_file``, ``ids_input``,
``mask_input``, ``type_ids_input``, ``truncate``):

- ``output``: the per-token scores; default the first output with ``labels``, else the
  first output.
- ``apply_softmax`` (default true): false when the model outputs probabilities already.
- ``aggregation_strategy`` (default ``"none"``): ``"none"`` (one entry per token) or
  ``"simple"`` (entities), when the request does not say.
- ``ignore_labels`` (default ``["O"]``): labels never answered (HF's default too).

Query parameters: ``aggregation_strategy`` (``none`` or ``simple``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from tokenizers import Encoding

from service.errors import InvalidInputError
from service.frontend.handlers.base import HandlerContext, HandlerRequest, softmax
from service.frontend.handlers.text import TextHandler, _instances_schema
from service.tensors import NamedArrays

AggregationStrategy = Literal["none", "simple"]
_STRATEGIES: tuple[AggregationStrategy, ...] = ("none", "simple")


class TokenClassificationHandler(TextHandler):
    """Strings in, per-token labels with character offsets (or grouped entities) out."""

    query_parameters: ClassVar[frozenset[str]] = frozenset({"aggregation_strategy"})

    def __init__(
        self,
        context: HandlerContext,
        *,
        tokenizer_file: str = "tokenizer.json",
        ids_input: str = "input_ids",
        mask_input: str = "attention_mask",
        type_ids_input: str = "token_type_ids",
        truncate: bool = True,
        output: str | None = None,
        apply_softmax: bool = True,
        aggregation_strategy: AggregationStrategy = "none",
        ignore_labels: Sequence[str] = ("O",),
    ) -> None:
        super().__init__(
            context,
            tokenizer_file=tokenizer_file,
            ids_input=ids_input,
            mask_input=mask_input,
            type_ids_input=type_ids_input,
            truncate=truncate,
            output=output,
            apply_softmax=apply_softmax,
            postprocess="tensors",
        )
        spec = next(spec for spec in context.manifest.outputs if spec.name == self.output)
        if len(spec.shape) != 3 or spec.shape[1] != -1 or spec.shape[2] < 1:
            raise ValueError(
                f"output {spec.name!r} must be per-token scores shaped (-1, -1, classes), got "
                f"{spec.shape}; choose another with option 'output'"
            )
        if spec.length_of != self.ids.name:
            raise ValueError(
                f"output {spec.name!r} must follow the length of input {self.ids.name!r} "
                f"(length_of={self.ids.name!r} in the manifest), got length_of={spec.length_of!r}"
            )
        self.default_strategy = _strategy(aggregation_strategy, "option aggregation_strategy")
        if isinstance(ignore_labels, str) or not all(isinstance(x, str) for x in ignore_labels):
            raise ValueError(
                f"option ignore_labels must be a list of labels, got {ignore_labels!r}"
            )
        self.ignore_labels = frozenset(ignore_labels)
        unknown = getattr(self.tokenizer.model, "unk_token", None)
        self.unknown_id = self.tokenizer.token_to_id(unknown) if isinstance(unknown, str) else None

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        self.strategy(request)  # a bad query is refused before the model runs
        texts = self.bounded(self.texts(request), request.deadline_s)
        return self.encode(texts, request.deadline_s)

    def strategy(self, request: HandlerRequest) -> AggregationStrategy:
        """``?aggregation_strategy=`` when given, else the option; 422 for another value."""
        text = request.query.get("aggregation_strategy")
        if text is None:
            return self.default_strategy
        return _strategy(text, "query parameter aggregation_strategy", InvalidInputError)

    def query_schemas(self) -> dict[str, dict[str, Any]]:
        return {
            "aggregation_strategy": {
                "type": "string",
                "enum": ["none", "simple"],
                "description": "none: an entry per token; simple: adjacent tokens of one "
                f"entity grouped (default {self.default_strategy}).",
            }
        }

    def postprocess(self, outputs: NamedArrays, request: HandlerRequest) -> list[Any]:
        """Per instance, its tokens' entries (or entities). The texts are tokenized again
        for their offsets: the handler keeps no state between a request's two steps, and
        tokenizing costs microseconds beside the forward."""
        texts = self.bounded(self.texts(request))  # as preprocess tokenized them
        strategy = self.strategy(request)
        scores = outputs[self.output]
        answers = []
        for index, (text, encoding) in enumerate(zip(texts, self.tokenize(texts), strict=True)):
            tokens = self._tokens(text, encoding, scores[index, : len(encoding.ids)])
            if strategy == "simple":
                tokens = [self._entity(group) for group in _groups(tokens)]
            answers.append([token for token in tokens if _label(token) not in self.ignore_labels])
        return answers

    def _tokens(self, text: str, encoding: Encoding, scores: Any) -> list[dict[str, Any]]:
        """One entry per token of ``encoding`` that is not a special token (HF's
        ``gather_pre_entities`` then ``aggregate`` with no strategy)."""
        probabilities = softmax(scores) if self.apply_softmax else np.asarray(scores, np.float64)
        best = probabilities.argmax(axis=-1).tolist()
        entries = []
        for index, special in enumerate(encoding.special_tokens_mask):
            if special:
                continue
            start, end = encoding.offsets[index]
            word = encoding.tokens[index]
            if encoding.ids[index] == self.unknown_id:
                word = text[start:end]
            label = best[index]
            entries.append(
                {
                    "entity": self.labels[label],
                    "score": float(probabilities[index, label]),
                    "index": index,
                    "word": word,
                    "start": start,
                    "end": end,
                }
            )
        return entries

    def _entity(self, tokens: list[dict[str, Any]]) -> dict[str, Any]:
        """Adjacent tokens of one entity as one (HF's ``group_sub_entities``)."""
        words = [token["word"] for token in tokens]
        decoder = self.tokenizer.decoder
        return {
            "entity_group": tokens[0]["entity"].split("-", 1)[-1],
            "score": float(np.mean([token["score"] for token in tokens])),
            "word": decoder.decode(words) if decoder is not None else " ".join(words),
            "start": tokens[0]["start"],
            "end": tokens[-1]["end"],
        }

    def describe(self) -> dict[str, Any]:
        token = {
            "type": "object",
            "properties": {
                "entity": {"type": "string", "enum": list(self.labels)},
                "entity_group": {"type": "string"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "index": {"type": "integer", "minimum": 0},
                "word": {"type": "string"},
                "start": {"type": "integer", "minimum": 0},
                "end": {"type": "integer", "minimum": 0},
            },
            "required": ["score", "word", "start", "end"],
        }
        return {
            **super().describe(),
            "answers": "token_classification",
            "output": self.output,
            "labels": list(self.labels),
            "aggregation_strategy": self.default_strategy,
            "ignore_labels": sorted(self.ignore_labels),
            "request": {
                "application/json": _instances_schema(
                    {"type": "string", "description": "A text to tag."},
                    self.context.layout.max_instances,
                ),
                "text/plain": {"type": "string", "description": "One text, UTF-8."},
            },
            "response": {
                "type": "array",
                "items": token,
                "description": "Each token (entity, index) or, with aggregation_strategy="
                "simple, each entity (entity_group), in text order; special tokens, padding "
                "and ignore_labels left out.",
            },
        }


def _strategy(
    value: object, where: str, error: type[Exception] = ValueError
) -> AggregationStrategy:
    for strategy in _STRATEGIES:
        if value == strategy:
            return strategy
    raise error(f"{where} must be 'none' or 'simple', got {value!r}")


def _label(entry: dict[str, Any]) -> str:
    return str(entry.get("entity", entry.get("entity_group")))


def _tag(label: str) -> tuple[str, str]:
    """(``B`` or ``I``, entity type) of a label; a bare label continues (HF's ``get_tag``)."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _groups(tokens: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Adjacent tokens of one entity together: a token joins the group before it when its
    type is the same and its label does not begin an entity (HF's ``group_entities``)."""
    groups: list[list[dict[str, Any]]] = []
    for token in tokens:
        begins, kind = _tag(token["entity"])
        if groups and kind == _tag(groups[-1][-1]["entity"])[1] and begins != "B":
            groups[-1].append(token)
        else:
            groups.append([token])
    return groups
