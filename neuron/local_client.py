"""The in-process ``EngineClient`` (``protocol/engine_client.py``): the models run here, in the
registry's rank groups; serving begins with the config's startup models loaded in turn."""

from __future__ import annotations

import logging

from . import heap
from .config import Config
from .errors import ApiError, LoadError
from .registry import Registry
from .response_store import ResponseStore

log = logging.getLogger("neuron.server")


class LocalClient(Registry):
    async def start(self, state) -> None:
        """Load the startup models in turn; ``state.starting`` ends when all serve. A failure
        (a bug too) ends the startup, said, never a server that waits forever."""
        try:
            for entry in self.cfg.models:
                await self.load(entry)
        except Exception as exc:
            state.startup_error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (LoadError, ApiError)):
                log.error("startup model failed to load: %s", state.startup_error)
            else:
                log.exception("startup model failed to load: %s", state.startup_error)
            if state.on_startup_failure is not None:
                state.on_startup_failure(state.startup_error)
            return
        state.starting = False
        heap.settle_collector()
        log.info("ready: %s", ", ".join(self.models))

    def responses(self, cfg: Config) -> ResponseStore:
        return ResponseStore(cfg.server.stored_responses)
