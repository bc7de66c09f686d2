"""An API process's ``EngineClient`` (``protocol/engine_client.py``): the models run in the
engine core, known here from its ``Models`` frames. Each has the spec a route plans with
(tokenizer, template, config: read here from the same files) and an engine that hands requests
to the core. The admin operations (load, unload, a fault) and the stored responses are calls to
the core; draining and the ranks are the core's (it drains every API process, then tells us to
leave)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

import protocol.api_core as m
from protocol.engine_client import EngineStats, Submitted

from neuron.config import Config, EngineConfig, ModelEntry
from neuron.model_names import served
from neuron.loader.spec import ModelSpec, load_spec

from neuron.server.core_link import CoreLink, OnFinish

log = logging.getLogger("neuron.server")
REFRESH_S = 2.0
FIRST_STATE_S = 60.0


class CoreEngine:
    """A model's engine as the routes use it; the requests run in the core."""

    def __init__(self, model_id: str, cfg: EngineConfig, link: CoreLink) -> None:
        self.model_id, self.cfg, self.link = model_id, cfg, link
        self.latest = EngineStats(0, 0, 0, 0, 0, 0)

    def submit(self, out: Submitted) -> None:
        self.link.submit(self.model_id, out)

    def abort(self, out: Submitted) -> None:
        self.link.abort(out)

    def stats(self) -> EngineStats:
        return self.latest


@dataclass
class CoreModel:
    id: str
    entry: ModelEntry
    spec: ModelSpec
    max_len: int
    client: CoreEngine
    status: str = "loading"
    error: str | None = None
    described: dict = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    group: Any = None  # the ranks are the core's

    @property
    def cpu_isa(self) -> str | None:
        return self.described.get("cpu_isa")

    def describe(self) -> dict:
        return self.described

    def telemetry(self) -> list[dict]:
        return self.ranks


class CoreClient:
    def __init__(self, cfg: Config, endpoint: str, token: str, on_finish: OnFinish | None = None) -> None:
        self.cfg = cfg
        self.link = CoreLink(endpoint, token, self._apply, on_finish)
        self.models: dict[str, CoreModel] = {}
        self.cluster = None
        self.state: Any = None  # the AppState whose starting / draining flags the core sets
        self.version = -1
        self.on_closing = None  # called when the core says every API process must leave
        self.known = asyncio.Event()  # the core's first Models frame is applied

    def connect(self) -> None:
        if not self.link.started:
            self.link.start()

    async def start(self, state) -> None:
        """``state`` follows the core's: its starting, draining and startup error."""
        self.state = state
        self.connect()

    def responses(self, cfg: Config) -> CoreResponses:
        return CoreResponses(self.link)

    async def first_state(self) -> None:
        """Until the models are known: a process that took connections before would answer 404
        for a model that serves. A core that sends nothing within FIRST_STATE_S is an error."""
        self.connect()
        try:
            await asyncio.wait_for(self.known.wait(), FIRST_STATE_S)
        except TimeoutError:
            raise RuntimeError(f"the engine core sent no state within {FIRST_STATE_S:.0f}s") from None

    def get(self, model_id: str) -> CoreModel:
        return served(self.models, model_id)

    async def refresh(self) -> None:
        """The core's latest: its answer comes after the ``Models`` frame it sends first. A core
        that does not answer within REFRESH_S leaves the mirror as it is (``/health`` answers
        from it, at once, rather than wait)."""
        try:
            version = int(await self.link.call("refresh", timeout=REFRESH_S))
        except TimeoutError:
            log.warning("the engine core did not answer within %.0fs; answering from the last state", REFRESH_S)
            return
        while self.version < version:
            await asyncio.sleep(0.005)

    async def load(self, entry: ModelEntry) -> CoreModel:
        described = msgspec.json.decode(await self.link.call("load", msgspec.json.encode(entry)))
        handle = self.get(described["id"])
        handle.described = described
        return handle

    async def unload(self, model_id: str, drain_s: float = 30.0) -> str:
        body = await self.link.call("unload", msgspec.json.encode({"model": model_id, "drain_s": drain_s}))
        return msgspec.json.decode(body)

    async def inject_fault(self, model_id: str, rank: int, kind: str) -> str:
        body = msgspec.json.encode({"model": model_id, "rank": rank, "kind": kind})
        return msgspec.json.decode(await self.link.call("fault", body, timeout=15.0))

    # The drain is the core's: it stops admitting, waits, and ends what is left for every API
    # process (whose streams end in band as its Outputs say), then tells each to leave.
    def stop_admission(self) -> None:
        pass

    async def drain(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while self.link.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return not self.link.requests

    def abort_all(self, reason: str) -> None:
        self.link.fail_all(reason)

    def kill_all(self) -> None:
        pass  # the ranks are the core's

    async def shutdown(self) -> None:
        self.link.fail_all("the server is shutting down")
        self.link.close()

    async def _apply(self, frame: m.Models) -> None:
        seen = set()
        for ms in frame.models:
            seen.add(ms.id)
            handle = self.models.get(ms.id)
            entry = msgspec.json.decode(ms.entry, type=ModelEntry)
            if handle is None or handle.entry != entry:
                try:
                    spec = await asyncio.to_thread(load_spec, entry.model, model_id=ms.id,
                                                   hf_cache=self.cfg.runtime.hf_cache or None,
                                                   roots=self.cfg.server.model_roots)
                except Exception as exc:
                    log.error("model %r: its files cannot be read here: %s", ms.id, exc)
                    continue
                handle = self.models[ms.id] = CoreModel(ms.id, entry, spec, ms.max_len,
                                                           CoreEngine(ms.id, self.cfg.engine, self.link))
            handle.status, handle.error, handle.max_len = ms.status, ms.error, ms.max_len
            handle.described = msgspec.json.decode(ms.described) if ms.described else {}
            handle.ranks = msgspec.json.decode(ms.telemetry)
            if ms.stats:
                handle.client.latest = msgspec.json.decode(ms.stats, type=EngineStats)
        for model_id in [k for k in self.models if k not in seen]:
            del self.models[model_id]
        self.cluster = Described(msgspec.json.decode(frame.cluster)) if frame.cluster else None
        if self.state is not None:
            self.state.starting, self.state.draining = frame.starting, frame.draining
            self.state.startup_error = frame.startup_error
        self.version = frame.version
        self.known.set()
        if frame.closing and self.on_closing is not None:
            self.on_closing()


@dataclass
class Described:
    """The group of hosts, as the core last described it."""

    described: dict

    def describe(self) -> dict:
        return self.described


class CoreResponses:
    """The store of an API process (``[server] api_processes``): the engine core keeps one
    ``ResponseStore`` for all of them, so a response stored through one process is found
    through any. ``put`` goes out at once (before the response's last frames), ``fetch`` asks."""

    def __init__(self, link) -> None:
        self.link = link
        self._sent: set[asyncio.Task] = set()

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        body = msgspec.json.encode({"id": response_id, "messages": messages, "response": response})
        task = asyncio.ensure_future(self.link.call("response_put", body, timeout=30.0))
        self._sent.add(task)
        task.add_done_callback(lambda t: self._sent.discard(t) or t.cancelled() or t.exception())

    async def fetch(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        found = msgspec.json.decode(await self.link.call("response_get", msgspec.json.encode(response_id),
                                                         timeout=30.0))
        return None if found is None else (found[0], found[1])
