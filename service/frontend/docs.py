"""``GET /docs``: Swagger UI served from the app itself, so it works on a host with no internet.

FastAPI's own page loads Swagger UI from a CDN, which an offline host shows as a blank page.
The assets come from the ``swagger-ui-bundle`` package instead, under ``/docs-assets/``; only
the three files the page needs are served, not the package's folder (its ``index.html`` points
at an internet demo).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

ASSETS_PATH = "/docs-assets"
#: The assets the page loads, with their media types (not guessed from the platform's table).
ASSETS: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
#: The files only change with the package, so browsers may keep them for a day.
_ASSET_HEADERS = {"Cache-Control": "public, max-age=86400"}

router = APIRouter(include_in_schema=False)


@router.get("/docs")
async def docs(request: Request) -> HTMLResponse:
    """Swagger UI for this app's ``/openapi.json``, with every asset from this app."""
    root = str(request.scope.get("root_path", "")).rstrip("/")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - docs",
        swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon-32x32.png",
        # Swagger UI's default validator badge is an image from the internet.
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get(ASSETS_PATH + "/{name}")
async def docs_asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no docs asset {name!r}; there are {sorted(ASSETS)}")
    return FileResponse(Path(swagger_ui_path) / name, media_type=media_type, headers=_ASSET_HEADERS)
