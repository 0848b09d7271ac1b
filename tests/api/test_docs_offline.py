"""`/docs` and `/redoc` work without internet: every script, stylesheet and icon the pages load is
served by the service itself (api/docs_assets.py, files from the fastapi-offline package)."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import make_settings

from autotune.api.main import create_app


class _Assets(HTMLParser):
    """The URLs a page loads: <script src>, <link href> (stylesheet, icon)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        url = values.get("src") if tag == "script" else values.get("href") if tag == "link" else None
        if url:
            self.urls.append((tag, url))


def page_assets(html: str) -> list[tuple[str, str]]:
    parser = _Assets()
    parser.feed(html)
    return parser.urls


def external(urls: list[tuple[str, str]]) -> list[str]:
    """The URLs that leave the service: absolute (scheme://) or protocol-relative (//host)."""
    return [url for _, url in urls if "://" in url or url.startswith("//")]


# What each page must load, and a string that proves the body is the real library.
PAGES = {
    "/docs": {"swagger-ui-bundle.js": "SwaggerUIBundle", "swagger-ui.css": ".swagger-ui", "favicon.png": "PNG"},
    "/redoc": {"redoc.standalone.js": "Redoc", "favicon.png": "PNG"},
}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_docs_page_loads_every_asset_from_the_service(client: TestClient, page: str) -> None:
    response = client.get(page)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "://" not in html, "the page names an outside URL (a CDN, fonts, a validator)"
    urls = page_assets(html)
    assert not external(urls)
    loaded = {url.rsplit("/", 1)[-1]: url for _, url in urls}
    assert set(loaded) == set(PAGES[page]), f"{page} loads {sorted(loaded)}"
    for name, marker in PAGES[page].items():
        url = loaded[name]
        assert url.startswith("/"), url
        asset = client.get(url)
        assert asset.status_code == 200, (url, asset.status_code)
        assert len(asset.content) > (100 if name.endswith(".png") else 10_000), (url, len(asset.content))
        assert marker.encode() in asset.content[:200_000], (url, marker)
    assert "/openapi.json" in html


def test_the_assets_have_their_content_types(client: TestClient) -> None:
    types = {"swagger-ui-bundle.js": "javascript", "redoc.standalone.js": "javascript", "swagger-ui.css": "text/css",
             "favicon.png": "image/png"}
    for name, kind in types.items():
        response = client.get(f"/docs/assets/{name}")
        assert response.status_code == 200
        assert kind in response.headers["content-type"], (name, response.headers["content-type"])
    assert client.get("/docs/assets/nothing.js").status_code == 404
    assert client.get("/docs/assets/%2e%2e/core.py").status_code == 404  # fastapi_offline/core.py: outside


def test_fastapis_stock_pages_would_fail_this_check() -> None:
    """The check above can fail: FastAPI's own /docs and /redoc load from a CDN."""
    with TestClient(FastAPI()) as stock:
        for page in PAGES:
            assert any("cdn.jsdelivr.net" in url for url in external(page_assets(stock.get(page).text)))


def test_the_openapi_schema_still_works_without_the_docs_routes(client: TestClient) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/v1/studies" in paths and "/v1/health" in paths
    assert not [p for p in paths if p.startswith(("/docs", "/redoc"))]
    assert client.get("/docs/oauth2-redirect").status_code == 200


def test_the_docs_need_no_token_with_auth_on(tmp_path: Path) -> None:
    app = create_app(make_settings(f"sqlite:///{tmp_path}/auth.db", auth=True))
    with TestClient(app) as c:
        for url in ["/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui-bundle.js",
                    "/docs/assets/redoc.standalone.js"]:
            assert c.get(url).status_code == 200, url
        assert c.post("/v1/studies", json={}).status_code == 401  # writes still need a token


def test_behind_a_proxy_prefix_the_pages_point_under_it(app: FastAPI) -> None:
    with TestClient(app, root_path="/autotune") as c:
        for page in PAGES:
            urls = [url for _, url in page_assets(c.get(page).text)]
            assert urls and all(url.startswith("/autotune/docs/assets/") for url in urls), urls
        assert "'/autotune/openapi.json'" in c.get("/docs").text
