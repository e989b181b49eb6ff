"""``TextHandler``: raw strings in, tokenized by the version's own tokenizer, classified out.

Bodies: ``{"instances": ["some text", ...]}`` as ``application/json``, or ``text/plain`` (the
whole body is one instance, UTF-8). Each string is tokenized with the HuggingFace
``tokenizers`` file packaged with the version (hashed like its weights), and the model's
inputs are built by name: the token ids, and the attention mask and token type ids when the
manifest has such inputs; all padded to the request's longest instance with each input's
``pad_value``. Answers are the classification handler's (top-k labels), or the raw outputs
with ``postprocess="tensors"`` (an encoder).

Options, besides the classification handler's (``output``, ``top_k``, ``apply_softmax``,
``postprocess``):

- ``tokenizer_file`` (default ``"tokenizer.json"``): a file of the version.
- ``ids_input`` (default ``"input_ids"``): the input that receives the token ids.
- ``mask_input`` (default ``"attention_mask"``): the input that receives 1 for each token,
  produced when the manifest has an input of that name.
- ``type_ids_input`` (default ``"token_type_ids"``): likewise, the tokenizer's type ids.
- ``truncate`` (default true): a text longer than the ids input's ``max_length`` tokens is cut
  to its first ``max_length`` (special tokens kept), the tokens ``transformers``' pipelines
  give with ``truncation=True``; false refuses it with 422. A client cannot count tokens
  before sending. A long text is tokenized only as far as those tokens reach
  (``prefixes.PrefixCutter``: a prefix of 32 characters per token, doubled while it holds
  too few), up to ``max_chars`` characters: a text whose first ``max_chars`` characters do not
  hold them (megabytes of spaces, one endless word) is refused with 413.
- ``max_chars`` (default 100,000): the most characters of a text tokenized; without
  truncation a longer text is refused with 413 before any tokenizing.
- ``max_request_chars`` (default 1,000,000): the most characters a request's texts may hold
  together after the cut, and the most tokenized to find the cuts (413 above); about 3 s of
  tokenizing on a loaded 2-core machine.

Texts are tokenized in groups of 64, the request's deadline checked before each.

An empty text gives what the tokenizer gives: ``[CLS] [SEP]`` with a BERT-style
post-processor; a text with no tokens at all is refused (422).

Query parameters: ``top_k`` (classification answers only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer

from service.errors import (
    BadRequestError,
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from service.frontend.handlers.base import HandlerContext, HandlerRequest
from service.frontend.handlers.classification import ClassificationHandler, PostprocessMode
from service.frontend.handlers.instances import (
    content_type_parameter,
    json_instances,
    json_type,
)
from service.frontend.handlers.prefixes import PrefixCutter
from service.frontend.per_token import padded_instances
from service.frontend.preprocessing import check_deadline
from service.manifest import TensorSpec
from service.tensors import NamedArrays
from service.types import Array

TEXT_MEDIA_TYPE = "text/plain"
DEFAULT_MAX_CHARS = 100_000
DEFAULT_MAX_REQUEST_CHARS = 1_000_000
#: Texts tokenized in one call; the deadline is checked between calls.
TEXTS_PER_CALL = 64
_UTF8_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


class TextHandler(ClassificationHandler):
    """Strings in, the model's token inputs by name, top-k labels (or raw tensors) out."""

    media_types: ClassVar[frozenset[str]] = frozenset({"application/json", TEXT_MEDIA_TYPE})
    #: Inputs of the model a subclass fills beside the token inputs (``encode``'s ``extra``).
    filled_inputs: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        context: HandlerContext,
        *,
        tokenizer_file: str = "tokenizer.json",
        ids_input: str = "input_ids",
        mask_input: str = "attention_mask",
        type_ids_input: str = "token_type_ids",
        truncate: bool = True,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_request_chars: int = DEFAULT_MAX_REQUEST_CHARS,
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
        specs = {spec.name: spec for spec in manifest.inputs}
        if ids_input not in specs:
            raise ValueError(
                f"option ids_input names no input of {manifest.label}: {ids_input!r}, "
                f"not in {sorted(specs)}"
            )
        self.ids = specs[ids_input]
        self.mask = specs.get(mask_input)
        self.type_ids = specs.get(type_ids_input)
        produced = {spec.name for spec in (self.ids, self.mask, self.type_ids) if spec}
        missing = sorted(set(specs) - produced - self.filled_inputs)
        if missing:
            raise ValueError(
                f"{manifest.label} has input(s) {missing} that a text handler does not produce "
                "(it gives token ids, an attention mask and token type ids; name them with "
                "options ids_input, mask_input, type_ids_input)"
            )
        for spec in produced:
            if specs[spec].shape != (-1, -1):
                raise ValueError(
                    f"text input {spec!r} must be shaped (-1, -1), got {specs[spec].shape}"
                )
        if tokenizer_file not in manifest.files:
            raise ValueError(
                f"option tokenizer_file {tokenizer_file!r} is not a file of {manifest.label} "
                f"(files: {sorted(manifest.files)}); package it with the version"
            )
        self.tokenizer = Tokenizer.from_file(str(context.folder / tokenizer_file))
        self.max_length = self.ids.max_length
        self.truncate = truncate
        for name, value in (("max_chars", max_chars), ("max_request_chars", max_request_chars)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"option {name} must be a positive integer, got {value!r}")
        self.max_chars = max_chars
        self.max_request_chars = max_request_chars
        self.max_texts: int | None = None
        """Most texts a request holds (413 above), where a subclass sets it."""
        # The handler pads with the manifest's pad values, and cuts to its max_length only.
        self.tokenizer.no_padding()
        if truncate and self.max_length is not None:
            self.tokenizer.enable_truncation(self.max_length)
        else:
            self.tokenizer.no_truncation()
        self.cutter: PrefixCutter | None = None
        """Cuts long texts to what truncation keeps, when truncating."""
        if truncate and self.max_length is not None:
            self.cutter = PrefixCutter(
                self.tokenizer, self.max_length, max_chars, max_request_chars
            )
        largest_id = self.tokenizer.get_vocab_size(with_added_tokens=True) - 1
        if self.ids.max_value is not None and largest_id > self.ids.max_value:
            raise ValueError(
                f"the tokenizer's ids go up to {largest_id}, beyond the max_value "
                f"{self.ids.max_value:g} of input {self.ids.name!r}"
            )

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        self.top_k(request)
        texts = self.bounded(self.texts(request), request.deadline_s)
        return self.encode(texts, request.deadline_s)

    def bounded(self, texts: list[str], deadline_s: float = math.inf) -> list[str]:
        """``texts`` cut to what truncation keeps (``cut``), or refused above ``max_chars``
        each; then ``max_request_chars`` together (413 above)."""
        if self.cutter is not None:
            texts = self.cut(texts, deadline_s)
        else:
            self.check_chars(texts)
        self.check_request_chars(texts)
        return texts

    def cut(self, texts: list[str], deadline_s: float = math.inf) -> list[str]:
        """Each long text cut to the prefix whose tokens, truncated, are the whole text's
        (``PrefixCutter``); 413 for one whose first ``max_chars`` characters do not hold them."""
        assert self.cutter is not None
        cut = []
        for index, text in enumerate(self.cutter.prefixes(texts, deadline_s)):
            if text is None:
                raise self.too_few_tokens(index, texts[index])
            cut.append(text)
        return cut

    def too_few_tokens(self, index: int, text: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"instance {index} is {len(text):,} characters long and its first "
            f"{self.max_chars:,} hold fewer than {self.max_length} tokens (whitespace, or a "
            f"word too long to split); at most {self.max_chars:,} characters of a text are "
            "tokenized"
        )

    def check_chars(self, texts: Sequence[str]) -> None:
        """413 for a text above ``max_chars``, before anything is tokenized."""
        for index, text in enumerate(texts):
            self.check_length(text, f"instance {index}")

    def check_length(self, text: str, what: str) -> None:
        if len(text) > self.max_chars:
            raise PayloadTooLargeError(
                f"{what} is {len(text):,} characters long; at most {self.max_chars:,} are accepted"
            )

    def check_request_chars(self, texts: Sequence[str]) -> None:
        """413 when ``texts`` hold more than ``max_request_chars`` together."""
        total = sum(len(text) for text in texts)
        if total > self.max_request_chars:
            raise PayloadTooLargeError(
                f"the request's {len(texts)} texts hold {total:,} characters together; at most "
                f"{self.max_request_chars:,} are accepted in one request"
            )

    def texts(self, request: HandlerRequest) -> list[str]:
        """The request's strings: the whole ``text/plain`` body, or the JSON instances."""
        if request.media_type == TEXT_MEDIA_TYPE:
            charset = content_type_parameter(request.content_type, "charset")
            if charset is not None and charset.lower() not in _UTF8_CHARSETS:
                raise UnsupportedMediaTypeError(
                    f"send text/plain as UTF-8 (charset=utf-8), got charset={charset!r}"
                )
            try:
                return [request.body.decode("utf-8")]
            except UnicodeDecodeError as error:
                raise BadRequestError(
                    f"the text/plain body is not valid UTF-8: byte {error.start} is "
                    f"{request.body[error.start : error.start + 1]!r}"
                ) from None
        instances = json_instances(request.body, self.context.layout.max_instances, self.max_texts)
        for index, instance in enumerate(instances):
            if not isinstance(instance, str):
                raise InvalidInputError(
                    f"instances must be strings of text, got {json_type(instance)} at "
                    f"instance {index}"
                )
        return instances

    def tokenize(self, texts: Sequence[str], deadline_s: float = math.inf) -> list[Encoding]:
        """``texts`` through the version's tokenizer (a Rust call for each group of
        ``TEXTS_PER_CALL``), unpadded; 504 once ``deadline_s`` has passed between two calls."""
        encodings: list[Encoding] = []
        for start in range(0, len(texts), TEXTS_PER_CALL):
            check_deadline(deadline_s, f"{start} of its {len(texts)} texts were tokenized")
            group = list(texts[start : start + TEXTS_PER_CALL])
            if len(group) == 1:
                encodings.append(self.tokenizer.encode(group[0]))
            else:
                encodings.extend(self.tokenizer.encode_batch(group))
        return encodings

    def encode(
        self,
        texts: Sequence[str],
        deadline_s: float = math.inf,
        extra: Mapping[str, Array] | None = None,
    ) -> NamedArrays:
        """Tokenize ``texts`` into the model's inputs, padded to the longest, with each
        instance's own length (per-token outputs answer each at its length); ``extra``: the
        ``filled_inputs``, a row per text."""
        encodings = self.tokenize(texts, deadline_s)
        lengths = np.fromiter((len(encoding) for encoding in encodings), np.int64, len(texts))
        self._check_lengths(lengths)
        longest = int(lengths.max())
        arrays = {self.ids.name: self._padded([e.ids for e in encodings], self.ids, longest)}
        if self.type_ids is not None:
            type_ids = [e.type_ids for e in encodings]
            arrays[self.type_ids.name] = self._padded(type_ids, self.type_ids, longest)
        if self.mask is not None:
            real = np.arange(longest) < lengths[:, np.newaxis]
            mask = np.where(real, 1, self.mask.pad_value)
            arrays[self.mask.name] = mask.astype(self.mask.numpy_dtype)
        arrays.update(extra or {})
        checked = self.context.layout.check(arrays)
        return padded_instances(checked, lengths, self.context.manifest.inputs)

    def _check_lengths(self, lengths: npt.NDArray[np.int64]) -> None:
        empty = np.flatnonzero(lengths == 0)
        if len(empty):
            raise InvalidInputError(
                f"instance {empty[0]} gives no tokens (empty text); send some text"
            )
        if self.max_length is not None and not self.truncate:
            long = np.flatnonzero(lengths > self.max_length)
            if len(long):
                raise InvalidInputError(
                    f"instance {long[0]} is {lengths[long[0]]} tokens long; at most "
                    f"{self.max_length} are accepted (this version does not truncate)"
                )

    @staticmethod
    def _padded(rows: list[list[int]], spec: TensorSpec, longest: int) -> Array:
        array = np.full((len(rows), longest), spec.pad_value, dtype=spec.numpy_dtype)
        for index, row in enumerate(rows):
            array[index, : len(row)] = row
        return array

    def describe(self) -> dict[str, Any]:
        inputs = [spec.name for spec in (self.ids, self.mask, self.type_ids) if spec]
        return {
            **super().describe(),
            "instances": "strings (application/json), or one text/plain body",
            "inputs": inputs,
            "max_length": self.max_length,
            "truncate": self.truncate,
            "max_chars": self.max_chars,
            "max_request_chars": self.max_request_chars,
            "request": {
                "application/json": _instances_schema(
                    {"type": "string", "description": "A text to classify."},
                    self.context.layout.max_instances,
                ),
                TEXT_MEDIA_TYPE: {"type": "string", "description": "One text, UTF-8."},
            },
        }


def _instances_schema(item: dict[str, Any], max_instances: int) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["instances"],
        "additionalProperties": False,
        "properties": {
            "instances": {"type": "array", "minItems": 1, "maxItems": max_instances, "items": item}
        },
    }
