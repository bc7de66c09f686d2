"""A model's engine as the HTTP side of this process uses it (``protocol.engine_client.
ModelEngine``): it takes the API side's output state, makes the engine's own sequence from the
``EngineRequest`` it carries, and sends what the sequence draws back to that state. The engine
core does the same for an API process's requests (``neuron/core/link.py``)."""

from __future__ import annotations

import asyncio
from typing import Callable

from protocol.engine_client import EngineStats, FinishEvent, Submitted

from .engine import Engine
from .request import GenRequest

OnFinish = Callable[[str, Submitted, FinishEvent], None]  # (model id, output state, how it ended)


class LocalSink:
    """One sequence's way out of the engine to its output state, in this process."""

    __slots__ = ("out", "client")

    def __init__(self, out: Submitted, client: LocalEngine) -> None:
        self.out, self.client = out, client

    def token(self, token: int, logprobs: list[tuple[int, float]] | None, end: int) -> bool:
        return self.out.token(token, logprobs, end)

    def finish(self, event: FinishEvent) -> None:
        self.client.ended(self.out, event)


class LocalEngine:
    def __init__(self, engine: Engine, model_id: str, on_finish: OnFinish | None = None) -> None:
        self.engine, self.model_id, self.on_finish = engine, model_id, on_finish
        self.cfg = engine.cfg
        self.running: dict[Submitted, GenRequest] = {}

    def submit(self, out: Submitted) -> None:
        req = GenRequest.of(out.wire, LocalSink(out, self), out.constraint)
        self.engine.submit(req)
        self.running[out] = req
        req.admitted.add_done_callback(lambda fut: self._admitted(out, req, fut))

    def abort(self, out: Submitted) -> None:
        req = self.running.pop(out, None)  # one never admitted is dropped without a word
        if req is not None:
            self.engine.abort(req)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def ended(self, out: Submitted, event: FinishEvent) -> None:
        self.running.pop(out, None)
        out.finish(event)
        if self.on_finish is not None:
            self.on_finish(self.model_id, out, event)

    def _admitted(self, out: Submitted, req: GenRequest, fut: asyncio.Future) -> None:
        error = None if fut.cancelled() else fut.exception()
        if error is not None:  # refused after it was queued: the engine has let it go
            self.running.pop(out, None)
        out.admit(req.cached_tokens, error)
