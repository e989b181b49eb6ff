"""``model_openapi``: the OpenAPI document with ``POST /predict`` described by the served model
(and ``with_model_routes``: a predict route per model served, each described by its model).

FastAPI's document is the same whatever model is served, so a client generated from it knows
nothing of the model's inputs. This module rewrites the ``/predict`` request body and 200 answer
from the served version's manifest: every input's name, dtype, shape and accepted values, and
the output rows. It is pure (document and model in, document out) so it can be tested without a
server; ``app.py`` calls it once per served version.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from service.bridge.interface import ModelInfo
from service.frontend.bodies import NPY_MEDIA_TYPE, NPZ_MEDIA_TYPE
from service.frontend.inference_routes import (
    MODEL_PREDICT_PATH,
    MODEL_VERSION_PREDICT_PATH,
    PREDICT_PATH,
)
from service.frontend.responses import JSON
from service.manifest import Manifest, TensorSpec

Schema = dict[str, Any]

_BINARY: Schema = {"type": "string", "format": "binary"}
#: Length of the variable axis in the request example (shorter when the model allows less).
_EXAMPLE_LENGTH = 4
#: Inputs with more values per instance than this get no example (the schema still says all).
_EXAMPLE_MAX_VALUES = 64


def model_openapi(
    base: Schema,
    model: ModelInfo,
    *,
    max_instances: int,
    handler_description: dict[str, Any] | None = None,
) -> Schema:
    """A copy of ``base`` whose ``/predict`` states ``model``'s inputs and outputs.

    ``max_instances`` is ``settings.max_instances_per_request``. ``handler_description`` is
    what the version's handler's ``describe()`` returned, if it has one: its ``"request"``
    (JSON schemas by media type) and ``"response"`` (the schema of one prediction row) replace
    the tensor schemas, which do not apply to a handler's bodies. Without them the bodies are
    described loosely, by the ``"media_types"`` it lists (the handler's ``media_types``); its
    ``"query_parameters"`` (JSON schemas by name) become the operation's query parameters; the
    whole description is kept in the operation's ``x-batchserve-handler``. ``base`` is left
    unchanged.
    """
    document = copy.deepcopy(base)
    manifest = model.manifest
    operation = document["paths"][PREDICT_PATH]["post"]
    _describe_model(operation, model, max_instances, handler_description)
    info = document.setdefault("info", {})
    served = f"Serving `{manifest.label}`: `POST /predict` below is described for this version."
    info["description"] = (
        f"{info['description']}\n\n{served}" if info.get("description") else served
    )
    document["x-batchserve-model"] = {"name": manifest.name, "version": manifest.version}
    return document


def with_model_routes(
    document: Schema,
    models: list[tuple[ModelInfo, dict[str, Any] | None]],
    *,
    max_instances: int,
) -> Schema:
    """``document`` with ``/models/{name}/predict`` and ``/models/{name}/versions/{version}
    /predict`` replaced by one route of each per model served, each stating that model's
    inputs and outputs (a client then knows every model's bodies, and a name that is not
    served is no route at all). ``models``: each model and its handler's description."""
    paths = document["paths"]
    routes = (MODEL_PREDICT_PATH, MODEL_VERSION_PREDICT_PATH)
    templates = [paths.pop(route, {}).get("post") for route in routes]
    for model, described in models:
        name, version = model.manifest.name, model.manifest.version
        for route, template, suffix in zip(routes, templates, ("", "_version"), strict=True):
            if template is None:
                continue
            operation = copy.deepcopy(template)
            operation.pop("parameters", None)  # the path names the model and version
            operation["operationId"] = f"predict_with_{name}{suffix}"
            operation["summary"] = f"Predict with {name}" + (f" {version}" if suffix else "")
            _describe_model(operation, model, max_instances, described)
            paths[route.format(name=name, version=version)] = {"post": operation}
    return document


def _describe_model(
    operation: Schema,
    model: ModelInfo,
    max_instances: int,
    handler_description: dict[str, Any] | None,
) -> None:
    """Set ``operation``'s request body and 200 answer from ``model``'s manifest (or its
    handler's description)."""
    manifest = model.manifest
    if manifest.handler is None:
        request_content = _tensor_request(manifest.inputs, _length_limit(model), max_instances)
        row = _row_schema(manifest.outputs)
        answers = {JSON: {"schema": _prediction_answer(row, max_instances)}}
        if len(manifest.outputs) == 1:
            answers[NPY_MEDIA_TYPE] = _binary(
                "The output as one .npy array, one row per instance (send Accept: "
                f"{NPY_MEDIA_TYPE})."
            )
        answers[NPZ_MEDIA_TYPE] = _binary(
            "A .npz archive with one array per output, one row per instance (send Accept: "
            f"{NPZ_MEDIA_TYPE})."
        )
    else:
        request_content, row = _handler_contract(manifest, handler_description or {})
        answers = {JSON: {"schema": _prediction_answer(row, max_instances)}}
        query = (handler_description or {}).get("query_parameters", {})
        if query:
            operation["parameters"] = [
                *operation.get("parameters", []),
                *(_query_parameter(name, schema) for name, schema in query.items()),
            ]
        operation["x-batchserve-handler"] = {
            "import_path": manifest.handler.import_path,
            **(handler_description or {}),
        }
    operation["requestBody"]["content"] = request_content
    operation["responses"]["200"]["content"] = answers


def _query_parameter(name: str, schema: Schema) -> Schema:
    """An optional query parameter; its description is the schema's."""
    parameter: Schema = {"name": name, "in": "query", "required": False, "schema": schema}
    if "description" in schema:
        parameter["description"] = schema["description"]
    return parameter


def input_schema(spec: TensorSpec, length_limit: int | None) -> Schema:
    """One instance of an input: nested arrays, one level per axis after the batch axis.

    ``length_limit`` bounds the variable axis (``max_length``, else the longest length bucket).
    The padding value is accepted even outside ``[min_value, max_value]``, as the parser does.
    """
    leaf = _leaf(spec)
    bounds = [spec.min_value, spec.max_value]
    if any(bound is not None for bound in bounds) and not _within(spec.pad_value, leaf):
        leaf = {"anyOf": [leaf, {"const": _json_value(spec.pad_value, spec)}]}
    variable: Schema = {"minItems": 1}
    if length_limit is not None:
        variable["maxItems"] = length_limit
    schema = _nested(spec, leaf, variable)
    schema["description"] = _describe(spec, length_limit, is_input=True)
    schema["x-batchserve-tensor"] = spec.model_dump(mode="json", exclude_none=True)
    return schema


def output_schema(spec: TensorSpec) -> Schema:
    """One row of an output; its labels (class names along the last axis) in ``x-labels``."""
    schema = _nested(spec, _leaf(spec, declared_range=False), {})
    schema["description"] = _describe(spec, None, is_input=False)
    schema["x-batchserve-tensor"] = spec.model_dump(
        mode="json", exclude_none=True, exclude={"pad_value", "min_value", "max_value"}
    )
    if spec.labels is not None:
        schema["x-labels"] = list(spec.labels)
    return schema


def _tensor_request(
    inputs: tuple[TensorSpec, ...], length_limit: int | None, max_instances: int
) -> Schema:
    """JSON ``{"instances": [...]}`` and the binary bodies of a version without a handler."""
    names = ", ".join(f"`{spec.name}`" for spec in inputs)
    content: Schema = {}
    example: Any
    if len(inputs) == 1:
        instance = input_schema(inputs[0], length_limit)
        example = _example(inputs[0], length_limit)
    else:
        description = "One value per input, by name."
        if sum(spec.variable_axis is not None for spec in inputs) > 1:
            description += " Inputs with a variable axis have one length in an instance."
        instance = {
            "type": "object",
            "properties": {spec.name: input_schema(spec, length_limit) for spec in inputs},
            "required": [spec.name for spec in inputs],
            "additionalProperties": False,
            "description": description,
        }
        example = {spec.name: _example(spec, length_limit) for spec in inputs}
    content[JSON] = {
        "schema": {
            "type": "object",
            "properties": {
                "instances": {
                    "type": "array",
                    "items": instance,
                    "minItems": 1,
                    "maxItems": max_instances,
                    "description": f"1 to {max_instances} instances.",
                }
            },
            "required": ["instances"],
            "additionalProperties": False,
        },
    }
    if example is not None and (not isinstance(example, dict) or None not in example.values()):
        content[JSON]["example"] = {"instances": [example]}
    if len(inputs) == 1:
        content[NPY_MEDIA_TYPE] = _binary(
            f"One instance or a batch of {names} as a NumPy .npy array of dtype "
            f"{inputs[0].dtype} exactly; also accepted as application/octet-stream."
        )
    content[NPZ_MEDIA_TYPE] = _binary(
        f"A NumPy .npz archive with one array per input ({names}), each one instance or a "
        "batch, of the input's exact dtype."
    )
    return content


def _binary(description: str) -> Schema:
    """A media type's entry for a binary body or answer."""
    return {"schema": {**_BINARY, "description": description}}


def _handler_contract(manifest: Manifest, described: dict[str, Any]) -> tuple[Schema, Schema]:
    """Request content and prediction row of a version with a handler: what the handler
    describes, else any body of the media types it reads (any JSON object, any text, any bytes)
    and any JSON row."""
    assert manifest.handler is not None
    request = described.get("request")
    if isinstance(request, dict) and request:
        content = {media_type: {"schema": schema} for media_type, schema in request.items()}
    else:
        read = f"The body is read by the handler {manifest.handler.import_path}."
        media_types = described.get("media_types") or [JSON, "application/octet-stream"]
        content = {
            str(media_type): {"schema": {**_loose_body(str(media_type)), "description": read}}
            for media_type in media_types
        }
    response = described.get("response")
    row = response if isinstance(response, dict) else {"description": "The handler's answer."}
    return content, row


def _loose_body(media_type: str) -> Schema:
    if media_type == JSON:
        return {"type": "object"}
    if media_type.startswith("text/"):
        return {"type": "string"}
    if media_type == "multipart/form-data":
        return {"type": "object", "additionalProperties": _BINARY}
    return dict(_BINARY)


def _prediction_answer(row: Schema, max_instances: int) -> Schema:
    return {
        "type": "object",
        "properties": {
            "model": {"type": "string", "description": "Name of the model that answered."},
            "version": {
                "type": "string",
                "pattern": "^[0-9a-f]{12}$",
                "description": "Version that answered (the previous one, for a request queued "
                "before a switch).",
            },
            "predictions": {
                "type": "array",
                "items": row,
                "minItems": 1,
                "maxItems": max_instances,
                "description": "One row per instance, in request order.",
            },
        },
        "required": ["model", "version", "predictions"],
    }


def _row_schema(outputs: tuple[TensorSpec, ...]) -> Schema:
    """One prediction row: the bare output (one output) or an object keyed by output name."""
    if len(outputs) == 1:
        return output_schema(outputs[0])
    return {
        "type": "object",
        "properties": {spec.name: output_schema(spec) for spec in outputs},
        "required": [spec.name for spec in outputs],
    }


def _length_limit(model: ModelInfo) -> int | None:
    """The longest accepted variable axis: ``max_length``, else the longest length bucket."""
    spec = model.manifest.variable_input
    if spec is None:
        return None
    return spec.max_length or (model.length_edges[-1] if model.length_edges else None)


def _nested(spec: TensorSpec, leaf: Schema, variable: Schema) -> Schema:
    """``leaf`` wrapped in one array per instance axis; a bare ``leaf`` for a scalar instance."""
    schema = leaf
    for size in reversed(spec.instance_shape):
        bounds = variable if size == -1 else {"minItems": size, "maxItems": size}
        schema = {"type": "array", "items": schema, **bounds}
    return dict(schema)


def _leaf(spec: TensorSpec, *, declared_range: bool = True) -> Schema:
    """One element's JSON type, bounded by the dtype and (``declared_range``) by
    ``min_value``/``max_value``. Floats are bounded by the dtype's largest finite value, since
    the parser refuses what becomes infinite."""
    dtype = spec.numpy_dtype
    low = spec.min_value if declared_range else None
    high = spec.max_value if declared_range else None
    if dtype.kind == "b":
        return {"type": "boolean"}
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return {
            "type": "integer",
            "minimum": int(info.min) if low is None else max(int(info.min), math.ceil(low)),
            "maximum": int(info.max) if high is None else min(int(info.max), math.floor(high)),
        }
    if not declared_range:
        return {"type": "number"}
    largest = float(np.finfo(dtype).max)
    return {
        "type": "number",
        "minimum": -largest if low is None else low,
        "maximum": largest if high is None else high,
    }


def _within(value: float, leaf: Schema) -> bool:
    return bool(leaf.get("minimum", -math.inf) <= value <= leaf.get("maximum", math.inf))


def _json_value(value: float, spec: TensorSpec) -> float | int | bool:
    kind = spec.numpy_dtype.kind
    if kind == "b":
        return bool(value)
    if kind in "iu" and float(value).is_integer():
        return int(value)
    return value


def _example(spec: TensorSpec, length_limit: int | None) -> Any:
    """One realistic instance (values in range, never the padding), for the docs' "try it";
    ``None`` above ``_EXAMPLE_MAX_VALUES`` values (an image's 150,528 floats would be most of
    the document, once per route). Floats are rounded to 3 decimals, kept in range."""
    length = min(_EXAMPLE_LENGTH, length_limit or _EXAMPLE_LENGTH)
    instance = spec.example_instances(1, length, np.random.default_rng(0))[0]
    if instance.size > _EXAMPLE_MAX_VALUES:
        return None
    if instance.dtype.kind == "f":
        low = -math.inf if spec.min_value is None else spec.min_value
        high = math.inf if spec.max_value is None else spec.max_value
        instance = np.clip(np.round(instance.astype(np.float64), 3), low, high)
    return instance.tolist()


def _describe(spec: TensorSpec, length_limit: int | None, *, is_input: bool) -> str:
    """``pixels``: float32, per instance [8, 8], values in [0, 1]; and the like."""
    axes = ", ".join("L" if size == -1 else str(size) for size in spec.instance_shape)
    text = f"`{spec.name}`: {spec.dtype}, " + (
        f"per instance [{axes}]" if axes else "one scalar per instance"
    )
    if is_input and spec.variable_axis is not None:
        text += f", L from 1 to {length_limit}" if length_limit else ", L at least 1"
    if is_input and (spec.min_value is not None or spec.max_value is not None):
        low = -math.inf if spec.min_value is None else spec.min_value
        high = math.inf if spec.max_value is None else spec.max_value
        text += f", values in [{low:g}, {high:g}]"
        if not low <= spec.pad_value <= high:
            text += f" or the padding value {spec.pad_value:g}"
    if spec.labels is not None:
        text += f"; classes along the last axis: {', '.join(spec.labels)}"
    if spec.length_of is not None:
        text += (
            f"; L is each instance's own length of `{spec.length_of}` (.npy and .npz answers "
            "are at the request's longest instance: positions past an instance's length are "
            "the model's output on padding)"
        )
    return text + "."
