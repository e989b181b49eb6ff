"""The one table of inference routes: each is registered once with the app's router, which
answers it, describes it in the OpenAPI document, and labels it in the request metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import Match
from starlette.types import Scope

from service.frontend.app import ServingApp, create_frontend_app
from service.frontend.inference_routes import INFERENCE_ROUTES
from service.frontend.state import FrontendState
from tests.fixtures import sample_total
from tests.test_requests import EngineAnsweringLate, frontend_with, no_lifespan, tokens_model

BODY = b'{"instances": [[1, 2, 3]]}'
V2_BODY = b'{"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}]}'


def app_with_tokens(tmp_path: Path) -> tuple[FastAPI, FrontendState]:
    frontend = frontend_with(EngineAnsweringLate(tokens_model()), tmp_path)
    return create_frontend_app(frontend, no_lifespan), frontend


def requests_total(frontend: FrontendState, route: str, status: str) -> float:
    frontend.request_tally.flush()
    labels = {"route": route, "status": status}
    return sample_total(frontend.registry, "batchserve_requests_total", labels)


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/predict", "/predict"),
        ("/models/tokens/predict", "/models/{name}/predict"),
        ("/models/tokens/versions/abc/predict", "/models/{name}/predict"),
        ("/v2/models/tokens/infer", "/v2/models/{name}/infer"),
        ("/v2/models/tokens/versions/abc/infer", "/v2/models/{name}/infer"),
    ],
)
async def test_each_inference_path_is_answered_by_its_route_and_counted_under_its_label(
    tmp_path: Path, path: str, label: str
) -> None:
    """The engine answers every request 504; a version not served is 404: either way the
    route's own code answered (a path no route takes would be 404 ``not_found``)."""
    app, frontend = app_with_tokens(tmp_path)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        body = V2_BODY if path.startswith("/v2/") else BODY
        answer = await client.post(path, content=body, headers={"content-type": "application/json"})
    expected = 404 if "/versions/" in path else 504
    assert answer.status_code == expected, answer.text
    assert '"code":"not_found"' not in answer.text  # the router's own 404
    assert answer.headers["x-request-id"]
    assert requests_total(frontend, label, str(expected)) == 1


async def test_other_paths_are_counted_by_themselves_or_as_other(tmp_path: Path) -> None:
    app, frontend = app_with_tokens(tmp_path)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.head("/healthz")).status_code == 200
        assert (await client.get("/no/such/thing")).status_code == 404
        assert (await client.get("/predict")).status_code == 405
    assert requests_total(frontend, "/healthz", "200") == 2
    assert requests_total(frontend, "other", "404") == 1
    assert requests_total(frontend, "/predict", "405") == 1


async def test_other_methods_on_an_inference_path_are_fastapis_405(tmp_path: Path) -> None:
    """What an inference route does not answer goes through FastAPI's own handling, which
    answers it as for every route: the service's JSON 405, with ``Allow`` and a request id."""
    app, _ = app_with_tokens(tmp_path)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        answers = [await client.get(path) for path in ("/predict", "/v2/models/tokens/infer")]
    for answer in answers:
        assert answer.status_code == 405
        assert answer.headers["allow"] == "POST"
        error = answer.json()["error"]
        assert error["code"] == "method_not_allowed"
        assert error["request_id"] == answer.headers["x-request-id"]


async def test_the_openapi_document_describes_exactly_the_table_s_inference_routes(
    tmp_path: Path,
) -> None:
    app = create_frontend_app(frontend_with(EngineAnsweringLate(), tmp_path), no_lifespan)
    paths = app.openapi()["paths"]
    posted = {path for path, operations in paths.items() if "post" in operations}
    endings = (
        "/predict",
        "/infer",
        "/embeddings",
        "/embed",
        "/rerank",
        "/generate",
        "/generate_stream",
        "completions",
    )
    inference = {path for path in posted if path.endswith(endings)}
    assert inference == {route.path for route in INFERENCE_ROUTES}
    for route in INFERENCE_ROUTES:
        assert paths[route.path]["post"]["summary"] == route.summary


@pytest.mark.parametrize(
    "path",
    [
        "/predict",
        "/models/tokens/predict",
        "/v2/models/tokens/infer",
        "/v2/models/tokens/versions/a/infer",
    ],
)
async def test_a_kept_match_is_the_routes_own(tmp_path: Path, path: str) -> None:
    """The short way keeps the match of a path without parameters: what it gives again (the
    route and the child scope) is what the route's own ``matches`` gives."""
    app, _ = app_with_tokens(tmp_path)
    assert isinstance(app, ServingApp)

    def scope() -> Scope:
        return {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}

    first = app._inference_match(scope())
    again = app._inference_match(scope())
    assert first is not None
    assert again is not None
    route, child_scope = again
    match, own = route.matches(scope())
    assert match is Match.FULL
    assert again == first
    assert child_scope == own
