"""The Starlette application: the route table over one shared AppState, behind the request-id
and (when configured) CORS middleware. The engine is an ``EngineClient``
(``protocol/engine_client.py``): the models in this process, or in the engine core."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from neuron.config import Config, ServerConfig
from neuron.server.grammar.worker import GrammarCompiler
from neuron.server.output.state import OutputState
from protocol.engine_client import FinishEvent
from neuron.errors import ApiError, LoadError
from neuron.loader.template_worker import TemplateRenderer
from neuron.local_client import LocalClient

from neuron.server.body_budget import BodyBudget
from neuron.server.keys import KeyRing
from neuron.server.errors import api_error_handler, http_error_handler, internal_error_handler, load_error_handler
from neuron.server.metrics import Metrics
from neuron.server.model_access import ModelAccess
from neuron.server.access_log import AccessLog
from neuron.server.cross_site import CHANGES, RefuseCrossSite
from neuron.server.request_id import HEADER, RequestIdMiddleware
from neuron.server.request_trace import log_finish, trace_of
from neuron.server.core_client import CoreClient
from neuron.server.routes import route_table
from neuron.server.state import AppState

log = logging.getLogger("neuron.server")


def create_app(cfg: Config, core: str | None = None, core_token: str = "") -> Starlette:
    """``core``: the engine core's endpoint, in an API process (``[server] api_processes``), and
    ``core_token`` the token it gave this one; None: the models run in this process."""
    metrics = Metrics(cfg.server.max_principals)

    def on_finish(model: str, req: OutputState, fin: FinishEvent) -> None:
        trace = trace_of(req)
        metrics.request_finished(model, req, fin, trace)
        log_finish(model, req, fin, trace)

    templates = TemplateRenderer(cfg.templates, cfg.server.allow_request_chat_template)
    client = LocalClient(cfg, on_finish=on_finish, templates=templates) if core is None else \
        CoreClient(cfg, core, core_token, on_finish)
    state = AppState(cfg=cfg, engine_client=client, metrics=metrics,
                     compiler=GrammarCompiler(cfg.grammar), templates=templates,
                     body_budget=BodyBudget(cfg.http.max_inflight_body_bytes),
                     access=ModelAccess.from_config(cfg), responses=client.responses(cfg),
                     keys=KeyRing(cfg.server.api_key, cfg.server.api_keys_file, cfg.server.key_max_running,
                                  cfg.server.key_max_waiting))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        task = asyncio.create_task(client.start(state))
        try:
            yield
        finally:
            task.cancel()
            await client.shutdown()
            state.compiler.close()
            templates.close()

    routes = [Route(r.path, r.endpoint, methods=[r.method]) for r in route_table()]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=_middleware(cfg.server, cfg.log.access),
        exception_handlers={ApiError: api_error_handler, LoadError: load_error_handler,
                            HTTPException: http_error_handler, Exception: internal_error_handler},
    )
    app.state.neuron = state
    return app


def _middleware(server: ServerConfig, access_log: bool) -> list[Middleware]:
    stack = [Middleware(RequestIdMiddleware)]
    if access_log:  # inside the id's middleware: its lines carry the id
        stack.append(Middleware(AccessLog))
    changes = frozenset((r.method, r.path) for r in route_table() if r.method in CHANGES)
    stack.append(Middleware(RefuseCrossSite, allowed=server.cors_allow_origins, routes=changes))
    if server.cors_allow_origins:  # off by default: no origin may read our answers from a browser
        stack.append(Middleware(CORSMiddleware, allow_origins=server.cors_allow_origins,
                                allow_methods=server.cors_allow_methods, allow_headers=server.cors_allow_headers,
                                expose_headers=[HEADER], max_age=600))
    return stack
