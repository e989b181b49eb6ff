"""Reading the instances of a handler's request body: the JSON envelope and its limits.

Shared by the text and image handlers, whose bodies are ``{"instances": [...]}`` like the
tensor bodies, but hold strings or base64 images instead of numbers.
"""

from __future__ import annotations

from typing import Any

from python_multipart.multipart import parse_options_header

from service.errors import InvalidInputError
from service.frontend.bodies import json_type, read_instances

__all__ = ["check_count", "content_type_parameter", "json_instances", "json_type"]


def json_instances(body: bytes, max_instances: int) -> list[Any]:
    """The list a ``{"instances": [...]}`` body holds: 400 when it is not JSON, 422 when it
    is not that object or holds no instance or more than ``max_instances``."""
    instances = read_instances(body)
    check_count(len(instances), max_instances)
    return instances


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
