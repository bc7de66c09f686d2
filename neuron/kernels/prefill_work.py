"""The prefill attention kernel's tiles, and in a prefill graph its work list: a program per
query tile of the step's chunks.

A captured grid is fixed. Over every span by the longest chunk's tiles (the eager launch's grid)
it held mostly programs that only exit: with 512 slots, ~90k a layer for a step of 704 tokens,
and steps of 512 decodes beside a prompt ran slower than the decodes alone by more than the
prompt's work. Over a list, a graph of T tokens launches at most a program per tile there can be.
"""

from __future__ import annotations

import numpy as np
import torch

from .launch import pow2, shared_memory

WORK_SPAN = 1 << 20  # a work item is span * WORK_SPAN + tile
# by head dim (64 for less, padded to a power of two): the tile's (query, head) rows, keys a step,
# warps, stages; scripts/bench-kernels --prefill-ops
PREFILL_TILES = {64: (64, 64, 4, 3), 128: (128, 128, 8, 2), 256: (128, 64, 8, 2)}
SMALL_TILES = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 8, 3)}  # for GPUs of less shared memory


def prefill_tiles(d_pad: int, device: torch.device) -> tuple[int, int, int, int]:
    """``PREFILL_TILES``' setting for head dim ``d_pad``, or ``SMALL_TILES``' where its query tile
    and its stages of key and value tiles (Triton's own count on an H200) would not fit the GPU's
    shared memory with 8 KiB to spare (an A100's 163 KiB holds the 160 KiB of head dim 128 too
    narrowly to trust)."""
    d = min(max(d_pad, 64), 256)
    rows, block_n, warps, stages = PREFILL_TILES[d]
    need = (rows + 2 * stages * block_n) * d_pad * 2 + 8192
    return PREFILL_TILES[d] if device.type != "cuda" or need <= shared_memory(device) else SMALL_TILES[d]


def prefill_splits(tokens: int, gqa_repeat: int, n_q: int, head_dim: int, sm_count: int,
                   device: torch.device) -> int:
    """Key ranges per query tile in a step of ``tokens`` query rows: as many as give every
    multiprocessor two programs where the step's tiles alone would not (a short question after a
    long cached prefix: a 16-token turn after 28,000 cached tokens was one tile a KV head, eight
    programs each reading every key), a power of two, at most 32. Ranges hold 512 keys at least
    (``paged_prefill``), so a short context uses few of them."""
    group = max(1, gqa_repeat)
    rows = prefill_tiles(pow2(head_dim), device)[0]
    programs = -(-tokens * group // rows) * max(1, n_q // group)
    want = 2 * sm_count // programs
    return 1 if want < 2 else min(32, 1 << (want.bit_length() - 1))


def prefill_work_size(tokens: int, spans: int, gqa_repeat: int, head_dim: int, device: torch.device) -> int:
    """Items of a prefill graph's work list (``prefill_work``): enough for any ``spans`` chunks
    of ``tokens`` in all."""
    rows = prefill_tiles(pow2(head_dim), device)[0]
    return -(-tokens * max(1, gqa_repeat) // rows) + min(spans, tokens)


def prefill_work(ns: np.ndarray, gqa_repeat: int, head_dim: int, device: torch.device, size: int) -> np.ndarray:
    """The prefill kernel's work list for chunks of ``ns`` tokens (span i has ns[i]): one item
    (span * WORK_SPAN + tile) per query tile of a chunk, the tiles that see the most keys first,
    then -1 up to ``size``. A captured grid is fixed; over a list, it holds a program per tile
    there is, where a grid of every span by the longest chunk's tiles held mostly programs that
    only exit."""
    rows = prefill_tiles(pow2(head_dim), device)[0]
    counts = -(-np.asarray(ns, dtype=np.int64) * max(1, gqa_repeat) // rows)
    total = int(counts.sum())
    spans = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    tiles = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort(-tiles, kind="stable")
    out = np.full(size, -1, dtype=np.int64)
    out[:total] = (spans * WORK_SPAN + tiles)[order]
    return out
