"""Management routes under ``/admin``: list versions, load one, roll back. Bearer token only.

A version is loaded next to the serving one (hashes verified, built, warmed up) and swapped in
only once it works; a version that fails is refused with 422 and the serving one stays. With
several worker processes the worker that answers switches first and publishes the version;
the others follow within about a second (``version_sync.py``).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, Request, Response

from service import lifecycle, version_sync
from service.api import json_response
from service.errors import ConflictError, ForbiddenError, UnauthorizedError
from service.model_store import check_name, check_version, manifest_summary
from service.schemas import ErrorResponse
from service.state import ServiceState


def _service(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


def require_admin_token(request: Request) -> None:
    """Accept only ``Authorization: Bearer <BATCHSERVE_ADMIN_TOKEN>``; compared in constant
    time, never logged or echoed."""
    token = _service(request).settings.admin_token
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
    service = _service(request)
    manifests = service.store.versions(check_name(name))
    serving = service.manifest
    return json_response(
        {
            "name": name,
            "serving": serving.version if serving and serving.name == name else None,
            "versions": [manifest_summary(manifest) for manifest in manifests],
        }
    )


@router.post("/models/{name}/versions/{version}/load", summary="Load and serve a version")
async def load_version(name: str, version: str, request: Request) -> Response:
    """Verify, load and warm up ``name`` at ``version`` (or ``latest``), then switch to it."""
    return await _switch(_service(request), check_name(name), check_version(version))


@router.post("/rollback", summary="Serve the previous version again")
async def rollback(request: Request) -> Response:
    """Switch back to the version served before the last switch (verified and loaded again)."""
    service = _service(request)
    if service.previous_version is None:
        raise ConflictError("no earlier version was served by this process; nothing to roll back")
    name, version = service.previous_version
    return await _switch(service, name, version)


async def _switch(service: ServiceState, name: str, version: str) -> Response:
    manifest, replaced = await lifecycle.switch_version(service, name, version)
    # Published even when this worker served it already: the others may not.
    version_sync.publish(
        version_sync.PublishedVersion(manifest.name, manifest.version, service.previous_version)
    )
    return json_response({"serving": manifest_summary(manifest), "replaced": replaced})
