"""``x-request-id``: the client's (sanitised, bounded) or one made here. It is echoed on every
response, errors included, names the request in the Engine and in every log line logged while
the request is served."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron.logs import request_id_var

HEADER = "x-request-id"
MAX_LEN = 128
# What a log pipeline, a header and a shell all take without quoting.
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@/+=-]")
SCOPE_KEY = "neuron.request_id"


def sanitise(raw: str | None) -> str:
    clean = _UNSAFE.sub("", raw or "")[:MAX_LEN]
    return clean or uuid.uuid4().hex


def request_id(request: Request) -> str:
    """The id the middleware gave this request (a fresh one outside the middleware, as in tests)."""
    return request.scope.get(SCOPE_KEY) or sanitise(None)


def request_id_header(request: Request) -> dict[str, str]:
    rid = request.scope.get(SCOPE_KEY)
    return {HEADER: rid} if rid else {}


class RequestIdMiddleware:
    """Outermost of our middleware, so CORS preflights carry the id too. Responses made by
    Starlette's ServerErrorMiddleware (the 500 handler) sit outside it: that handler adds the
    header itself from the scope."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER.encode()), None)
        rid = sanitise(raw)
        scope[SCOPE_KEY] = rid
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
