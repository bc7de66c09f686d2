"""``/openapi.json``: an OpenAPI 3.1 document generated from the route table and the msgspec
Structs the server validates with (``msgspec.json.schema_components``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import neuron

from .schemas import ErrorEnvelope

REF = "#/components/schemas/{name}"


def build_openapi() -> dict[str, Any]:
    from .routes import route_table

    routes = route_table()
    kinds: list[type] = [ErrorEnvelope]
    for route in routes:
        kinds += [k for k in (route.body, route.response) if k is not None and k not in kinds]
    refs, components = msgspec.json.schema_components(kinds, ref_template=REF)
    ref = dict(zip(kinds, refs))
    error = {"description": "Error (the OpenAI envelope)", "content": {"application/json": {"schema": ref[ErrorEnvelope]}}}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        ok: dict[str, Any] = {"application/json": {"schema": ref[route.response] if route.response else {"type": "object"}}}
        if route.streams:
            ok["text/event-stream"] = {"schema": {"type": "string", "description": "data: <chunk> lines, then data: [DONE]"}}
        op: dict[str, Any] = {
            "operationId": f"{route.method.lower()}{route.path.replace('/', '_').replace('.', '_')}",
            "summary": route.summary, "tags": [route.tag],
            "parameters": [{"name": "x-request-id", "in": "header", "required": False, "schema": {"type": "string"},
                            "description": "echoed in the response; made when absent"}],
            "responses": {"200": {"description": "OK", "content": ok}, "default": error},
        }
        if route.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[route.body]}}}
        if route.auth is not None:
            op["security"] = [{route.auth: []}]
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "neuron", "version": neuron.__version__,
                 "description": "OpenAI-compatible inference API and operations routes of the neuron daemon"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "api": {"type": "http", "scheme": "bearer", "description": "[server] api_key, when set"},
            "admin": {"type": "http", "scheme": "bearer", "description": "[server] admin_api_key (else api_key)"},
        }},
    }


@lru_cache(maxsize=1)
def _document() -> bytes:
    return msgspec.json.encode(build_openapi())


async def openapi_json(request: Request) -> Response:
    return Response(_document(), media_type="application/json")
