"""`/docs` (Swagger UI) and `/redoc` (ReDoc) that work offline.

FastAPI's stock pages load their JavaScript and CSS from a CDN, so without internet they render
blank. Here they are FastAPI's own pages (`get_swagger_ui_html`, `get_redoc_html`) pointed at the
files of the `fastapi-offline` package, served under `ASSETS_URL`; like `/openapi.json`, no token.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_URL = "/docs/assets"  # a mount: its files are ASSETS_URL/<name>; /docs itself is the page
SWAGGER_JS = "swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui.css"
REDOC_JS = "redoc.standalone.js"
FAVICON = "favicon.png"
ASSET_FILES = (SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON)

# Swagger UI sends the schema to validator.swagger.io for its badge unless this is null.
SWAGGER_UI_PARAMETERS: dict[str, Any] = {"validatorUrl": None}


class DocsAssetsMissing(RuntimeError):
    """The installed fastapi-offline does not hold the files the pages load."""


def assets_dir() -> Path:
    """The folder of the docs assets (fastapi-offline's `static/`), checked to hold every file."""
    try:
        folder = Path(str(importlib.resources.files("fastapi_offline") / "static"))
    except ModuleNotFoundError:
        raise DocsAssetsMissing("the package fastapi-offline is not installed (it serves the /docs and /redoc "
                                "assets): pip install 'fastapi-offline>=1.7.7,<2'") from None
    missing = [name for name in ASSET_FILES if not (folder / name).is_file()]
    if missing:
        raise DocsAssetsMissing(f"fastapi-offline at {folder} lacks {', '.join(missing)}; reinstall it "
                                "(pip install --force-reinstall 'fastapi-offline>=1.7.7,<2')")
    return folder


def install_docs(app: FastAPI) -> None:
    """Serve the assets under ASSETS_URL and the pages at DOCS_URL, its OAuth2 redirect and REDOC_URL.

    `app` must be built with docs_url=None and redoc_url=None (FastAPI's CDN pages off).
    """
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")  # behind a proxy that strips a prefix

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        prefix = root(request)
        return get_swagger_ui_html(
            openapi_url=prefix + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{prefix}{ASSETS_URL}/{SWAGGER_JS}",
            swagger_css_url=f"{prefix}{ASSETS_URL}/{SWAGGER_CSS}",
            swagger_favicon_url=f"{prefix}{ASSETS_URL}/{FAVICON}",
            oauth2_redirect_url=prefix + oauth2_redirect_url if oauth2_redirect_url else None,
            init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters={**SWAGGER_UI_PARAMETERS, **(app.swagger_ui_parameters or {})},
        )

    if oauth2_redirect_url:
        @app.get(oauth2_redirect_url, include_in_schema=False)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        prefix = root(request)
        return get_redoc_html(
            openapi_url=prefix + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{prefix}{ASSETS_URL}/{REDOC_JS}",
            redoc_favicon_url=f"{prefix}{ASSETS_URL}/{FAVICON}",
            with_google_fonts=False,  # fonts.googleapis.com: the page's own fonts do
        )
