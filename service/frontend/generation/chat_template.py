"""A chat rendered into one prompt with the version's chat template, as ``transformers`` does.

``transformers``' ``apply_chat_template`` cannot be used in a front end (it imports torch
where torch is installed), so this renders the template the same way: Jinja's sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``tojson`` filter
that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, the template's
``{% generation %}`` blocks rendered as they are, and the version's special tokens
(``bos_token``...) beside ``messages`` and ``add_generation_prompt``. The template is
operator configuration, but the sandbox keeps it from reaching Python's internals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.errors import HandlerError, InvalidInputError

Message = dict[str, Any]
"""One message as the template reads it: ``role``, ``content`` (text), and ``name`` if
given."""


class TemplateRenderError(InvalidInputError):
    """The chat template refused the chat (its ``raise_exception``: roles out of order, a
    system message where none is allowed), or failed on it."""


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's tokens for
    training in ``transformers``: rendered as its content."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' keeps the text as it is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """The template, compiled once per text (a version's template is rendered per request)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Message],
    special_tokens: dict[str, str],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt the model continues: ``messages`` rendered with ``template``, the
    assistant's turn opened when ``add_generation_prompt``. 400 (``TemplateRenderError``)
    when the template refuses the chat; 500 (``HandlerError``) when it does not compile."""
    try:
        prepared = compiled(template)
    except jinja2.exceptions.TemplateError as error:
        raise HandlerError(f"the model's chat template cannot be compiled: {error}") from None
    try:
        return prepared.render(
            messages=list(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.exceptions.TemplateError as error:
        raise TemplateRenderError(
            f"the model's chat template refused the messages: {error}"
        ) from None
    except (TypeError, ValueError, KeyError, IndexError) as error:
        raise TemplateRenderError(
            f"the model's chat template failed on the messages: {type(error).__name__}: {error}"
        ) from None
