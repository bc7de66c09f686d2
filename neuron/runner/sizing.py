"""How many KV blocks a rank's cache gets: on a GPU, what the memory left after the weights, the
per-sequence states, the largest step's activations and the sampler allows; on the CPU (or when
told), enough for the configured tokens."""

from __future__ import annotations

import logging

import torch

from neuron.models.ops import StateSpans

from .attention import PagedAttention, PagedKvCache, PrefillSpan, StepMeta
from .graphs import prefill_graph_sizes
from .inputs import chunk_tables

log = logging.getLogger("neuron.runner")


def state_snapshots(runner, specs) -> int:
    """How many state slots to hold beyond one per sequence, for the prefix cache's snapshots:
    as configured, or (-1) as many as a quarter of the memory left after the weights and the
    running sequences' slots holds (the KV cache takes the rest), at most four per sequence (on
    the CPU two per sequence)."""
    from .state import StatePool

    cfg = runner.cfg
    per_slot = StatePool.bytes_per_slot(specs, cfg.state_dtype)
    if not getattr(runner.model, "state_snapshots", False):
        return 0
    if not per_slot or cfg.state_snapshots >= 0:
        return max(0, cfg.state_snapshots) if per_slot else 0
    if not runner.cuda:
        return 2 * cfg.max_seqs
    free, total = torch.cuda.mem_get_info(runner.device)
    budget = (free - total * (1 - cfg.memory_fraction) - (cfg.max_seqs + 1) * per_slot) / 4
    return max(0, min(4 * cfg.max_seqs, int(budget // per_slot)))


def kv_blocks(runner, kv_layers: int, state_bytes: int) -> int:
    """Blocks for ``runner``'s KV cache of ``kv_layers`` layers, beside ``state_bytes`` of
    per-sequence state (allocated before this is called, so already out of the free memory)."""
    cfg, model, bs = runner.cfg, runner.model, runner.bs
    shape = model.attention_shape
    per_block = PagedKvCache.bytes_per_block(kv_layers, bs, shape.n_kv, shape.head_dim, model.dtype)
    peak = largest_step_peak(runner, kv_layers) if runner.cuda and per_block else 0
    if cfg.kv_tokens or not runner.cuda or not per_block:  # (no layer keeps K/V: blocks only count positions)
        tokens = cfg.kv_tokens or cfg.max_seqs * runner.max_blocks * bs
        return max(1, -(-tokens // bs))
    device = runner.device
    if getattr(model, "vision", None) is not None:  # an image's tower run must fit too, on every rank
        peak = max(peak, tower_peak(model, device))
    free, total = torch.cuda.mem_get_info(device)
    sampler_bytes = 6 * (cfg.max_seqs + 1) * runner.vocab  # penalty state, if any sequence wants it
    budget = total * cfg.memory_fraction - (total - free) - peak - sampler_bytes - (256 << 20)
    blocks = int(budget // per_block)
    if blocks < runner.max_blocks:
        raise torch.OutOfMemoryError(
            f"the KV cache would hold {max(0, blocks) * bs} tokens, less than one sequence of "
            f"max_model_len={cfg.max_len} ({runner.states.slots} state slots): raise gpu_memory_utilization, "
            f"lower max_model_len or max_slots")
    log.info("rank %d: KV cache of %d blocks (%d tokens, %.2f GiB), %.2f GiB of per-sequence state; a %d-token "
             "step peaks at %.2f GiB", runner.rank, blocks, blocks * bs, blocks * per_block / 2**30,
             state_bytes / 2**30, largest_step(cfg), peak / 2**30)
    return blocks


def largest_step(cfg) -> int:
    return max(1, min(cfg.max_step_tokens, cfg.max_len), *prefill_graph_sizes(cfg))


def largest_step_peak(runner, kv_layers: int) -> int:
    """Bytes beyond the weights that one eager step of the largest size takes, measured on a
    throwaway cache. Run whether or not the cache is sized by it (``kv_tokens``): it also
    compiles the eager prompt path's kernels, which no graph capture reaches, so the first prompt
    longer than every prefill graph compiles nothing."""
    cfg, model, bs = runner.cfg, runner.model, runner.bs
    shape = model.attention_shape
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    n = largest_step(cfg)
    probe = PagedKvCache(kv_layers, -(-n // bs), bs, shape.n_kv, shape.head_dim, device, model.dtype)
    tables = torch.arange(probe.blocks, device=device, dtype=torch.int32)[None]
    attention = PagedAttention(probe, tables, shape, runner.triton, states=runner.states)
    rows = torch.arange(n, device=device)
    spans = [(0, n, runner.states.scratch)]
    state = StateSpans(spans, None, n)
    if runner.triton:  # the largest step's delta rule runs in chunks
        table, chunks, _ = (torch.from_numpy(t).to(device) for t in chunk_tables(spans, []))
        state = StateSpans(spans, table, n, [], chunks)
    attention.meta = StepMeta(store_index=rows, decode_rows=rows[:0], state_spans=state)
    if runner.triton:
        attention.meta.prefill_spans = torch.tensor([[0, n, 0, 0]], dtype=torch.int32, device=device)
        attention.meta.prefill_max_n = n
    else:
        attention.meta.prefills = [PrefillSpan(0, n, rows)]
    # (a step past max_len is several sequences: positions stay within it)
    model.forward(torch.zeros(n, dtype=torch.long, device=device), rows % max(1, cfg.max_len), attention, rows[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - probe.nbytes
    del probe, attention, tables, rows
    torch.cuda.empty_cache()
    return peak


def tower_peak(model, device: torch.device) -> int:
    """Bytes beyond the weights that the vision tower takes on the largest image the model's
    processor makes (a square of ``max_pixels``), measured."""
    from neuron.loader.images import ImageProcessing

    p = ImageProcessing.from_config(model.cfg.vision["processor"])
    side = p.resized(*(2 * [int(p.max_pixels ** 0.5)]))[0] // p.patch_size
    pixels = torch.zeros(side * side, 3 * p.temporal_patch_size * p.patch_size ** 2, dtype=model.dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model.vision(pixels, [(1, side, side)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del pixels
    torch.cuda.empty_cache()
    log.info("rank %d: the vision tower peaks at %.2f GiB on a %dx%d-patch image", torch.distributed.get_rank()
             if torch.distributed.is_initialized() else 0, peak / 2**30, side, side)
    return peak
