"""The one table of inference routes: the middleware's dispatch, the OpenAPI document and the
metrics labels all come from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.frontend.app import create_frontend_app
from service.frontend.inference_routes import INFERENCE_ROUTES, match_inference
from service.frontend.middleware import route_of
from tests.test_requests import EngineAnsweringLate, frontend_with, no_lifespan


@pytest.mark.parametrize(
    ("path", "label", "name", "version"),
    [
        ("/predict", "/predict", None, None),
        ("/models/digits/predict", "/models/{name}/predict", "digits", None),
        ("/models/digits/versions/abc/predict", "/models/{name}/predict", "digits", "abc"),
        ("/v2/models/digits/infer", "/v2/models/{name}/infer", "digits", None),
        ("/v2/models/digits/versions/abc/infer", "/v2/models/{name}/infer", "digits", "abc"),
    ],
)
def test_each_inference_path_matches_its_route_with_its_model_and_version(
    path: str, label: str, name: str | None, version: str | None
) -> None:
    found = match_inference(path)
    assert found is not None
    assert (found.route.label, found.name, found.version) == (label, name, version)
    assert route_of(path) == (label, found)


@pytest.mark.parametrize(
    "path",
    [
        "/predict/",
        "/models/a/b/predict",
        "/models//predict",
        "/models/digits/versions/abc/extra/predict",
        "/v2/models/digits/ready",
        "/v2/models/digits/infer/x",
        "/healthz",
    ],
)
def test_other_paths_are_no_inference_route(path: str) -> None:
    assert match_inference(path) is None


def test_other_paths_are_labelled_by_themselves_or_other() -> None:
    assert route_of("/healthz") == ("/healthz", None)
    assert route_of("/no/such/thing") == ("other", None)


async def test_the_openapi_document_describes_exactly_the_table_s_inference_routes(
    tmp_path: Path,
) -> None:
    app = create_frontend_app(frontend_with(EngineAnsweringLate(), tmp_path), no_lifespan)
    paths = app.openapi()["paths"]
    posted = {path for path, operations in paths.items() if "post" in operations}
    inference = {path for path in posted if path.endswith(("/predict", "/infer"))}
    assert inference == {route.path for route in INFERENCE_ROUTES}
    for route in INFERENCE_ROUTES:
        assert paths[route.path]["post"]["summary"] == route.summary
