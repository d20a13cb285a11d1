"""/docs (Swagger UI) and /redoc that work without the internet: their assets are served by this server.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on an air-gapped cluster /docs is a blank
page. The assets come instead from the `fastapi-offline` package (the server extra installs it: Swagger UI
5, which reads OpenAPI 3.1, and ReDoc, refreshed with each of its releases), served under /docs/assets/,
with the pages themselves made by FastAPI's `get_swagger_ui_html` and `get_redoc_html`. Only the asset
directory is used, found without importing the package. Without it (an install that skipped the extra's
dependency) the pages load the assets from the CDN as before, and the server says so once at start.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.responses import FileResponse, HTMLResponse

logger = logging.getLogger("tokenizer")

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
ASSETS_URL = "/docs/assets"
ASSET_PACKAGE = "fastapi_offline"
# The files served, each at ASSETS_URL/<name>, and their media types.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
ASSET_PATHS = frozenset(f"{ASSETS_URL}/{name}" for name in ASSETS)


def asset_directory() -> Path | None:
    """Where the installed assets are (the package's static/ folder), or None when they are not installed."""
    spec = importlib.util.find_spec(ASSET_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        static = Path(location) / "static"
        if all((static / name).is_file() for name in ASSETS):
            return static
    return None


def install_docs(app: FastAPI) -> None:
    """/docs, /docs/oauth2-redirect and /redoc on `app` (made with docs_url=None, redoc_url=None), with their assets."""
    directory = asset_directory()
    if directory is None:
        logger.warning(
            "Swagger UI assets are not installed (pip install fastapi-offline): /docs and /redoc load them from a CDN"
        )

    def assets(request: Request, **names: str) -> dict[str, str]:
        """The pages' asset URLs under this server (FastAPI's CDN defaults when the assets are not installed)."""
        root = request.scope.get("root_path", "")
        return {} if directory is None else {key: f"{root}{ASSETS_URL}/{name}" for key, name in names.items()}

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_URL}",
            swagger_ui_parameters=app.swagger_ui_parameters,
            **assets(
                request,
                swagger_js_url="swagger-ui-bundle.js",
                swagger_css_url="swagger-ui.css",
                swagger_favicon_url="favicon.png",
            ),
        )

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=f"{request.scope.get('root_path', '')}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            with_google_fonts=directory is None,
            **assets(request, redoc_js_url="redoc.standalone.js", redoc_favicon_url="favicon.png"),
        )

    if directory is None:
        return
    for name, media_type in ASSETS.items():
        _serve(app, f"{ASSETS_URL}/{name}", directory / name, media_type)


def _serve(app: FastAPI, path: str, file: Path, media_type: str) -> None:
    @app.get(path, include_in_schema=False)
    async def serve() -> FileResponse:
        return FileResponse(file, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})
