"""What an Engine reports (``EngineStats``) and how a model's steps are shaped (``Sizing``)."""

from __future__ import annotations

from dataclasses import dataclass

from neuron.config import EngineConfig, ModelEntry

from .speculative import DraftPolicy
from .step_budget import StepBudget


@dataclass
class EngineStats:
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
    disk_blocks: int = 0  # block files the disk tier below it holds at most (0: none)
    disk_used: int = 0
    disk_hits: int = 0  # prompt tokens found there (of prefix_cache_hits)
    disk_written: int = 0  # blocks written to it
    disk_read: int = 0  # ... and read back
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
