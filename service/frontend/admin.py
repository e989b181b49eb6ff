"""Management routes under ``/admin``: list versions, load one, unload a model, roll back;
shadow a candidate version; record a rollout plan. Bearer token only.

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

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from service.bridge.interface import SwitchResult
from service.errors import (
    ForbiddenError,
    InvalidInputError,
    ModelNotFoundError,
    UnauthorizedError,
)
from service.frontend.responses import json_response
from service.frontend.routes import frontend_of
from service.frontend.schemas import ErrorResponse
from service.manifest import check_name, check_version, manifest_summary
from service.rollout_plan import RolloutPlan


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


@router.put("/models/{name}/shadow", summary="Shadow a model with a candidate version")
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


@router.put("/models/{name}/rollout", summary="Record a rollout plan's state")
async def record_rollout(name: str, plan: RolloutPlan, request: Request) -> Response:
    """Record where ``batchserve rollout`` stands with ``name`` (beside the published version
    record: it outlives engine and front end restarts)."""
    if plan.model != check_name(name):
        raise InvalidInputError(f"the plan is for model {plan.model!r}, not {name!r}")
    document = plan.model_dump(mode="json")
    frontend_of(request).rollouts.write(name, orjson.dumps(document))
    return json_response(document)


@router.get("/models/{name}/rollout", summary="Read a rollout plan's state")
async def read_rollout(name: str, request: Request) -> Response:
    """The plan last recorded for ``name``; 404 when none was."""
    recorded = frontend_of(request).rollouts.read(check_name(name))
    if recorded is None:
        raise ModelNotFoundError(f"no rollout plan was recorded for {name}")
    return json_response(orjson.loads(recorded))


def _switched(result: SwitchResult) -> Response:
    return json_response({"serving": manifest_summary(result.serving), "replaced": result.replaced})
