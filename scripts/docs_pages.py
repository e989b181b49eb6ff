"""Reference tables of the documentation site, rendered from the code and the deploy files.

A page holds a marker line such as ``<!-- batchserve:settings -->``; the MkDocs hook
``on_page_markdown`` replaces it with the table rendered from its source when the site is
built, so a setting, metric, panel or alert added later appears without editing a page:

- ``settings``: every field of ``service.config.Settings`` (variable, default, accepted
  values from the field's type and constraints, and its docstring), nested models included;
- ``metrics``: every metric the front ends, engines and processes register;
- ``dashboard``: every panel of ``deploy/grafana/batchserve-dashboard.json``;
- ``alerts``: every rule of ``deploy/prometheus/alerts.yml``;
- ``errors``: every error of ``service/errors.py`` (code, HTTP and gRPC status, when it is
  answered, from the class's docstring).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from service.config import ENV_PREFIX, Settings
from service.errors import RetryLaterError, documented_errors, grpc_status_name
from service.metrics import EngineMetrics, FrontendMetrics, ProcessMetrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "batchserve-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
NESTED_DELIMITER = "__"

_MARKER = re.compile(r"^<!-- batchserve:([a-z]+) -->$", re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+[^`]*`+)")


def _cell(text: str) -> str:
    """One Markdown table cell: a single line, pipes escaped outside code spans (inside them
    the table extension does not split, and a backslash would show)."""
    parts = _CODE_SPAN.split(" ".join(text.split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _code(value: object) -> str:
    return f"`{value}`"


# Settings


def setting_variables(model: type[BaseModel] = Settings) -> list[str]:
    """Every environment variable ``model`` reads, in declaration order."""
    return [variable for variable, _ in _setting_fields(model, ENV_PREFIX)]


def _setting_fields(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        variable = prefix + name.upper()
        nested = _nested_model(field.annotation)
        if nested is not None:
            yield from _setting_fields(nested, variable + NESTED_DELIMITER)
        else:
            yield variable, field


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, Path):
        return _shown_path(value)
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple | list | set | frozenset):
        return _code(",".join(str(item) for item in value)) if value else "empty"
    if isinstance(value, BaseModel):
        return "see below"
    return _code(value)


def _shown_path(path: Path) -> str:
    """A default inside the source checkout, shown relative to it (the build machine's
    absolute path would mean nothing to a reader)."""
    try:
        return f"`{path.relative_to(ROOT)}/` of the source checkout"
    except ValueError:
        return _code(path)


def _accepted(field: FieldInfo) -> str:
    parts = [_kind(field.annotation)]
    bounds = {type(constraint).__name__: constraint for constraint in field.metadata}
    low = bounds.get("Ge") or bounds.get("Gt")
    high = bounds.get("Le") or bounds.get("Lt")
    if isinstance(low, annotated_types.Ge) and isinstance(high, annotated_types.Le):
        parts.append(f"{low.ge} to {high.le}")
    else:
        parts.extend(_constraint(constraint) for constraint in (low, high) if constraint)
    parts.extend(
        _constraint(constraint)
        for constraint in field.metadata
        if constraint is not low and constraint is not high
    )
    return ", ".join(part for part in parts if part)


def _kind(annotation: Any) -> str:
    if _is_union(annotation):
        kinds = [_kind(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return " or ".join(kinds)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(_code(choice) for choice in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _kind(typing.get_args(annotation)[0])
    if origin in (tuple, list, set, frozenset):
        items = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
        item = _kind(items[0]) if items else "value"
        return f"list of {item}s (`1,2,3` or `[1, 2, 3]`)"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(_code(member.value) for member in annotation)
    names: dict[object, str] = {
        int: "integer",
        float: "number",
        bool: "boolean (`true` or `false`)",
        str: "string",
        Path: "path",
        SecretStr: "secret string (never logged)",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _constraint(constraint: object) -> str:
    bounds: list[tuple[type[Any], str, str]] = [
        (annotated_types.Ge, "ge", "≥"),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "≤"),
        (annotated_types.Lt, "lt", "<"),
        (annotated_types.MinLen, "min_length", "length ≥"),
        (annotated_types.MaxLen, "max_length", "length ≤"),
    ]
    for kind, attribute, symbol in bounds:
        if isinstance(constraint, kind):
            return f"{symbol} {getattr(constraint, attribute)}"
    pattern = getattr(constraint, "pattern", None)
    if isinstance(pattern, str):
        return f"matching `{pattern}`"
    return ""


def settings_markdown(model: type[BaseModel] = Settings) -> str:
    """The table of every setting: variable, default, accepted values and meaning."""
    rows = [
        "| variable | default | accepted | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for variable, field in _setting_fields(model, ENV_PREFIX):
        rows.append(
            f"| {_code(variable)} | {_cell(_default(field))} | {_cell(_accepted(field))} "
            f"| {_cell(field.description or '')} |"
        )
    return "\n".join(rows)


# Metrics


def metrics_markdown() -> str:
    """The table of every metric the service registers, with its type, labels and help."""
    collectors: list[MetricWrapperBase] = []
    for owner in (FrontendMetrics(), EngineMetrics(), ProcessMetrics("server")):
        collectors.extend(v for v in vars(owner).values() if isinstance(v, MetricWrapperBase))
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for collector in collectors:
        (family,) = collector.describe()
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = ", ".join(collector._labelnames)
        rows.append(
            f"| {_code(name)} | {family.type} | {_cell(labels)} | {_cell(family.documentation)} |"
        )
    return "\n".join(rows)


# Grafana and Prometheus


def dashboard_markdown(path: Path = DASHBOARD) -> str:
    """Every panel of the Grafana dashboard, by row, with what it shows."""
    dashboard = json.loads(path.read_text())
    rows = ["| row | panel | what it shows |", "| --- | --- | --- |"]
    section = ""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            section = panel.get("title", "")
            continue
        rows.append(
            f"| {_cell(section)} | {_cell(panel.get('title', ''))} "
            f"| {_cell(panel.get('description', ''))} |"
        )
    return "\n".join(rows)


def alerts_markdown(path: Path = ALERTS) -> str:
    """Every alerting rule: name, severity, how long its condition must hold, and meaning."""
    document = yaml.safe_load(path.read_text())
    rows = ["| alert | severity | for | what it means |", "| --- | --- | --- | --- |"]
    for group in document["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            annotations = rule.get("annotations", {})
            rows.append(
                f"| {_code(rule['alert'])} | {rule.get('labels', {}).get('severity', '')} "
                f"| {rule.get('for', '0m')} | {_cell(annotations.get('description', ''))} |"
            )
    return "\n".join(rows)


def errors_markdown() -> str:
    """Every error a client can get, by HTTP status, with the gRPC status it maps to."""
    rows = [
        "| code | HTTP | gRPC | `Retry-After` | when |",
        "| --- | --- | --- | --- | --- |",
    ]
    for error in documented_errors():
        retry = "yes" if issubclass(error, RetryLaterError) else ""
        when = _cell(inspect.cleandoc(error.__doc__ or ""))
        rows.append(
            f"| `{error.code}` | {error.status_code} | `{grpc_status_name(error)}` | {retry} "
            f"| {when} |"
        )
    return "\n".join(rows)


RENDERERS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "metrics": metrics_markdown,
    "dashboard": dashboard_markdown,
    "alerts": alerts_markdown,
    "errors": errors_markdown,
}


def render_markers(markdown: str) -> str:
    """``markdown`` with every marker line replaced by its table; an unknown marker raises."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in RENDERERS:
            raise ValueError(f"unknown docs marker {name!r}; known: {sorted(RENDERERS)}")
        return RENDERERS[name]()

    return _MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    """MkDocs hook (``hooks:`` in mkdocs.yml)."""
    return render_markers(markdown)
