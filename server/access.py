"""Who may call what: the API key, checked on the headers before anything of the body is read.

One definition for `ladder serve` (the `KeyGate` middleware, with the routes' own `authorize` dependency
behind it) and for the Ray ingress (deploy/ingress.py), so the two never disagree on what is open.
Open without the key: GET/HEAD of the probes, the web page and its assets, and the API's schema and docs;
/metrics and /stats too unless they are protected (exact prefix-cache hit counts tell a watcher whether a
prompt was seen before). Everything else needs the key, unknown paths included, so a new route is
protected until it is listed here.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response

if TYPE_CHECKING:
    from server.app import ServerSettings

PUBLIC_PATHS = frozenset({"/health", "/ready", "/", "/dashboard", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})
METRICS_PATHS = frozenset({"/metrics", "/stats"})
PUBLIC_PREFIXES = ("/static/",)
INVALID_KEY = "missing or invalid API key"


def is_public(method: str, path: str, metrics_need_key: bool) -> bool:
    """Whether a request for `path` is answered without the API key."""
    if method not in ("GET", "HEAD"):
        return False
    if path in METRICS_PATHS:
        return not metrics_need_key
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def bearer_matches(authorization: str, key: bytes) -> bool:
    """An `Authorization: Bearer <key>` header value against the key, in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key)


def check_key(key: str | None) -> bytes | None:
    """The configured key as bytes; an empty key is refused (a header of `Bearer ` would match it, so the
    server would run open while it looks protected)."""
    if key is None:
        return None
    if not key:
        raise ValueError("the API key is empty: give a key, or none to serve without one")
    return key.encode()


class KeyGate:
    """ASGI middleware: 401 for a request that needs the key and lacks it, before its body is read (an
    unauthenticated client must not make the server read and parse 4 MiB of JSON)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings, self.key = app, settings, check_key(settings.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and not is_public(
                scope["method"], scope["path"], self.settings.metrics_need_key):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not bearer_matches(authorization, self.key):
                response = error_response(401, INVALID_KEY, code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
