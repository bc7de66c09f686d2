"""Every HTTP route in one table: the app is built from it and ``/openapi.json`` is generated from
it, with the same msgspec Structs the route decodes its body with, so neither can drift."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.server import openapi
from neuron.server.admin import routes as admin_routes
from neuron.server.messages import routes as messages_routes
from neuron.server.messages.errors import AnthropicError
from neuron.server.messages.request import CountTokensRequest, MessagesRequest
from neuron.server.openai import routes as openai_routes
from neuron.server.openai import responses
from neuron.server.openai import tokenize as tokenize_routes
from neuron.server.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                   ErrorEnvelope, FaultRequest, LoadRequest, TokenizeRequest, TokenizeResponse,
                                   UnloadRequest)

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str
    endpoint: Endpoint
    summary: str
    tag: str
    auth: str | None = None  # "api": the inference key; "admin": the admin key; None: open
    body: type | None = None  # the Struct the body is decoded into
    response: type | None = None  # the Struct of a 200 answer, where it has one
    streams: bool = False  # may answer text/event-stream
    error: type = ErrorEnvelope  # the Struct of its errors


ROUTES: list[ApiRoute] = [
    ApiRoute("POST", "/v1/chat/completions", openai_routes.chat_completions, "Chat completion (SSE with stream)",
             "openai", "api", ChatRequest, streams=True),
    ApiRoute("POST", "/v1/completions", openai_routes.completions, "Text completion (SSE with stream)",
             "openai", "api", CompletionRequest, streams=True),
    ApiRoute("GET", "/v1/models", openai_routes.list_models, "Models that serve requests", "openai", "api"),
    ApiRoute("POST", "/v1/responses", responses.create_response, "Responses API (SSE events with stream)",
             "openai", "api", responses.ResponsesRequest, streams=True),
    ApiRoute("GET", "/v1/responses/{response_id}", responses.get_response, "A stored response", "openai", "api"),
    ApiRoute("POST", "/v1/messages", messages_routes.create_message,
             "Anthropic Messages API (Anthropic's SSE events with stream)", "anthropic", "api", MessagesRequest,
             streams=True, error=AnthropicError),
    ApiRoute("POST", "/v1/messages/count_tokens", messages_routes.count_tokens,
             "The prompt tokens of a Messages API request", "anthropic", "api", CountTokensRequest,
             messages_routes.CountTokensResponse, error=AnthropicError),
    ApiRoute("POST", "/tokenize", tokenize_routes.tokenize, "Prompt or conversation to token ids", "tokens",
             "api", TokenizeRequest, TokenizeResponse),
    ApiRoute("POST", "/detokenize", tokenize_routes.detokenize, "Token ids to text", "tokens", "api",
             DetokenizeRequest, DetokenizeResponse),
    ApiRoute("GET", "/", admin_routes.root, "What answers here (clients probe the base URL; HEAD too)",
             "operations"),
    ApiRoute("GET", "/api/hello", admin_routes.root, "The same: Claude Code probes it (HEAD) before a session",
             "operations"),
    ApiRoute("GET", "/health", admin_routes.health, "200 when every model can serve, else 503 and why",
             "operations"),
    ApiRoute("GET", "/version", admin_routes.version, "The release, its git revision, torch, CUDA and the CPU "
             "kernels' level", "operations"),
    ApiRoute("GET", "/metrics", admin_routes.metrics, "Prometheus text", "operations", "admin"),
    ApiRoute("GET", "/models", admin_routes.list_models, "Every model with its status", "admin", "admin"),
    ApiRoute("POST", "/models/load", admin_routes.load_model, "Load a model (concurrent loads coalesce)",
             "admin", "admin", LoadRequest),
    ApiRoute("POST", "/models/unload", admin_routes.unload_model, "Unload a model after its requests end",
             "admin", "admin", UnloadRequest),
    ApiRoute("POST", "/debug/fault", admin_routes.inject_fault,
             "Test hook: a rank fails its next step (only with [debug] fault_injection)", "debug", "admin",
             FaultRequest),
]


@lru_cache(maxsize=1)
def _document() -> bytes:
    return msgspec.json.encode(openapi.build_openapi(route_table()))


async def openapi_json(request: Request) -> Response:
    return Response(_document(), media_type="application/json")


def route_table() -> list[ApiRoute]:
    return [*ROUTES, ApiRoute("GET", "/openapi.json", openapi_json, "This document", "operations")]
