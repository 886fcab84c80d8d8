"""The web page at / (and /dashboard): a chat box that streams from /v1/chat/completions, and live panels
read from GET /stats every second. Plain HTML and one script shipped in server/static: no build step, no
CDN (servers often have no internet). The page asks for the API key itself and keeps it in the page's
memory only; the server never stores it. The page itself is open; /stats needs the key when /metrics does
(ServerSettings.protect_metrics), and the page sends it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from server.errors import APIError
from server.live_stats import live_stats

STATIC = Path(__file__).parent / "static"
# The only files served from STATIC, by name: a request can never name a path outside it.
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def install_dashboard(app: FastAPI, state, authorize: Callable[[Request], Awaitable[None]]) -> None:
    """The page, its files, and GET /stats behind `authorize` (a FastAPI dependency)."""
    page = (STATIC / "dashboard.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise APIError(404, f"no static file {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get("/stats", include_in_schema=False, dependencies=[Depends(authorize)])
    async def stats() -> JSONResponse:
        return JSONResponse(live_stats(state))
