"""The access log: one line per request at the default level (``neuron.access``) — method, path,
status, principal, duration, request id and, for a 4xx or 5xx, the error's message (bounded) —
so that an operator sees why a client failed. ``[log] access = false`` turns it off."""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron.server.request_id import SCOPE_KEY as REQUEST_ID
from neuron.server.state import PRINCIPAL

log = logging.getLogger("neuron.access")
MAX_MESSAGE = 300  # characters of an error's message in the line
_BODY = 16384  # bytes of an error body read for its message


def error_message(body: bytes) -> str:
    """The message of an error body (OpenAI's and Anthropic's envelopes), cut to MAX_MESSAGE."""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        text = err.get("message", "") if isinstance(err, dict) else str(err)
    except (ValueError, UnicodeDecodeError):
        text = body.decode("utf-8", "replace")
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…(cut)"


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0
        body = bytearray()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < _BODY:
                body.extend(message.get("body", b"")[:_BODY - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            principal = scope.get(PRINCIPAL)
            path = scope.get("path", "")[:200]
            line = (f'{scope.get("method", "")} {path} {status or 499} principal={getattr(principal, "name", "-")} '
                    f'{(time.monotonic() - start) * 1000:.1f}ms id={scope.get(REQUEST_ID, "-")}')
            if status >= 400:
                line += f" error={error_message(bytes(body))!r}"
            log.info(line)
