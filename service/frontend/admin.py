"""Management routes under ``/admin``: list versions, load one, unload a model, roll back,
split a model's traffic over several versions; shadow a candidate version; record a rollout
plan. Bearer token only.

A version is loaded by every engine next to what it serves (hashes verified, built, warmed
up) and served only once all of them have it, beside the other models or in place of the
version of its name; a version that any engine refuses is answered 422 (409 when it does not
fit in the memory budget) and what is served stays everywhere.

A shadow (``engine/shadow.py``) copies a share of a model's requests to a candidate version
loaded beside it on every engine, and compares the answers; the client gets the served
version's answer alone. A rollout plan's state (``service/rollout_plan.py``) is recorded beside
the published version record, for ``batchserve rollout`` to resume after any restart.
"""

from __future__ import annotations

import hmac
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.bridge.interface import SwitchResult
from service.errors import ForbiddenError, InvalidInputError, ModelNotFoundError, UnauthorizedError
from service.frontend.responses import json_response
from service.frontend.routes import frontend_of
from service.frontend.schemas import ErrorResponse
from service.frontend.state import FrontendState
from service.manifest import check_name, check_version, manifest_summary
from service.metrics import FrontendMetrics
from service.rollout_plan import RolloutPlan
from service.traffic_split import checked_weights
from service.traffic_window import NO_ANSWERS


def require_admin_token(request: Request) -> None:
    """Accept only ``Authorization: Bearer <BATCHSERVE_ADMIN_TOKEN>``; compared in constant
    time, never logged or echoed."""
    token = frontend_of(request).settings.admin_token
    if token is None:
        raise ForbiddenError("the admin API is disabled; set BATCHSERVE_ADMIN_TOKEN to enable it")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise UnauthorizedError("a valid 'Authorization: Bearer <token>' header is required")


router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin_token)],
    responses={status: {"model": ErrorResponse} for status in (401, 403, 404, 409, 422, 503)},
)


@router.get("/models/{name}/versions", summary="List a model's versions")
async def list_versions(name: str, request: Request) -> Response:
    """Every version of ``name`` in the repository, oldest first, and the one being served."""
    frontend = frontend_of(request)
    manifests = frontend.repository.versions(check_name(name))
    model = frontend.engine.status().find(name)
    return json_response(
        {
            "name": name,
            "serving": model.manifest.version if model else None,
            "versions": [manifest_summary(manifest) for manifest in manifests],
        }
    )


@router.post("/models/{name}/versions/{version}/load", summary="Load and serve a version")
async def load_version(name: str, version: str, request: Request) -> Response:
    """Verify, load and warm up ``name`` at ``version`` (or ``latest``), then serve it: in
    place of the version of ``name`` served now, or beside the other models when ``name`` is
    not served yet (409 when it does not fit in ``device_memory_budget_mb``)."""
    engine = frontend_of(request).engine
    return _switched(await engine.switch(check_name(name), check_version(version)))


@router.post("/models/{name}/unload", summary="Stop serving a model")
async def unload(name: str, request: Request) -> Response:
    """Stop serving ``name`` on every engine: its requests already queued are answered, new
    ones are 404, and its memory is freed. 409 for the only model served."""
    unloaded = await frontend_of(request).engine.unload(check_name(name))
    return json_response({"unloaded": unloaded})


@router.post("/models/{name}/rollback", summary="Serve a model's previous version again")
async def rollback_model(name: str, request: Request) -> Response:
    """Switch ``name`` back to the version it served before its last switch (verified and
    loaded again)."""
    return _switched(await frontend_of(request).engine.rollback(check_name(name)))


@router.post("/rollback", summary="Serve the previous version again")
async def rollback(request: Request) -> Response:
    """Switch the first model (the one ``/predict`` answers with) back to the version served
    before its last switch (verified and loaded again)."""
    return _switched(await frontend_of(request).engine.rollback())


class ShadowRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1, max_length=128)
    """The candidate version (an id, or ``latest``)."""
    percent: int = Field(ge=0, le=100)
    """The share of the model's requests copied to it."""


@router.put(
    "/models/{name}/shadow",
    summary="Shadow a model with a candidate version",
    responses={400: {"model": ErrorResponse}},  # a body that is not JSON
)
async def start_shadow(name: str, body: ShadowRequest, request: Request) -> Response:
    """Load ``version`` beside ``name`` on every engine (or none) and copy ``percent`` of its
    requests to it once they are answered; compare the answers. The client gets the served
    version's answer alone. Again with the same version: only the share changes."""
    engine = frontend_of(request).engine
    report = await engine.start_shadow(check_name(name), check_version(body.version), body.percent)
    return json_response(report.to_wire())


@router.get("/models/{name}/shadow", summary="What a model's shadow found")
async def shadow_report(name: str, request: Request) -> Response:
    """Requests compared, those on which the candidate disagreed (and the share), those it
    failed, those dropped to shed load, latencies, and the latest disagreements; summed over
    the engines. 404 when ``name`` has no shadow."""
    report = await frontend_of(request).engine.shadow_report(check_name(name))
    return json_response(report.to_wire())


@router.delete("/models/{name}/shadow", summary="Stop a model's shadow")
async def stop_shadow(name: str, request: Request) -> Response:
    """Stop copying requests and unload the candidate; what the shadow found, last."""
    report = await frontend_of(request).engine.stop_shadow(check_name(name))
    return json_response(report.to_wire())


