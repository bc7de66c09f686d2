"""Failures of the Anthropic routes in Anthropic's envelope and status codes: ``{"type": "error",
"error": {"type", "message"}}``, 529 ``overloaded_error`` where the OpenAI routes send 503. The
message starts with the field it is about, as Anthropic's own do."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron.errors import ApiError, LoadError

from neuron.server.errors import from_load_error
from neuron.server.request_id import request_id

log = logging.getLogger("neuron.server")

# status -> (Anthropic's status, its error type)
KINDS = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"), 403: (403, "permission_error"),
         404: (404, "not_found_error"), 413: (413, "request_too_large"), 422: (400, "invalid_request_error"),
         429: (429, "rate_limit_error"), 503: (529, "overloaded_error"), 504: (504, "timeout_error")}


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """Every error of the Anthropic routes."""
    type: str
    error: AnthropicErrorDetail


def anthropic_error(err: ApiError) -> dict:
    _, kind = KINDS.get(err.status, (err.status, "api_error"))
    message = err.message
    if err.param and not message.startswith(f"{err.param}:"):
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    status, _ = KINDS.get(err.status, (500 if err.status >= 500 else err.status, ""))
    headers = dict(headers or {})
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(anthropic_error(err), status_code=status, headers=headers)


Endpoint = Callable[[Request], Awaitable[Response]]


def in_anthropic_envelope(endpoint: Endpoint, rename: Callable[[Request, ApiError], None]) -> Endpoint:
    """``endpoint`` with its failures answered in Anthropic's envelope; ``rename`` puts the
    Anthropic field's name on an error the chat path raised."""
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            rename(request, exc)
            return error_response(exc)
        except LoadError as exc:
            return error_response(from_load_error(exc))
        except Exception as exc:
            log.exception("internal error on %s %s", request.method, request.url.path,
                          extra={"request_id": request_id(request)})
            return error_response(ApiError(500, "internal_error", f"internal error: {type(exc).__name__}"))

    wrapped.__name__ = endpoint.__name__
    wrapped.__doc__ = endpoint.__doc__
    return wrapped
