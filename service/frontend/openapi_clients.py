"""``for_clients``: the OpenAPI document as client generators take it whole.

FastAPI states a path parameter of a handler serving two routes (``/v2/models/{name}`` and
``/v2/models/{name}/versions/{version}``, with ``version: str | None``) as nullable; a path
segment cannot be null, and ``openapi-python-client`` drops such operations ("None | str is
not allowed in path"). This rewrites the document's content only, whatever the routes are.
"""

from __future__ import annotations

import copy
from typing import Any

Schema = dict[str, Any]
_NULL: Schema = {"type": "null"}


def for_clients(document: Schema) -> Schema:
    """A copy of ``document`` whose path parameters are required and never null."""
    document = copy.deepcopy(document)
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path":
                    parameter["required"] = True
                    parameter["schema"] = not_null(parameter.get("schema", {}))
    return document


def not_null(schema: Schema) -> Schema:
    """``schema`` without its ``null`` alternative (``anyOf: [string, null]`` -> string)."""
    alternatives = schema.get("anyOf")
    if not isinstance(alternatives, list) or _NULL not in alternatives:
        return schema
    kept = [alternative for alternative in alternatives if alternative != _NULL]
    rest = {key: value for key, value in schema.items() if key not in ("anyOf", "default")}
    if len(kept) == 1:
        return {**kept[0], **rest}
    return {**rest, "anyOf": kept}
