"""Long texts cut to a prefix that truncation turns into the same tokens as the whole text.

A truncating text handler keeps a text's first ``max_length`` tokens, as ``transformers``'
pipelines do (``truncation=True``). Tokenizing a megabyte to keep 128 tokens costs seconds, so
it tokenizes a prefix instead: 32 characters per token to begin with, doubled while the prefix
holds fewer than ``max_length`` tokens before its last two words (the word the cut falls in,
and the one before it, whose split may depend on what follows). The tokens truncation keeps
then come from words the prefix holds whole, so they are the whole text's. Leading
whitespace, invisible characters or one long word (a URL, base64) before the text only make
the prefix longer.

The work is bounded: a text is tokenized up to its first ``max_chars`` characters, and a
request's prefixes up to ``max_request_chars`` characters together (413 beyond); a text whose
first ``max_chars`` characters do not hold the tokens is reported (``None``), never cut
short where the answer would differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenizers import Encoding, Tokenizer

from service.errors import PayloadTooLargeError
from service.frontend.preprocessing import check_deadline

#: A text's first ``max_length`` times this many characters are tried first.
CHARS_PER_TOKEN_GUESS = 32
#: Words at the end of a prefix whose tokens may differ from the whole text's.
_UNSETTLED_WORDS = 2


class PrefixCutter:
    """Cuts texts for a tokenizer that truncates to ``max_length`` tokens."""

    def __init__(
        self, tokenizer: Tokenizer, max_length: int, max_chars: int, max_request_chars: int
    ) -> None:
        # A copy without truncation or special tokens: every token of a prefix is counted.
        self.counter = Tokenizer.from_str(tokenizer.to_str())
        self.counter.no_truncation()
        self.counter.no_padding()
        self.max_length = max_length
        self.max_chars = max_chars
        self.max_request_chars = max_request_chars
        self.first_chars = min(max_chars, CHARS_PER_TOKEN_GUESS * max_length)

    def prefixes(self, texts: Sequence[str], deadline_s: float = math.inf) -> list[str | None]:
        """Each text, or the prefix of it that truncation turns into the whole text's tokens;
        ``None`` for a text whose first ``max_chars`` characters hold too few tokens. 413
        when finding the prefixes takes more than ``max_request_chars`` tokenized."""
        cut: list[str | None] = list(texts)
        sizes = dict.fromkeys(range(len(texts)), self.first_chars)
        pending = [index for index, text in enumerate(texts) if len(text) > self.first_chars]
        tokenized = 0
        while pending:
            tokenized += sum(sizes[index] for index in pending)
            if tokenized > self.max_request_chars:
                raise PayloadTooLargeError(
                    f"finding the first {self.max_length} tokens of the request's "
                    f"{len(texts)} texts takes more than {self.max_request_chars:,} characters "
                    "tokenized, the most one request may take: send fewer or shorter texts"
                )
            check_deadline(deadline_s, f"{len(pending)} long texts were being cut")
            encodings = self.counter.encode_batch(
                [texts[index][: sizes[index]] for index in pending], add_special_tokens=False
            )
            still = []
            for index, encoding in zip(pending, encodings, strict=True):
                text, size = texts[index], sizes[index]
                if self._holds_enough(encoding):
                    cut[index] = text[:size]
                elif size >= self.max_chars:
                    cut[index] = None
                else:
                    sizes[index] = min(2 * size, self.max_chars)
                    if len(text) > sizes[index]:
                        still.append(index)
            pending = still
        return cut

    def _holds_enough(self, encoding: Encoding) -> bool:
        """Whether ``max_length`` tokens come before the prefix's last two words."""
        words = [word for word in encoding.word_ids if word is not None]
        if not words:
            return False
        unsettled = words[-1] - _UNSETTLED_WORDS + 1
        return sum(1 for word in words if word < unsettled) >= self.max_length
