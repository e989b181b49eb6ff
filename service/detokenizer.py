"""Generated token ids turned into text as they arrive, for streaming.

A character can span several tokens (byte-level BPE splits UTF-8 bytes across tokens), so a
token's text cannot be decoded alone: ``tokenizers``' ``DecodeStream`` keeps the ids of the
character under way and gives text only once it is whole. Shared by the engine and the front
ends (no torch): whoever holds the tokenizer turns ids into text, as vLLM's output processor
does in its front-end process.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Text deltas of one generated sequence: after each ``push`` the text so far equals
    ``tokenizer.decode(generated_ids)`` wherever that ends on a whole character; ``finish``
    gives what is still held back (an incomplete character, decoded as ``decode`` would).

    ``prompt_ids``: the prompt, decoded as the context of the first generated tokens (a
    tokenizer that drops the leading space of a text's first word, as SentencePiece's does,
    keeps it for a completion's first word). Without it the text is that of the generated
    ids alone.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._prompt_ids = list(prompt_ids)
        self._stream = DecodeStream(
            ids=self._prompt_ids or None, skip_special_tokens=skip_special_tokens
        )
        self._ids: list[int] = []
        self._text = ""

    @property
    def text(self) -> str:
        """The text given out so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """The text ``token_id`` adds: empty when it ends inside a character (or is a special
        token skipped)."""
        self._ids.append(token_id)
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self._text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once no more tokens come: the held-back bytes of an
        incomplete character, as ``decode`` renders them (U+FFFD)."""
        whole = self._decode_all()
        if not whole.startswith(self._text):
            return ""
        rest = whole[len(self._text) :]
        self._text = whole
        return rest

    def _decode_all(self) -> str:
        skip = self._skip_special_tokens
        if not self._prompt_ids:
            return self._tokenizer.decode(self._ids, skip_special_tokens=skip)
        prompt = self._tokenizer.decode(self._prompt_ids, skip_special_tokens=skip)
        both = self._tokenizer.decode(self._prompt_ids + self._ids, skip_special_tokens=skip)
        return both[len(prompt) :] if both.startswith(prompt) else ""
