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
  hold them (megabytes of spaces, one endless word) is refused with 413. Routes that let a
  request choose (TEI's ``truncate`` and ``truncation_direction``; OpenAI's, which never
  cuts) pass a ``Cut`` of their own: ``right`` (as above), ``left`` (a text's last tokens
  kept, special tokens added after the cut, as ``tokenizers`` truncates from the left) or
  ``none`` (422 above ``max_length``).
- ``max_chars`` (default 100,000): the most characters of a text tokenized; without
  truncation a longer text is refused with 413 before any tokenizing.
- ``max_request_chars`` (default 1,000,000): the most characters a request's texts may hold
  together after the cut, and the most tokenized to find the cuts (413 above); about 3 s of
  tokenizing on a loaded 2-core machine.

Texts are tokenized in groups of 64, the request's deadline checked before each. A text cut
from the left, or refused when too long, is tokenized whole (up to ``max_chars``).

An empty text gives what the tokenizer gives: ``[CLS] [SEP]`` with a BERT-style
post-processor; a text with no tokens at all is refused (422).

Query parameters: ``top_k`` (classification answers only).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

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

Cut = Literal["right", "left", "none"]
"""Where a text over the model's length loses tokens: its end (``right``: its first tokens
kept), its start (``left``: its last kept), or nowhere (``none``: refused, 422)."""


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
        self.cut: Cut = "right" if truncate else "none"
        """How this version cuts a text when a request does not say (option ``truncate``)."""
        for name, value in (("max_chars", max_chars), ("max_request_chars", max_request_chars)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"option {name} must be a positive integer, got {value!r}")
        self.max_chars = max_chars
        self.max_request_chars = max_request_chars
        self.max_texts: int | None = None
        """Most texts a request holds (413 above), where a subclass sets it."""
        # The handler pads with the manifest's pad values, and cuts to its max_length only.
        self.tokenizer.no_padding()
        _set_cut(self.tokenizer, self.cut, self.max_length)
        self._tokenizers: dict[Cut, Tokenizer] = {self.cut: self.tokenizer}
        """A copy of the tokenizer for each other ``Cut`` a request asked for."""
        self._copying = threading.Lock()
        self.cutter: PrefixCutter | None = None
        """Cuts long texts to what truncation from the right keeps."""
        if self.max_length is not None:
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

    def bounded(
        self, texts: list[str], deadline_s: float = math.inf, cut: Cut | None = None
    ) -> list[str]:
        """``texts`` cut to what truncation from the right keeps (``prefixes``), or refused
        above ``max_chars`` each; then ``max_request_chars`` together (413 above). ``cut``:
        how long texts will be cut (None: ``self.cut``)."""
        if self.cuts_prefixes(cut):
            texts = self.prefixes(texts, deadline_s)
        else:
            self.check_chars(texts)
        self.check_request_chars(texts)
        return texts

    def cuts_prefixes(self, cut: Cut | None) -> bool:
        """Whether texts cut as ``cut`` says may be shortened to prefixes first."""
        return self.cutter is not None and (cut or self.cut) == "right"

    def prefixes(self, texts: list[str], deadline_s: float = math.inf) -> list[str]:
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

    def tokenize(
        self, texts: Sequence[str], deadline_s: float = math.inf, cut: Cut | None = None
    ) -> list[Encoding]:
        """``texts`` through the version's tokenizer (a Rust call for each group of
        ``TEXTS_PER_CALL``), unpadded, cut as ``cut`` says (None: ``self.cut``); 504 once
        ``deadline_s`` has passed between two calls."""
        tokenizer = self.tokenizer_cutting(cut)
        encodings: list[Encoding] = []
        for start in range(0, len(texts), TEXTS_PER_CALL):
            check_deadline(deadline_s, f"{start} of its {len(texts)} texts were tokenized")
            group = list(texts[start : start + TEXTS_PER_CALL])
            if len(group) == 1:
                encodings.append(tokenizer.encode(group[0]))
            else:
                encodings.extend(tokenizer.encode_batch(group))
        return encodings

    def tokenizer_cutting(self, cut: Cut | None) -> Tokenizer:
        """The version's tokenizer, cutting texts as ``cut`` says (None: ``self.cut``): a
        copy made the first time a request asks for another cut than the version's."""
        cut = cut or self.cut
        tokenizer = self._tokenizers.get(cut)
        if tokenizer is None:
            with self._copying:  # handler threads share the handler
                tokenizer = self._tokenizers.get(cut)
                if tokenizer is None:
                    tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
                    _set_cut(tokenizer, cut, self.max_length)
                    self._tokenizers[cut] = tokenizer
        return tokenizer

    def encode(
        self,
        texts: Sequence[str],
        deadline_s: float = math.inf,
        extra: Mapping[str, Array] | None = None,
        cut: Cut | None = None,
    ) -> NamedArrays:
        """Tokenize ``texts`` into the model's inputs, padded to the longest, with each
        instance's own length (per-token outputs answer each at its length); ``extra``: the
        ``filled_inputs``, a row per text; ``cut``: how a long text is cut (None:
        ``self.cut``)."""
        encodings = self.tokenize(texts, deadline_s, cut)
        lengths = np.fromiter((len(encoding) for encoding in encodings), np.int64, len(texts))
        self._check_lengths(lengths, cut)
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

    def _check_lengths(self, lengths: npt.NDArray[np.int64], cut: Cut | None = None) -> None:
        """422 for a text of no tokens, and for one over ``max_length`` when ``cut`` (None:
        ``self.cut``) is ``none``."""
        empty = np.flatnonzero(lengths == 0)
        if len(empty):
            raise InvalidInputError(
                f"instance {empty[0]} gives no tokens (empty text); send some text"
            )
        if self.max_length is None or (cut or self.cut) != "none":
            return
        long = np.flatnonzero(lengths > self.max_length)
        if not len(long):
            return
        index, length = int(long[0]), int(lengths[long[0]])
        if cut is None:
            raise InvalidInputError(
                f"instance {index} is {length} tokens long; at most {self.max_length} are "
                "accepted (this version does not truncate)"
            )
        raise InvalidInputError(
            f"input {index} is {length} tokens long, more than the {self.max_length} this "
            "model reads, and the request does not let it be truncated"
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


def _set_cut(tokenizer: Tokenizer, cut: Cut, max_length: int | None) -> None:
    """``tokenizer`` set to cut texts to ``max_length`` tokens as ``cut`` says."""
    if cut == "none" or max_length is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length, direction=cut)


def _instances_schema(item: dict[str, Any], max_instances: int) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["instances"],
        "additionalProperties": False,
        "properties": {
            "instances": {"type": "array", "minItems": 1, "maxItems": max_instances, "items": item}
        },
    }
