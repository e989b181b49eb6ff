"""Reading the instances of a handler's request body: the JSON envelope and its limits.

Shared by the text and image handlers, whose bodies are ``{"instances": [...]}`` like the
tensor bodies, but hold strings or base64 images instead of numbers.
"""

from __future__ import annotations

from typing import Any

from python_multipart.multipart import parse_options_header

from service.errors import InvalidInputError, PayloadTooLargeError
from service.frontend.bodies import json_type, read_instances

__all__ = ["check_count", "check_texts", "content_type_parameter", "json_instances", "json_type"]


def json_instances(body: bytes, max_instances: int, max_texts: int | None = None) -> list[Any]:
    """The list a ``{"instances": [...]}`` body holds: 400 when it is not JSON, 422 when it
    is not that object or holds no instance or more than ``max_instances``; 413 first when
    it holds more than ``max_texts`` (``check_texts``)."""
    instances = read_instances(body)
    if max_texts is not None:
        check_texts(len(instances), max_texts)
    check_count(len(instances), max_instances)
    return instances


def check_texts(count: int, max_texts: int) -> None:
    """413 for a request of more than ``max_texts`` texts (``max_client_batch_size``): well
    formed, too large to take at once, as TEI answers it; the client splits it."""
    if count > max_texts:
        raise PayloadTooLargeError(
            f"{count} texts in one request; at most {max_texts} are accepted "
            "(max_client_batch_size): send them in several requests"
        )


def check_count(count: int, max_instances: int) -> None:
    if count == 0:
        raise InvalidInputError("no instances; send at least one")
    if count > max_instances:
        raise InvalidInputError(
            f"{count} instances in one request; at most {max_instances} are accepted"
        )


def content_type_parameter(content_type: str, name: str) -> str | None:
    """A parameter of a ``Content-Type`` header (``boundary``, ``charset``), if present."""
    _, parameters = parse_options_header(content_type)
    value = parameters.get(name.encode("ascii"))
    return None if value is None else value.decode("latin-1")
