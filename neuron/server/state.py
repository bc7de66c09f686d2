"""What every route shares: the config, the Registry, metrics, and whether we are draining."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Callable

from starlette.requests import Request

from neuron.config import Config
from neuron.engine.grammar_worker import GrammarCompiler
from neuron.errors import ApiError
from neuron.loader.template_worker import TemplateRenderer
from neuron.registry import Registry

from neuron.server.body_budget import BodyBudget
from neuron.server.metrics import Metrics
from neuron.server.model_access import ModelAccess
from neuron.server.openai.response_store import ResponseStore


@dataclass
class AppState:
    cfg: Config
    registry: Registry
    metrics: Metrics
    compiler: GrammarCompiler
    templates: TemplateRenderer
    body_budget: BodyBudget
    access: ModelAccess = field(default_factory=ModelAccess)
    starting: bool = True
    draining: bool = False
    startup_error: str | None = None
    on_startup_failure: Callable[[str], None] | None = None
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(256))


def require_key(request: Request, state: AppState, *, admin: bool) -> None:
    """Key check in constant time (``Authorization: Bearer`` or ``x-api-key``). Admin routes take the admin key (or, when none is
    set, the inference key); with no key configured the route is open."""
    server = state.cfg.server
    key = (server.admin_api_key or server.api_key) if admin else server.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        given = request.headers.get("x-api-key", "")
    if not given or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "invalid_api_key", "missing or invalid API key")