@router.put(
    "/models/{name}/rollout",
    summary="Record a rollout plan's state",
    responses={400: {"model": ErrorResponse}},  # a body that is not JSON
)
async def record_rollout(name: str, plan: RolloutPlan, request: Request) -> Response:
    """Record where ``batchserve rollout`` stands with ``name`` (beside the published version
    record: it outlives engine and front end restarts)."""
    if plan.model != check_name(name):
        raise InvalidInputError(f"the plan is for model {plan.model!r}, not {name!r}")
    frontend = frontend_of(request)
    recorded = frontend.rollouts.read(name)
    before = RolloutPlan.model_validate_json(recorded) if recorded is not None else None
    document = plan.model_dump(mode="json")
    frontend.rollouts.write(name, orjson.dumps(document))
    _count_rollout(frontend.metrics, plan, before)
    return json_response(document)


def _count_rollout(metrics: FrontendMetrics, plan: RolloutPlan, before: RolloutPlan | None) -> None:
    """The plan's step in ``batchserve_rollout_percent``, and the decisions it added since it
    was last recorded in ``batchserve_rollout_decisions_total``."""
    running = plan.state == "running"
    metrics.rollout_percent.labels(plan.model, plan.to_version).set(plan.percent if running else 0)
    same = before is not None and before.started_at == plan.started_at
    for decision in plan.decisions[len(before.decisions) if same and before else 0 :]:
        labels = (plan.model, decision.verdict, decision.check or "none")
        metrics.rollout_decisions.labels(*labels).inc()


@router.get("/models/{name}/rollout", summary="Read a rollout plan's state")
async def read_rollout(name: str, request: Request) -> Response:
    """The plan last recorded for ``name``; 404 when none was."""
    recorded = frontend_of(request).rollouts.read(check_name(name))
    if recorded is None:
        raise ModelNotFoundError(f"no rollout plan was recorded for {name}")
    return json_response(orjson.loads(recorded))


def _switched(result: SwitchResult) -> Response:
    return json_response({"serving": manifest_summary(result.serving), "replaced": result.replaced})


class TrafficWeights(BaseModel):
    """A traffic split: each version's share of the model's requests, percent."""

    model_config = ConfigDict(extra="forbid")
    weights: dict[str, Annotated[int, Field(ge=0, le=100)]] = Field(
        min_length=1,
        description="Version id to weight, 0-100, summing to 100; 0 loads a version that "
        "answers only requests naming it.",
        examples=[{"dae3cd981a36": 95, "d09d18db9b1a": 5}],
    )

    @field_validator("weights", mode="before")
    @classmethod
    def _numbers_only(cls, weights: object) -> object:
        """A weight is a JSON number (``95``, or ``95.0``), never a string or a boolean."""
        if isinstance(weights, dict):
            for version, weight in weights.items():
                if isinstance(weight, str | bool):
                    raise ValueError(f"the weight of {version!r} is a number, got {weight!r}")
        return weights


@router.get("/models/{name}/traffic", summary="Read a model's traffic split")
async def read_traffic(name: str, request: Request) -> Response:
    """The weights of ``name``'s loaded versions and, for each version, the requests the
    engines answered with it over the recent window, whichever front end they came through:
    requests, errors (5xx), p50 and p99 latency in milliseconds from the engine's receipt to
    its answer."""
    frontend = frontend_of(request)
    weights = _served_weights(frontend, check_name(name))
    return json_response(await _traffic(frontend, weights, name))


@router.put(
    "/models/{name}/traffic",
    summary="Split a model's traffic over versions",
    responses={400: {"model": ErrorResponse}},  # a body that is not JSON
)
async def split_traffic(name: str, split: TrafficWeights, request: Request) -> Response:
    """Serve ``name``'s requests by ``weights``: every version named is verified, loaded and
    warmed up beside the others on every engine first (or on none: 422 for a version that
    fails its check, 409 for one that does not fit in the memory budget); the one with the
    most weight becomes the primary (what the model's metadata and a request naming no
    version fall back to); loaded versions left out are unloaded: ``{"<version>": 100}``
    serves that version alone. A request picks its version by the weights, sticky by its
    ``x-routing-key`` header. 404 for a model not served or a version not in the
    repository; 422 for weights not summing to 100."""
    frontend = frontend_of(request)
    name = check_name(name)
    _served_weights(frontend, name)  # 404 for a model not served, whatever the weights
    known = {manifest.version for manifest in frontend.repository.versions(name)}
    for version in split.weights:  # 404 before the weights are judged
        if check_version(version) not in known:
            raise ModelNotFoundError(
                f"{name} has no version {version!r} in the repository (a split names "
                f"versions by id; it has {', '.join(sorted(known))})"
            )
    weights = checked_weights(split.weights)
    await frontend.engine.split(name, weights)
    return json_response(await _traffic(frontend, weights, name))


def _served_weights(frontend: FrontendState, name: str) -> dict[str, int]:
    """The split ``name`` is served by now; 404 for a model not served (503 while no
    engine is ready)."""
    model = frontend.serving_model(name)
    return frontend.engine.status().weights(model.manifest.name)


async def _traffic(
    frontend: FrontendState, weights: dict[str, int], name: str
) -> dict[str, object]:
    report = await frontend.engine.traffic(name)
    stats = report.stats()
    return {
        "model": name,
        "weights": weights,
        "window_s": report.window_s,
        "versions": {
            version: stats.get(version, NO_ANSWERS).to_json()
            for version in dict.fromkeys([*weights, *stats])
        },
    }
