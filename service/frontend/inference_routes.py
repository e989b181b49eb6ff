"""The inference routes, in one table: what the middleware answers itself, what the OpenAPI
document describes, and the route labels of the request metrics and traces.

The middleware dispatches ``POST`` requests on these paths to ``/predict``'s or the V2
protocol's code without FastAPI's routing (half of the event loop's time per request, measured
with py-spy); ``routes.py`` and ``oip/routes.py`` register each path of the table with FastAPI
only so that the OpenAPI document describes it. A new inference path is a new row here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Protocol = Literal["predict", "v2"]
"""What answers a route: ``/predict``'s code (``predict.py``) or the V2 protocol's
(``oip/rest.py``)."""

PREDICT_PATH = "/predict"
MODEL_PREDICT_PATH = "/models/{name}/predict"
MODEL_VERSION_PREDICT_PATH = "/models/{name}/versions/{version}/predict"
V2_INFER_PATH = "/v2/models/{name}/infer"
V2_VERSION_INFER_PATH = "/v2/models/{name}/versions/{version}/infer"


@dataclass(frozen=True, slots=True)
class InferenceRoute:
    path: str
    """The path as OpenAPI writes it; ``{name}`` and ``{version}`` are path segments."""
    protocol: Protocol
    label: str
    """The route in the request metrics and the server span's name (a version named in the
    path is counted with its model's route)."""
    summary: str
    """The OpenAPI operation's summary."""
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        segments = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path)
        object.__setattr__(self, "pattern", re.compile(f"^{segments}$"))

    @property
    def names_model(self) -> bool:
        return "{name}" in self.path


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """An inference route that a request's path matched, and the model and version it names."""

    route: InferenceRoute
    name: str | None = None
    version: str | None = None


INFERENCE_ROUTES: tuple[InferenceRoute, ...] = (
    InferenceRoute(PREDICT_PATH, "predict", PREDICT_PATH, "Predict one or more instances"),
    InferenceRoute(
        MODEL_VERSION_PREDICT_PATH,
        "predict",
        MODEL_PREDICT_PATH,
        "Predict with a model's version",
    ),
    InferenceRoute(MODEL_PREDICT_PATH, "predict", MODEL_PREDICT_PATH, "Predict with a model"),
    InferenceRoute(V2_VERSION_INFER_PATH, "v2", V2_INFER_PATH, "Inference on a version"),
    InferenceRoute(V2_INFER_PATH, "v2", V2_INFER_PATH, "Inference"),
)
#: Every inference route's label.
INFERENCE_LABELS = frozenset(route.label for route in INFERENCE_ROUTES)

_EXACT = {route.path: RouteMatch(route) for route in INFERENCE_ROUTES if "{" not in route.path}
_TEMPLATED = tuple(route for route in INFERENCE_ROUTES if "{" in route.path)
#: How every templated path starts: other paths are not tried against the patterns.
_PREFIXES = tuple({route.path.split("{", 1)[0] for route in _TEMPLATED})


def match_inference(path: str) -> RouteMatch | None:
    """The inference route ``path`` is on, with the name and version it holds; None for any
    other path."""
    exact = _EXACT.get(path)
    if exact is not None or not path.startswith(_PREFIXES):
        return exact
    for route in _TEMPLATED:
        found = route.pattern.match(path)
        if found is not None:
            groups = found.groupdict()
            return RouteMatch(route, groups.get("name"), groups.get("version"))
    return None


def of_protocol(protocol: Protocol) -> tuple[InferenceRoute, ...]:
    return tuple(route for route in INFERENCE_ROUTES if route.protocol == protocol)
