"""How a model's steps are shaped (``Sizing``)."""

from __future__ import annotations

from dataclasses import dataclass

from neuron.config import EngineConfig, ModelEntry

from .speculative import DraftPolicy
from .step_budget import StepBudget


@dataclass
class Sizing:
    """How a model's steps are shaped: set at load, from the device the model runs on."""

    max_slots: int
    max_len: int
    max_batch_tokens: int
    prefill_chunk: int  # the longest prompt chunk of a step
    prefill_chunk_decoding: int  # ... of a step that also carries decodes
    steps_in_flight: int = 2  # steps sent before the oldest one's reply is in (overlapped steps)
    cache_key: str | None = None  # the prefix cache's key (what the K/V depends on); None: no cache
    snapshot_interval: int = 512  # tokens between a prompt's state snapshots (models with recurrent state)
    image_token_bytes: int = 0  # a bound on an image token's embedding bytes on a rank
    # Pipeline stages: the running sequences form this many groups, planned in turn, so each
    # stage works on another group's step (micro-batches) instead of waiting for the next token.
    pipeline: int = 1
    speculative: DraftPolicy | None = None  # speculative decoding's drafter and limits; None: off
    # On a GPU: prompt chunks beside decodes sized by the step times measured at load; None: by
    # prefill_chunk_decoding.
    step_budget: StepBudget | None = None



MOE_CHUNK = 8192  # a prompt's tokens a step on a GPU, alone, for a model with experts


def engine_sizes(engine: EngineConfig, entry: ModelEntry, on_gpu: bool, experts: bool = False) -> tuple[int, int, int]:
    """(max_batch_tokens, prefill_chunk, prefill_chunk_decoding) for a model: the configured
    values, or the device's defaults. On a GPU a prompt alone goes in 2048-token chunks (a
    4096-token prompt is two steps), but beside running decodes a step takes at most 192 prompt
    tokens, so the streams it shares a step with stall little (on an H200, Qwen3-8B shape: 8
    streams' ITL p99 1.86x its value alone, against 2.09x with 256-token chunks; the prompt's TTFT
    beside them 213-217 ms against 182-192 ms). A model with ``experts`` takes ``MOE_CHUNK``
    tokens alone: a chunk of a few hundred tokens already routes to nearly every expert, so each
    chunk reads all their weights, and an eager step's launches cost the host the same time
    whatever its length; fewer, longer chunks do both less often."""
    chunk = engine.prefill_chunk or ((MOE_CHUNK if experts else 2048) if on_gpu else 256)
    budget = engine.max_batch_tokens or (chunk + entry.max_slots if on_gpu else 4 * chunk)
    decoding = engine.prefill_chunk_decoding or (192 if on_gpu else chunk)
    return budget, min(chunk, budget), min(decoding, chunk)
