"""The one place where failures become HTTP responses: the OpenAI error envelope."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from neuron.errors import ApiError, LoadError

from neuron.server.request_id import HEADER, request_id_header

log = logging.getLogger("neuron.server")


def envelope(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(envelope(err), status_code=err.status, headers=headers)


def from_load_error(exc: LoadError) -> ApiError:
    return ApiError(exc.status, exc.code, exc.message, param="model")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def load_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LoadError)
    return error_response(from_load_error(exc))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (unknown path, wrong method) in the same envelope."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return error_response(ApiError(exc.status_code, code, str(exc.detail)))


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Runs outside the request-id middleware (in Starlette's ServerErrorMiddleware): the id is
    added here."""
    headers = request_id_header(request)
    log.exception("internal error on %s %s", request.method, request.url.path,
                  extra={"request_id": headers.get(HEADER)})
    return error_response(ApiError(500, "internal_error", f"internal error: {type(exc).__name__}"), headers)
