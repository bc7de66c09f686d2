"""What the HTTP side may ask of the engine: one interface, two implementations.

- ``neuron.local_client.LocalClient``: the models run in this process (the registry, its rank
  groups); the default.
- ``neuron.server.core_client.CoreClient``: an API process's (``[server] api_processes``); the
  models run in the engine core, reached over ZeroMQ with ``protocol.api_core``'s frames.

The routes, the planning of a request and the admin surface hold an ``EngineClient`` and nothing
else of the engine: a model is a ``ModelView``, its requests go through its ``ModelEngine``.
``tests/test_engine_client.py`` holds both implementations to these signatures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    from neuron.config import Config, EngineConfig, ModelEntry
    from neuron.engine.request import GenRequest
    from neuron.engine.shape import EngineStats
    from neuron.loader.spec import ModelSpec


class ModelEngine(Protocol):
    """Where a model's requests go: ``submit`` hands one over (its events come back on the
    request's own queue), ``abort`` ends it early (its client left)."""

    cfg: EngineConfig

    def submit(self, req: GenRequest) -> None: ...

    def abort(self, req: GenRequest) -> None: ...

    def stats(self) -> EngineStats: ...


class ModelView(Protocol):
    """One model as the HTTP side sees it: what a request is planned with (the spec: tokenizer,
    template, config), how it stands, and its engine."""

    id: str
    entry: ModelEntry
    spec: ModelSpec
    max_len: int
    engine: ModelEngine
    status: str
    error: str | None

    @property
    def cpu_isa(self) -> str | None: ...

    def describe(self) -> dict: ...

    def telemetry(self) -> list[dict]: ...


class Described(Protocol):
    def describe(self) -> dict: ...


class EngineClient(Protocol):
    models: Mapping[str, Any]  # id -> ModelView
    cluster: Described | None  # the group of hosts, where there is one

    def get(self, model_id: str) -> ModelView:
        """The model of that id or alias; an ``ApiError`` 404 if none serves."""
        ...

    async def start(self, state: Any) -> None:
        """Serving begins: the startup models load (in process) or the core's state is followed;
        ``state`` (the app's) learns when they serve (``starting``, ``startup_error``)."""
        ...

    def responses(self, cfg: Config) -> Any:
        """Where ``/v1/responses`` keeps what it stored (one store for every API process)."""
        ...

    async def refresh(self) -> None:
        """The models' latest state, before an answer that reports it."""
        ...

    async def load(self, entry: ModelEntry) -> ModelView: ...

    async def unload(self, model_id: str, drain_s: float = 30.0) -> str: ...

    async def inject_fault(self, model_id: str, rank: int, kind: str) -> str: ...

    def stop_admission(self) -> None:
        """A drain begins: new requests get 503."""
        ...

    async def drain(self, timeout: float) -> bool:
        """Until nothing runs (True) or ``timeout`` passes (False)."""
        ...

    def abort_all(self, reason: str) -> None: ...

    def kill_all(self) -> None:
        """Exiting now: every rank this process started is killed."""
        ...

    async def shutdown(self) -> None: ...
