"""What the HTTP side may ask of the engine: one interface, two implementations.

- ``neuron.local_client.LocalClient``: the models run in this process (the registry, its rank
  groups); the default.
- ``neuron.server.core_client.CoreClient``: an API process's (``[server] api_processes``); the
  models run in the engine core, reached over ZeroMQ with ``protocol.api_core``'s frames.

The routes, the planning of a request and the admin surface hold an ``EngineClient`` and nothing
else of the engine: a model is a ``ModelView``, its requests go through its ``ModelEngine``
(its ``client``). A request crosses as three things: the API side's output state (``Submitted``:
detokenizer, stop strings, events), the ``EngineRequest`` it hands over, and the engine's own
state of the sequence (``neuron/engine/request.py``), made from that request alone.
``tests/test_engine_client.py`` holds both implementations to these signatures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from .api_core import EngineRequest

if TYPE_CHECKING:
    from neuron.config import Config, EngineConfig, ModelEntry
    from neuron.loader.spec import ModelSpec


@dataclass
class FinishEvent:
    """How a sequence ended, as its engine says."""

    reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # set when reason is abort because something failed
    error_kind: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    host_tokens: int = 0  # ... of them, from its host tier
    disk_tokens: int = 0  # ... of those, read back from the disk tier
    preemptions: int = 0  # times it gave its blocks up to running sequences and was computed again


@dataclass
class EngineStats:
    """What a model's engine reports: ``/models``, ``/metrics`` and the API processes' mirror."""

    running: int
    waiting: int
    slots_used: int
    slots_total: int
    steps: int
    tokens_generated: int
    kv_usage: float = 0.0  # fraction of the KV-cache blocks in use
    kv_blocks: int = 0
    state_slots: int = 0  # per-sequence state slots (models with recurrent layers)
    state_slots_used: int = 0  # ... held by running sequences
    state_snapshots: int = 0  # of them, those for the prefix cache's snapshots
    state_snapshots_used: int = 0
    state_restores: int = 0  # sequences started from a snapshot
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    host_blocks: int = 0  # slots of the prefix cache's host tier (0: none)
    host_used: int = 0  # ... holding a block
    host_hits: int = 0  # prompt tokens found in the host tier (of prefix_cache_hits)
    host_offloaded: int = 0  # blocks copied into it
    host_restored: int = 0  # ... and back
    host_offload_s: float = 0.0  # rank 0's device time copying them in (the ranks copy side by side)
    host_restore_s: float = 0.0  # ... and back
    host_state_offloaded: int = 0  # state snapshots copied into it (a model with recurrent state)
    host_state_restored: int = 0  # ... and back
    disk_blocks: int = 0  # block files the disk tier below it holds at most (0: none)
    disk_used: int = 0
    disk_hits: int = 0  # prompt tokens found there (of prefix_cache_hits)
    disk_written: int = 0  # blocks written to it
    disk_read: int = 0  # ... and read back
    disk_skipped: int = 0  # lookups that computed what it held again, that being faster (engine/tier_choice.py)
    leader_ms_per_step: float = 0.0  # the leader's own time per step (planning, frames, tokens)
    step_ms: float = 0.0  # time between consecutive step results
    rank_host_ms_per_step: float = 0.0
    rank_mask_wait_ms_per_step: float = 0.0  # of it, waiting for late masks (late_masks.py)
    device_idle_ms_per_step: float = 0.0
    image_encodes: int = 0  # images the vision tower ran on
    image_reuses: int = 0  # images whose kept embeddings served again
    spec_drafts: int = 0  # decodes that carried drafts (speculative decoding)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class TokenConstraint(Protocol):
    """Structured output: which tokens may come next. The engine asks ``allowed`` before every
    step that samples the sequence and reports each token it drew with ``accept``; a sequence
    with a constraint never has a step in flight whose token it has not yet seen."""

    def allowed(self) -> bytes | None:
        """A bitmask over the vocabulary (ceil(vocab / 32) little-endian uint32 words), or None."""

    def accept(self, token: int) -> None: ...


class OutputSink(Protocol):
    """Where an engine sends what one sequence draws: the API side's output state (in this
    process), or the link to the API process that holds it (in the engine core)."""

    def token(self, token: int, logprobs: list[tuple[int, float]] | None, end: int) -> bool:
        """A drawn token. ``end``: 0 the sequence goes on, 1 the engine ends it with this token
        (its length), 2 the token is one of its stop ids (its text is not shown). True where a
        stop string ended the text with it: the engine then finishes the sequence as stopped."""
        ...

    def finish(self, event: FinishEvent) -> None: ...


class Submitted(OutputSink, Protocol):
    """What the HTTP side hands a model's engine: the API side's output state of one sequence,
    its ``wire`` request and its constraint (which runs on the API side)."""

    wire: EngineRequest
    constraint: TokenConstraint | None

    def admit(self, cached_tokens: int, error: BaseException | None = None) -> None:
        """The engine admitted the sequence (its prompt found ``cached_tokens`` in the prefix
        cache), or refused it after it was queued (``error``, an ``ApiError``)."""
        ...


class ModelEngine(Protocol):
    """Where a model's requests go: ``submit`` hands one over (what it draws comes back through
    the output state's own methods), ``abort`` ends it early (its client left)."""

    cfg: EngineConfig

    def submit(self, out: Submitted) -> None: ...

    def abort(self, out: Submitted) -> None: ...

    def stats(self) -> EngineStats: ...


class ModelView(Protocol):
    """One model as the HTTP side sees it: what a request is planned with (the spec: tokenizer,
    template, config), how it stands, and its engine."""

    id: str
    entry: ModelEntry
    spec: ModelSpec
    max_len: int
    client: ModelEngine
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
