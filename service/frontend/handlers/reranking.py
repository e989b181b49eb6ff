"""``RerankHandler``: (query, text) pairs in, one relevance score each out, as a reranker's
``CrossEncoder.predict``.

What ``batchserve package --hf`` names for a cross-encoder: a ``*ForSequenceClassification``
with one label, or a folder ``CrossEncoder`` saved. Each pair is tokenized as one sequence
pair (``[CLS] query [SEP] text [SEP]`` for BERT), truncated longest first to the model's
length, as the hf text handler does; the model answers one logit per pair, and the answer is
that logit through the folder's activation (``Sigmoid`` by default for one label, as
``CrossEncoder``; ``Identity`` gives the logit), or the logit itself with
``?raw_scores=true`` (TEI's ``raw_scores``).

A request names a prompt with ``?prompt_name=`` (``named_prompts``: put before each query,
as ``CrossEncoder`` puts it before a pair's first text), and holds at most
``max_client_batch_size`` pairs (413 above).

Options: the text handler's (``tokenizer_file``, ``max_chars``...), ``activation``
(``"Sigmoid"``, ``"Identity"`` or ``"Tanh"``), ``prompts`` and ``default_prompt_name``.

The engine-side contract, for TEI's ``/rerank`` beside ``/predict``: ``pair_inputs(query,
texts, prompt_name)`` gives the model's inputs, one row per (query, text) pair; the engine
answers a ``score`` (the logit) per row, in order; ``pair_scores(logits, raw)`` turns them into the
answers.

Query parameters: ``raw_scores`` (``true`` or ``false``), ``prompt_name``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from service.errors import InvalidInputError
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.hf_text import HFTextHandler, TextInstance
from service.frontend.handlers.instances import check_texts
from service.frontend.handlers.named_prompts import (
    PROMPT_NAME_PARAMETER,
    NamedPrompts,
    prompt_name_schema,
)
from service.frontend.handlers.text import Cut
from service.tensors import NamedArrays

RAW_SCORES_PARAMETER = "raw_scores"
#: The activations a score may get (``torch.nn`` class names, as the folder names them).
ACTIVATIONS = ("Identity", "Sigmoid", "Tanh")
_BOOLEANS = {"true": True, "false": False}


class RerankHandler(HFTextHandler):
    """(query, text) pairs in, a score each out."""

    query_parameters: ClassVar[frozenset[str]] = frozenset(
        {RAW_SCORES_PARAMETER, PROMPT_NAME_PARAMETER}
    )

    def __init__(
        self,
        context: HandlerContext,
        *,
        activation: str = "Sigmoid",
        prompts: Mapping[str, str] | None = None,
        default_prompt_name: str | None = None,
        **options: Any,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"option activation must be one of {ACTIVATIONS}, got {activation!r}")
        super().__init__(context, postprocess="tensors", **options)
        self.activation = activation
        self.prompts = NamedPrompts(self.tokenizer, prompts or {}, default_prompt_name)
        self.max_texts = context.max_client_batch_size

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        self.raw_scores(request)
        pairs = []
        for index, instance in enumerate(self.instances(request)):
            if not isinstance(instance, tuple):
                raise InvalidInputError(
                    'a reranker scores pairs: send each instance as {"text": query, '
                    f'"text_pair": text}}, got a string at instance {index}'
                )
            pairs.append(instance)
        return self.scored_inputs(
            pairs, request.query.get(PROMPT_NAME_PARAMETER), request.deadline_s
        )

    def pair_inputs(
        self,
        query: str,
        texts: Sequence[str],
        prompt_name: str | None = None,
        deadline_s: float = math.inf,
        *,
        cut: Cut | None = None,
        default_prompt: bool = True,
    ) -> NamedArrays:
        """The model's inputs scoring each of ``texts`` against ``query`` (``scored_inputs``)."""
        pairs = [(query, text) for text in texts]
        return self.scored_inputs(pairs, prompt_name, deadline_s, cut, default_prompt)

    def scored_inputs(
        self,
        pairs: list[tuple[str, str]],
        prompt_name: str | None = None,
        deadline_s: float = math.inf,
        cut: Cut | None = None,
        default_prompt: bool = True,
    ) -> NamedArrays:
        """The model's inputs for ``pairs``, the prompt (``prompt_name``, else the default
        when ``default_prompt``) before each first text, cut as ``cut`` says (None: the
        version's own): 422 for a prompt the version lacks or a pair too long not to cut,
        413 for too many pairs or characters."""
        if self.max_texts is not None:
            check_texts(len(pairs), self.max_texts)
        prompt = self.prompts.text(self.prompts.chosen(prompt_name, default_prompt))
        instances: list[TextInstance] = [(prompt + first, second) for first, second in pairs]
        bounded = self.bounded_instances(instances, deadline_s, cut)
        return self.encode(bounded, deadline_s, cut=cut)

    def postprocess(self, outputs: NamedArrays, request: HandlerRequest) -> list[Any]:
        return self.pair_scores(outputs[self.output], self.raw_scores(request))

    def pair_scores(self, logits: np.ndarray[Any, Any], raw: bool = False) -> list[float]:
        """Each pair's score: its logit through the activation, or the logit when ``raw``."""
        values = np.asarray(logits, dtype=np.float64).reshape(-1)
        if raw or self.activation == "Identity":
            scored = values
        elif self.activation == "Sigmoid":
            scored = 1.0 / (1.0 + np.exp(-values))
        else:
            scored = np.tanh(values)
        return [float(score) for score in scored]

    def raw_scores(self, request: HandlerRequest) -> bool:
        """``?raw_scores=``: ``true`` or ``false`` (422 for anything else); false unless given."""
        text = request.query.get(RAW_SCORES_PARAMETER)
        if text is None:
            return False
        if text not in _BOOLEANS:
            raise InvalidInputError(f"raw_scores must be true or false, got {text!r}")
        return _BOOLEANS[text]

    def describe(self) -> dict[str, Any]:
        description = super().describe()
        items = description["request"]["application/json"]["properties"]["instances"]["items"]
        description["request"]["application/json"]["properties"]["instances"]["items"] = items[
            "anyOf"
        ][1]
        return {
            **description,
            "answers": "scores",
            "activation": self.activation,
            "prompts": self.prompts.prompts,
            "default_prompt_name": self.prompts.default_name,
            "response": {"type": "number", "description": "The pair's relevance score."},
        }

    def query_schemas(self) -> dict[str, dict[str, Any]]:
        prompts = self.prompts
        return {
            RAW_SCORES_PARAMETER: {
                "type": "boolean",
                "description": "true: the model's raw scores, without the activation "
                f"({self.activation}); default false.",
            },
            PROMPT_NAME_PARAMETER: prompt_name_schema(prompts.prompts, prompts.default_name),
        }
