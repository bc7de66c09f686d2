"""The Starlette application: a list of routes over one shared AppState."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from neuron.config import Config
from neuron.errors import ApiError
from neuron.loader.errors import LoadError
from neuron.registry import Registry

from . import admin_routes, openai_routes, responses
from .errors import api_error_handler, http_error_handler, internal_error_handler, load_error_handler
from .metrics import Metrics
from .response_store import ResponseStore
from .state import AppState

log = logging.getLogger("neuron.server")


def create_app(cfg: Config) -> Starlette:
    metrics = Metrics()
    state = AppState(cfg=cfg, registry=Registry(cfg, on_finish=metrics.request_finished), metrics=metrics,
                     responses=ResponseStore(cfg.server.stored_responses))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        task = asyncio.create_task(_load_startup_models(state))
        try:
            yield
        finally:
            task.cancel()
            await state.registry.shutdown()

    routes = [
        Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_routes.completions, methods=["POST"]),
        Route("/v1/models", openai_routes.list_models, methods=["GET"]),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
        Route("/health", admin_routes.health, methods=["GET"]),
        Route("/metrics", admin_routes.metrics, methods=["GET"]),
        Route("/models", admin_routes.list_models, methods=["GET"]),
        Route("/models/load", admin_routes.load_model, methods=["POST"]),
        Route("/models/unload", admin_routes.unload_model, methods=["POST"]),
        Route("/debug/fault", admin_routes.inject_fault, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ApiError: api_error_handler, LoadError: load_error_handler,
                            HTTPException: http_error_handler, Exception: internal_error_handler},
    )
    app.state.neuron = state
    return app


async def _load_startup_models(state: AppState) -> None:
    try:
        for entry in state.cfg.models:
            await state.registry.load(entry)
    except (LoadError, ApiError) as exc:
        state.startup_error = getattr(exc, "message", str(exc))
        log.error("startup model failed to load: %s", state.startup_error)
        if state.on_startup_failure is not None:
            state.on_startup_failure(state.startup_error)
        return
    state.starting = False
    log.info("ready: %s", ", ".join(state.registry.models))
