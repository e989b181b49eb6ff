"""``for_clients``: the OpenAPI document as client generators take it whole.

FastAPI states a path parameter of a handler serving two routes (``/v2/models/{name}`` and
``/v2/models/{name}/versions/{version}``, with ``version: str | None``) as nullable; a path
segment cannot be null, and ``openapi-python-client`` drops such operations ("None | str is
not allowed in path").

A request body of several media types (JSON, a binary file and multipart images, say) stays
required, as the server requires it; the routes that take one (the inference routes) also read
the optional ``X-Priority`` header, which is declared on them here. That declaration is true
and it matters to ``openapi-python-client`` (0.29): it makes such a body an optional argument
(``body: JsonBody | File | Unset = UNSET``) whatever ``required`` says, but imports ``Unset``
only for what the document declares optional, so the module it wrote for a route with such a
body and no optional parameter did not import (NameError).

This rewrites the document's content only, whatever the routes are.
"""

from __future__ import annotations

import copy
from typing import Any

Schema = dict[str, Any]
_NULL: Schema = {"type": "null"}
PRIORITY: Schema = {
    "name": "X-Priority",
    "in": "header",
    "required": False,
    "description": "`high` is served before normal traffic when both wait.",
    "schema": {"type": "string", "enum": ["high", "normal"], "default": "normal"},
}


def for_clients(document: Schema) -> Schema:
    """A copy of ``document`` whose path parameters are required and never null, and whose
    operations with a request body of several media types declare ``X-Priority``."""
    document = copy.deepcopy(document)
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path":
                    parameter["required"] = True
                    parameter["schema"] = not_null(parameter.get("schema", {}))
            body = operation.get("requestBody")
            if isinstance(body, dict) and len(body.get("content", {})) > 1:
                parameters = operation.setdefault("parameters", [])
                if not any(parameter.get("name") == PRIORITY["name"] for parameter in parameters):
                    parameters.append(copy.deepcopy(PRIORITY))
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
