"""A generative version's text side: its tokenizer, chat template and generation defaults.

A generative version (``manifest.metadata["task"] == "text-generation"``, packaged by
``batchserve package --hf``) holds ``tokenizer.json``, ``tokenizer_config.json`` (its special
tokens, and its chat template unless ``chat_template.jinja`` or ``chat_template.json`` holds
it) and ``generation_config.json``. Each file is read once, from the bytes whose hash the
manifest records, and the front end tokenizes and detokenizes with the ``tokenizers``
library: no ``transformers`` and no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

from service.bridge.interface import GENERATIVE_TASKS
from service.errors import InvalidParameterError, ModelNotFoundError
from service.manifest import Manifest
from service.verified_files import read_verified

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: The special tokens a chat template may name (``transformers``' ``special_tokens_map``).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


def is_generative(manifest: Manifest) -> bool:
    return manifest.metadata.get("task") in GENERATIVE_TASKS


@dataclass(frozen=True)
class GenerationDefaults:
    """What ``generation_config.json`` sets, used where a request sets nothing (as vLLM's
    ``--generation-config auto``): sampling settings and the most new tokens."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    """As ``transformers``' pipeline applies it to every request that sets none."""

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> GenerationDefaults:
        def number(key: str) -> float | None:
            value = document.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            return float(value)

        top_k, max_new = number("top_k"), number("max_new_tokens")
        return cls(
            temperature=number("temperature"),
            top_p=number("top_p"),
            # transformers' default top_k (50) applies only when sampling; 0 means none.
            top_k=int(top_k) if top_k else None,
            max_new_tokens=int(max_new) if max_new else None,
            repetition_penalty=number("repetition_penalty"),
        )


@dataclass(frozen=True)
class TextModel:
    """How one version's text becomes token ids and back."""

    manifest: Manifest
    tokenizer: Tokenizer
    chat_template: str | None
    """The Jinja template a chat is rendered with; None when the version has none."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """``bos_token`` and the like, by name, as a chat template reads them."""
    defaults: GenerationDefaults = GenerationDefaults()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids: with the tokenizer's special tokens for a plain prompt (as
        ``tokenizer(text)`` gives), without them for a rendered chat (its template wrote
        them). ``encode_batch`` of the one text gives what ``encode`` gives, but lets go of
        the GIL while it works (``encode`` holds it throughout): a long prompt tokenized on a
        handler thread then leaves the event loop running."""
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, for log-probabilities (a byte-level token that is part of a
        character shows as U+FFFD, as ``decode`` gives it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_ids(self, ids: Sequence[int], where: str) -> None:
        """422 for a token id outside the vocabulary."""
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        for index, token in enumerate(ids):
            if not 0 <= token < size:
                raise InvalidParameterError(
                    where,
                    f"{where}[{index}] is {token}: token ids of {self.manifest.name} are "
                    f"0 to {size - 1}",
                )


def load_text_model(manifest: Manifest, folder: Path) -> TextModel:
    """The text side of the version whose files are in ``folder``, each read once and checked
    against its hash. 404 for a version that is not generative."""
    if not is_generative(manifest):
        raise ModelNotFoundError(
            f"{manifest.name} is not a text-generation model (its task is "
            f"{manifest.metadata.get('task')!r}); use /predict or /v2/models/{manifest.name}/infer"
        )

    def document(name: str) -> dict[str, Any]:
        if name not in manifest.files:
            return {}
        loaded = orjson.loads(read_verified(manifest, folder, name))
        return loaded if isinstance(loaded, dict) else {}

    if TOKENIZER_FILE not in manifest.files:
        raise ModelNotFoundError(
            f"{manifest.label} has no {TOKENIZER_FILE}: package it with `batchserve package --hf`"
        )
    tokenizer = Tokenizer.from_str(read_verified(manifest, folder, TOKENIZER_FILE).decode())
    # A saved tokenizer may carry the truncation and padding it was last used with: a prompt
    # is tokenized whole and alone, as ``tokenizer(prompt)`` gives it to ``generate``.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = document(TOKENIZER_CONFIG_FILE)
    # Where transformers has kept the template over its releases, newest first.
    template: str | None
    if CHAT_TEMPLATE_FILE in manifest.files:
        template = read_verified(manifest, folder, CHAT_TEMPLATE_FILE).decode()
    elif CHAT_TEMPLATE_JSON_FILE in manifest.files:
        template = _default_template(document(CHAT_TEMPLATE_JSON_FILE).get("chat_template"))
    else:
        template = _default_template(config.get("chat_template"))
    return TextModel(
        manifest=manifest,
        tokenizer=tokenizer,
        chat_template=template,
        special_tokens=_special_tokens(document(SPECIAL_TOKENS_FILE)) | _special_tokens(config),
        defaults=GenerationDefaults.from_document(document(GENERATION_CONFIG_FILE)),
    )


def _default_template(value: object) -> str | None:
    """A template string, or the one named ``default`` of a list of named templates (as
    ``transformers`` picks it)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)
        }
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
