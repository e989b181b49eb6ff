"""A version's named prompts: the text put before each input, as ``sentence-transformers`` does.

A sentence-transformers folder names its prompts in ``config_sentence_transformers.json``
(``{"query": "query: ", "passage": "passage: "}``) and may name a default one. A request names
the prompt it wants (``?prompt_name=query`` on ``/predict``; the ``prompt_name`` of TEI's
``/embed``); without one, the default applies, or none. TEI's ``/embed`` and ``/rerank``
never apply the folder's default: TEI reads only the folder's ``prompts``, and applies a
default prompt only when its own ``--default-prompt-name`` is given. The prompt goes before
the text (a pair's first text), and is tokenized with it: truncation keeps the prompt and
cuts the text.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import Tokenizer

from service.errors import InvalidInputError

PROMPT_NAME_PARAMETER = "prompt_name"


def prompt_name_schema(prompts: Mapping[str, str], default_name: str | None) -> dict[str, object]:
    """The JSON schema of ``?prompt_name=`` for a version with these prompts."""
    if not prompts:
        return {"type": "string", "description": "This version has no prompts: none is accepted."}
    default = f" (default {default_name!r})" if default_name is not None else " (default none)"
    return {
        "type": "string",
        "enum": sorted(prompts),
        "description": f"The prompt put before each text{default}.",
    }


class NamedPrompts:
    """The prompts by name, the default one, and each one's length in tokens."""

    def __init__(
        self, tokenizer: Tokenizer, prompts: Mapping[str, str], default_name: str | None
    ) -> None:
        if not all(
            isinstance(name, str) and isinstance(text, str) for name, text in prompts.items()
        ):
            raise ValueError(f"option prompts must map names to strings, got {prompts!r}")
        if default_name is not None and default_name not in prompts:
            raise ValueError(
                f"option default_prompt_name {default_name!r} is not one of the prompts "
                f"{sorted(prompts)}"
            )
        self.prompts = dict(prompts)
        self.default_name = default_name
        self.lengths = {
            name: _tokens_before_text(tokenizer, text) for name, text in prompts.items()
        }
        """Each prompt's tokens at the start of a tokenized text (the leading special token
        counted, the closing one not): what a pooling that leaves the prompt out skips."""

    def chosen(self, name: str | None, default: bool = True) -> str | None:
        """The prompt named (422 for a name the version lacks), else the default (when
        ``default``: TEI's routes never apply the folder's), else none."""
        if name is None:
            return self.default_name if default else None
        if name not in self.prompts:
            named = sorted(self.prompts)
            raise InvalidInputError(
                f"prompt_name {name!r} is not one of this version's prompts "
                f"{named if named else '(it has none)'}"
            )
        return name

    def text(self, name: str | None) -> str:
        """The text of prompt ``name`` ("" for none)."""
        return "" if name is None else self.prompts[name]

    def length(self, name: str | None) -> int:
        """Tokens of prompt ``name`` at the start of a text (0 for none)."""
        return 0 if name is None else self.lengths[name]


def _tokens_before_text(tokenizer: Tokenizer, prompt: str) -> int:
    """As sentence-transformers measures a prompt: tokenized alone (truncated as texts are),
    less its last token when that is a special one ([SEP], </s>)."""
    if not prompt:
        return 0
    encoding = tokenizer.encode(prompt)
    length = len(encoding.ids)
    if length and encoding.special_tokens_mask[-1]:
        length -= 1
    return length
