"""What every route shares: the config, the engine client, metrics, and whether we are draining."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from starlette.requests import Request

from protocol.engine_client import EngineClient, ModelView

from neuron.config import Config
from neuron.server.grammar.worker import GrammarCompiler
from neuron.errors import ApiError
from neuron.loader.template_worker import TemplateRenderer
from neuron.response_store import ResponseStore

from neuron.server.body_budget import BodyBudget
from neuron.server.metrics import Metrics
from neuron.server.model_access import ModelAccess
from neuron.server.request_id import request_id, sanitise
from neuron.server.keys import KeyRing, Principal

log = logging.getLogger("neuron.server")
PRINCIPAL = "neuron.principal"  # the request scope's key of its Principal
ANONYMOUS = Principal("anonymous")


@dataclass
class AppState:
    cfg: Config
    engine_client: EngineClient
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
    keys: KeyRing = field(default_factory=KeyRing)

    def model(self, name: str) -> ModelView:
        """The model ``name`` names. While the startup models load, a name that none serves yet
        is answered 503 with Retry-After (as llama.cpp's server answers while it loads, and as the
        OpenAI and Anthropic SDKs retry), not the 404 it gets once they serve."""
        try:
            return self.engine_client.get(name)
        except ApiError as exc:
            if exc.status == 404 and self.starting and self.startup_error is None:
                raise ApiError(503, "model_unavailable", f"model {name!r} is not serving yet: the startup models "
                               "are loading", param="model", retry_after=5) from None
            raise


def require_key(request: Request, state: AppState, *, admin: bool) -> None:
    """Key check in constant time (``Authorization: Bearer`` or ``x-api-key``). Admin routes take
    the admin key (or, when none is set, ``api_key``); the others any key of the key ring, whose
    principal goes in the request's scope (``principal_of``). With no key configured a route is
    open."""
    server = state.cfg.server
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        given = request.headers.get("x-api-key", "")
    given = given.strip()
    if admin:
        key = server.admin_api_key or server.api_key
        if key and not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid_api_key", "missing or invalid API key")
        if not key and (not state.keys.open or server.principal_header):  # fail closed: a named key
            # or a gateway's account never opens the admin routes
            raise ApiError(403, "admin_key_required", "admin routes need [server] admin_api_key (or api_key) "
                           "where named keys or a principal header are set")
        return
    principal = ANONYMOUS if state.keys.open else state.keys.check(given)
    if principal is None:
        raise ApiError(401, "invalid_api_key", "missing or invalid API key")
    account = request.headers.get(server.principal_header, "") if server.principal_header else ""
    if account:
        client = request.client.host if request.client else ""
        if principal.gateway or client in server.trusted_proxies:  # the account this request is for
            principal = replace(principal, name=sanitise(account)[:64])
        else:
            note_untrusted_header(principal.name, server.principal_header)
    request.scope[PRINCIPAL] = principal


_UNTRUSTED: set[str] = set()


def note_untrusted_header(name: str, header: str) -> None:
    """A principal header from a key that is not a gateway's: ignored, and said once per key."""
    if name not in _UNTRUSTED and len(_UNTRUSTED) < 10000:
        _UNTRUSTED.add(name)
        log.warning("%s from key %r ignored: only a key marked gateway = true (or [server] trusted_proxies) may "
                    "name the account", header, name)


def principal_of(request: Request) -> Principal:
    return request.scope.get(PRINCIPAL, ANONYMOUS)


@dataclass(frozen=True)
class Origin:
    """Whose request a sequence is: its HTTP request's id and its principal (fair share)."""

    request_id: str
    who: Principal


def origin_of(request: Request) -> Origin:
    return Origin(request_id(request), principal_of(request))
