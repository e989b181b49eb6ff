"""Reading the instances of a handler's request body: the JSON envelope and its limits.

Shared by the text and image handlers, whose bodies are ``{"instances": [...]}`` like the
tensor bodies, but hold strings or base64 images instead of numbers.
"""

from __future__ import annotations

from typing import Any

import orjson
from python_multipart.multipart import parse_options_header

from service.errors import BadRequestError, InvalidInputError


def json_instances(body: bytes, max_instances: int) -> list[Any]:
    """The list a ``{"instances": [...]}`` body holds: 400 when it is not JSON, 422 when it
    is not that object or holds no instance or more than ``max_instances``."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidInputError(
            f'the body must be a JSON object {{"instances": [...]}}, got {json_type(document)}'
        )
    unknown = sorted(set(document) - {"instances"})
    if unknown:
        raise InvalidInputError(f"unknown field(s) {unknown}; the body takes only 'instances'")
    if "instances" not in document:
        raise InvalidInputError("missing field 'instances' (a list of instances)")
    instances = document["instances"]
    if not isinstance(instances, list):
        raise InvalidInputError(f"'instances' must be a list, got {json_type(instances)}")
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


def json_type(value: object) -> str:
    """What a JSON value is, in the words of an error message."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
