"""``EmbeddingHandler``: texts in, one embedding each out, as ``SentenceTransformer.encode``.

What ``batchserve package --hf`` names for embedding models: a ``sentence-transformers``
folder, or a bare ``*Model`` (mean pooling). It is the text handler (the version's
``tokenizer.json``, truncation to the model's length by tokens) answering the raw
``embedding`` rows, with two additions:

- named prompts (``named_prompts``): ``?prompt_name=query`` puts the version's ``query``
  prompt before each text; without it the version's default prompt applies, or none. When the
  model's pooling leaves the prompt out, the prompt's length in tokens goes to the model as
  its ``prompt_length`` input, a row per text, so texts with different prompts share batches;
- at most ``max_client_batch_size`` texts in one request (413 above, before any tokenizing).

Options: the text handler's (``tokenizer_file``, ``truncate``, ``max_chars``,
``max_request_chars``), ``prompts`` (name to text), ``default_prompt_name`` and
``similarity_fn_name`` (how the folder compares embeddings: said in the description).

The engine-side contract, for routes beside ``/predict`` (OpenAI's ``/v1/embeddings``, TEI's
``/embed``): ``text_inputs(texts, prompt_name)`` gives the model's inputs, one row per text;
``id_inputs(rows)`` the same for texts already tokenized (OpenAI's token-id inputs);
``token_counts`` each text's tokens (prompt and special tokens included: what the model
read); the engine answers an ``embedding`` row per text, in order; ``normalized`` says
whether the version's last step is ``Normalize`` (its rows have unit length).

Query parameters: ``prompt_name``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from service.errors import InvalidInputError
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.instances import check_texts
from service.frontend.handlers.named_prompts import (
    PROMPT_NAME_PARAMETER,
    NamedPrompts,
    prompt_name_schema,
)
from service.frontend.handlers.text import Cut, TextHandler
from service.frontend.per_token import PaddedInstances, padded_instances
from service.tensors import NamedArrays

PROMPT_LENGTH_INPUT = "prompt_length"


class EmbeddingHandler(TextHandler):
    """Texts in (a prompt before each when named), the model's ``embedding`` rows out."""

    query_parameters: ClassVar[frozenset[str]] = frozenset({PROMPT_NAME_PARAMETER})
    filled_inputs: ClassVar[frozenset[str]] = frozenset({PROMPT_LENGTH_INPUT})

    def __init__(
        self,
        context: HandlerContext,
        *,
        prompts: Mapping[str, str] | None = None,
        default_prompt_name: str | None = None,
        similarity_fn_name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(context, postprocess="tensors", **options)
        self.prompts = NamedPrompts(self.tokenizer, prompts or {}, default_prompt_name)
        self.similarity_fn_name = similarity_fn_name
        self.max_texts = context.max_client_batch_size
        self.prompt_length = next(
            (spec for spec in context.manifest.inputs if spec.name == PROMPT_LENGTH_INPUT), None
        )
        """The input taking each row's prompt tokens, when the pooling leaves them out."""
        architecture = context.manifest.architecture
        steps = architecture.kwargs.get("steps") if architecture is not None else None
        self.normalized = (
            isinstance(steps, list) and bool(steps) and steps[-1].get("kind") == ("normalize")
        )
        """Whether the version's last step is ``Normalize``: each row has unit length."""

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        return self.text_inputs(
            self.texts(request), request.query.get(PROMPT_NAME_PARAMETER), request.deadline_s
        )

    def text_inputs(
        self,
        texts: list[str],
        prompt_name: str | None = None,
        deadline_s: float = math.inf,
        *,
        cut: Cut | None = None,
        default_prompt: bool = True,
    ) -> NamedArrays:
        """The model's inputs for ``texts``, each after the prompt ``prompt_name`` (or the
        default, when ``default_prompt``), cut as ``cut`` says (None: the version's own): 422
        for a prompt the version lacks or a text too long not to cut, 413 for too many texts
        or characters."""
        if self.max_texts is not None:
            check_texts(len(texts), self.max_texts)
        name = self.prompts.chosen(prompt_name, default_prompt)
        prompt = self.prompts.text(name)
        extra = {}
        if self.prompt_length is not None:
            if prompt and cut == "left":
                raise InvalidInputError(
                    f"truncation_direction left would cut the prompt {name!r} off a long text, "
                    "and this model's pooling leaves the prompt's tokens out: cut from the right"
                )
            length = self.prompts.length(name)
            extra[PROMPT_LENGTH_INPUT] = np.full(len(texts), length, self.prompt_length.numpy_dtype)
        bounded = self.bounded([prompt + text for text in texts], deadline_s, cut)
        return self.encode(bounded, deadline_s, extra, cut)

    def id_inputs(self, rows: list[list[int]], cut: Cut | None = None) -> NamedArrays:
        """The model's inputs for texts already tokenized: each row of token ids as given (no
        prompt, no special tokens added), cut to the model's length as ``cut`` says (None: as
        the version truncates): 422 for an empty row, an id outside the vocabulary or a row
        too long not to cut, 413 for too many."""
        if self.max_texts is not None:
            check_texts(len(rows), self.max_texts)
        vocabulary = self.tokenizer.get_vocab_size(with_added_tokens=True)
        for index, row in enumerate(rows):
            outside = next((token for token in row if not 0 <= token < vocabulary), None)
            if outside is not None:
                raise InvalidInputError(
                    f"token id {outside} of input {index} is outside this model's vocabulary "
                    f"(0 to {vocabulary - 1})"
                )
        limit = self.max_length
        if limit is not None and (cut or self.cut) == "right":
            rows = [row[:limit] for row in rows]
        elif limit is not None and cut == "left":
            rows = [row[-limit:] for row in rows]
        lengths = np.fromiter((len(row) for row in rows), np.int64, len(rows))
        self._check_lengths(lengths, cut)
        longest = int(lengths.max())
        arrays = {self.ids.name: self._padded(rows, self.ids, longest)}
        real = np.arange(longest) < lengths[:, np.newaxis]
        if self.type_ids is not None:
            type_ids = np.where(real, 0, self.type_ids.pad_value)
            arrays[self.type_ids.name] = type_ids.astype(self.type_ids.numpy_dtype)
        if self.mask is not None:
            mask = np.where(real, 1, self.mask.pad_value)
            arrays[self.mask.name] = mask.astype(self.mask.numpy_dtype)
        if self.prompt_length is not None:
            arrays[PROMPT_LENGTH_INPUT] = np.zeros(len(rows), self.prompt_length.numpy_dtype)
        checked = self.context.layout.check(arrays)
        return padded_instances(checked, lengths, self.context.manifest.inputs)

    def token_counts(self, inputs: NamedArrays) -> list[int]:
        """Each text's tokens in ``inputs`` (``text_inputs``'), for usage counts."""
        if isinstance(inputs, PaddedInstances):
            return [int(length) for length in inputs.lengths]
        ids = inputs[self.ids.name]
        return [int(ids.shape[1])] * len(ids)

    def describe(self) -> dict[str, Any]:
        description = super().describe()
        description["request"]["application/json"]["properties"]["instances"]["items"] = {
            "type": "string",
            "description": "A text to embed.",
        }
        dimensions = self.context.manifest.output.shape[-1]
        return {
            **description,
            "answers": "embeddings",
            "response": {
                "type": "array",
                "items": {"type": "number"},
                "minItems": dimensions,
                "maxItems": dimensions,
                "description": "The text's embedding.",
            },
            "prompts": self.prompts.prompts,
            "default_prompt_name": self.prompts.default_name,
            "similarity_fn_name": self.similarity_fn_name,
        }

    def query_schemas(self) -> dict[str, dict[str, Any]]:
        prompts = self.prompts
        return {PROMPT_NAME_PARAMETER: prompt_name_schema(prompts.prompts, prompts.default_name)}
