"""Requests a web page could make: refused before any route runs. A page the operator opens can
send a POST to 127.0.0.1 without asking (a "simple" request: a form's or ``text/plain`` body)
and the answer's CORS headers only stop it from reading the reply, not the effect (an unload,
a load, generation on the operator's GPU). So every state-changing request (POST, PUT, PATCH,
DELETE) with one of those bodies is a 415, and one whose ``Origin`` is another site than the
server's own (and not in ``[server] cors_allow_origins``) a 403: a browser always sends
``Origin`` with such a request, a client program sends none."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from neuron.errors import ApiError
from neuron.server.errors import error_response

CHANGES = {"POST", "PUT", "PATCH", "DELETE"}
FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def refusal(scope: Scope, allowed: list[str], routes: frozenset[tuple[str, str]]) -> ApiError | None:
    if (scope.get("method"), scope.get("path")) not in routes:  # not a route that changes state: 404, 405, ...
        return None
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in FORM_TYPES:
        return ApiError(415, "unsupported_media_type", f"content-type {kind} is refused (a web page can send it "
                        "unasked): send JSON, content-type application/json", param="content-type")
    origin = headers.get("origin")
    if origin is None or "*" in allowed or origin in allowed:
        return None
    parts = urlsplit(origin)
    if origin != "null" and parts.netloc and parts.netloc == headers.get("host", ""):
        return None  # the server's own pages
    return ApiError(403, "cross_site_request", f"a request from the web page of {origin[:100]!r} is refused: "
                    "add that origin to [server] cors_allow_origins to allow it", param="origin")


class RefuseCrossSite:
    def __init__(self, app: ASGIApp, allowed: list[str], routes: frozenset[tuple[str, str]]) -> None:
        self.app = app
        self.allowed = allowed
        self.routes = routes  # (method, path) of the routes that change state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = refusal(scope, self.allowed, self.routes) if scope["type"] == "http" else None
        if err is None:
            await self.app(scope, receive, send)
            return
        await error_response(err)(scope, receive, send)
