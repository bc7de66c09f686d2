"""``/openapi.json``: an OpenAPI 3.1 document generated from the route table and the msgspec
Structs the server validates with (``msgspec.json.schema_components``)."""

from __future__ import annotations

from typing import Any

import msgspec

import neuron

from neuron.server.schemas import ErrorEnvelope

REF = "#/components/schemas/{name}"


def build_openapi(routes: list) -> dict[str, Any]:
    """The document of ``routes`` (``routes.ApiRoute``s: method, path, summary, tag, auth, body,
    response, streams)."""
    kinds: list[type] = [ErrorEnvelope]
    for route in routes:
        kinds += [k for k in (route.body, route.response, route.error) if k is not None and k not in kinds]
    refs, components = msgspec.json.schema_components(kinds, ref_template=REF)
    ref = dict(zip(kinds, refs))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        ok: dict[str, Any] = {"application/json": {"schema": ref[route.response] if route.response else {"type": "object"}}}
        if route.streams:
            events = "data: <chunk> lines, then data: [DONE]" if route.error is ErrorEnvelope else \
                "event: <name> and data: <event> lines"
            ok["text/event-stream"] = {"schema": {"type": "string", "description": events}}
        envelope = "the OpenAI envelope" if route.error is ErrorEnvelope else "the Anthropic envelope"
        error = {"description": f"Error ({envelope})", "content": {"application/json": {"schema": ref[route.error]}}}
        op: dict[str, Any] = {
            "operationId": f"{route.method.lower()}{route.path.replace('/', '_').replace('.', '_')}",
            "summary": route.summary, "tags": [route.tag],
            "parameters": [{"name": "x-request-id", "in": "header", "required": False, "schema": {"type": "string"},
                            "description": "echoed in the response; made when absent"}],
            "responses": {"200": {"description": "OK", "content": ok}, "default": error},
        }
        if route.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[route.body]}}}
        if route.auth == "api":
            op["security"] = [{"api": []}, {"api_key": []}]
        elif route.auth is not None:
            op["security"] = [{route.auth: []}]
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "neuron", "version": neuron.__version__,
                 "description": "OpenAI- and Anthropic-compatible inference API and operations routes of "
                                "the neuron daemon"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "api": {"type": "http", "scheme": "bearer", "description": "[server] api_key, when set"},
            "api_key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                        "description": "[server] api_key, as Anthropic's clients send it"},
            "admin": {"type": "http", "scheme": "bearer", "description": "[server] admin_api_key (else api_key)"},
        }},
    }
